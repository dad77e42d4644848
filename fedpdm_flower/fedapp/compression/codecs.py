"""Codecs: compress a vector to a compact payload and back, for any strategy's messages.

A codec has a ``spec`` string (what a message says it used), ``encode(v, rng) -> dict[str, ndarray]`` and
``decode(arrays, dim) -> ndarray`` that validates an untrusted payload (raising
:class:`fedpdm_flower.fedapp.compression.codec.MalformedPayload`). Three are provided, each in the module of its math:

* :class:`fedpdm_flower.fedapp.compression.sparsify.TopK` -- k largest magnitudes, k float32 values + compact indices;
* :class:`fedpdm_flower.fedapp.compression.sparsify.RandK` -- k uniformly random coordinates, same payload;
* :class:`fedpdm_flower.fedapp.compression.quantize.Quantizer` -- b-bit unbiased stochastic quantization, bit-packed levels.

``shared_support`` tells whether the encodings of different clients add up to the encoding of the sum (a secure
sum can only carry such codes); none of the three has it with independent client draws.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.compression.quantize import Quantizer
from fedpdm_flower.fedapp.compression.sparsify import RandK, TopK

__all__ = ["Codec", "Quantizer", "RandK", "TopK", "codec_from_spec"]


class Codec(Protocol):
    """What a codec offers to the wrappers and mods."""

    @property
    def spec(self) -> str:
        """``"<name>:<parameter>"`` as carried in a message."""
        ...

    def encode(self, v: NDArray[Any], rng: np.random.Generator | None = None) -> dict[str, NDArray[Any]]:
        """The compact payload of v."""
        ...

    def decode(self, arrays: Any, dim: int) -> NDArray[np.float64]:
        """The dense vector of a payload (validated)."""
        ...


def codec_from_spec(spec: str) -> TopK | Quantizer:
    """The codec a message names: ``"topk:<fraction>"``, ``"randk:<fraction>"`` or ``"quant:<bits>"``.

    Raises ValueError naming the spec when it is not one of these (a message is untrusted input).
    """
    name, _, arg = str(spec).partition(":")
    try:
        if name == "topk":
            return TopK(float(arg))
        if name == "randk":
            return RandK(float(arg))
        if name == "quant":
            return Quantizer(int(arg))
    except ValueError as err:
        raise ValueError(f"bad codec spec {spec!r}: {err}") from None
    raise ValueError(f"unknown codec {spec!r}; expected 'topk:<fraction>', 'randk:<fraction>' or 'quant:<bits>'")
