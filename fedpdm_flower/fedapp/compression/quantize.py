"""DPQ-DSGD's probabilistic quantizer (paper eq. (3), Assumption 3) and the wire codec of its integer levels.

Quantizer (spec 2.2)
--------------------
Coordinate-wise unbiased randomized rounding onto the infinite grid ``q_step * Z``: with ``s = v / q_step`` (float64),
``l = floor(s)`` and ``p = s - l`` in [0, 1), the level is ``m = l + 1`` with probability p and ``m = l`` otherwise,
implemented as ``m = l + (U < p)`` with one ``U ~ Uniform[0, 1)`` per coordinate. Then ``E[q_step * m] = v`` and
``Var[q_step * m] = q_step^2 p (1 - p) <= q_step^2 / 4`` (tighter than the paper's Assumption 3 bound q_step^2).
There is no clipping and no finite range, so the output is unbiased for every input; grid points (p = 0) are
returned deterministically. The sender transmits the int64 levels m; the receiver rebuilds ``z = q_step * m``
(:func:`dequantize`); q_step is a run constant and never travels with the message.

Wire codec (spec 3)
-------------------
The grid is unbounded (Gaussian noise), so a message uses the fewest bits its own level range needs. A message is
``{"qlevels": uint8[13 + ceil(count * width / 8)]}`` (one Flower ``ArrayRecord`` entry, an integer dtype as spec
7.7 requires of every quantized upload), laid out as

====== ======= ===================================================================================
bytes  type    meaning
====== ======= ===================================================================================
0..7   int64   offset = min level (little-endian)
8      uint8   width w = bit_length(max - min) = ceil(log2 R), R = max - min + 1; 0 when R = 1
9..12  uint32  count = number of coordinates d (little-endian)
13..   bits    the d values ``m - offset``, each w bits, most significant bit first, concatenated and
               packed with ``np.packbits`` (big bit order); the last byte is zero-padded
====== ======= ===================================================================================

so the serialized size is ``13 + ceil(d w / 8)`` bytes against the spec's accounting rule ``d w + 40`` bits
(:func:`message_bits`; its 40-bit header assumes an int32 offset and no count): at most 71 bits more. Any width
0..64 is supported, so every int64 level vector round-trips exactly (the span ``max - min`` of int64 values fits
in 64 bits; differences are taken modulo 2^64). :func:`decode_levels` refuses malformed payloads with
:class:`~fedpdm_flower.fedapp.compression.codec.MalformedPayload` (a ``ValueError``), including non-canonical ones (offset other
than the minimum, width wider than the span needs): the encoding of a level vector is unique, so a message cannot
be padded with wasted bits.

With quantization off (``q_step = 0``) the message is the float32 vector ``{"dense": float32[d]}``, the same form
as :func:`fedpdm_flower.fedapp.compression.codec.encode_dense` (:func:`encode_float32`); it is also the 32 d-bit reference of the
compression ratio (:func:`float32_message_bits`). :func:`decode_message` accepts either form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from fedpdm_flower.fedapp.compression.codec import MalformedPayload

__all__ = [
    "HEADER_BITS",
    "WIRE_HEADER_BYTES",
    "Quantizer",
    "decode_float32",
    "decode_levels",
    "decode_message",
    "dequantize",
    "empirical_entropy_bits",
    "encode_float32",
    "encode_levels",
    "float32_message_bits",
    "level_width",
    "message_bits",
    "quantize",
    "quantize_levels",
    "quantizer_variance",
]

HEADER_BITS = 40
"""Header of the spec's bit-accounting rule (spec 3): int32 m_min + 8-bit width."""

WIRE_HEADER_BYTES = 13
"""Header of the actual wire payload: int64 offset, uint8 width, uint32 count."""

_LEVELS, _DENSE = "qlevels", "dense"
_MAX_WIDTH = 64
_MAX_COUNT = 2**32 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# |v / q_step| must stay below 2^63 so that floor(s) + 1 is an int64.
_LEVEL_LIMIT = 2.0**63


def _check_step(q_step: float) -> float:
    if isinstance(q_step, bool) or not isinstance(q_step, (int, float, np.floating, np.integer)):
        raise TypeError(f"q_step must be a real number, got {type(q_step).__name__}")
    step = float(q_step)
    if not (math.isfinite(step) and step > 0.0):
        raise ValueError(f"q_step must be a finite number > 0, got {q_step!r}")
    return step


def _scaled(v: ArrayLike, step: float) -> NDArray[np.float64]:
    arr = np.asarray(v)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"v must be a real array, got dtype {arr.dtype}")
    s = np.asarray(arr, dtype=np.float64) / step
    if not np.all(np.isfinite(s)):
        raise ValueError("v contains NaN or Inf (or v / q_step overflows)")
    if s.size and float(np.max(np.abs(s))) >= _LEVEL_LIMIT:
        raise ValueError(f"|v / q_step| must be < 2^63 for int64 levels, got {float(np.max(np.abs(s))):.3e}")
    return s


def quantize_levels(v: ArrayLike, q_step: float, rng: np.random.Generator) -> NDArray[np.int64]:
    """Integer levels m of the probabilistic quantizer (3): ``Q(v) = q_step * m``, coordinate-wise.

    Parameters
    ----------
    v
        Real input of any shape (the noisy state x + n); computed in float64.
    q_step
        Grid step Delta > 0.
    rng
        Source of the rounding uniforms. Exactly ``v.size`` draws of ``rng.random`` are consumed (C order), grid
        points included, so the stream position does not depend on the data (spec 7.6 counter-based seeds).

    Returns
    -------
    NDArray[np.int64]
        ``floor(v / q_step) + 1`` with probability ``v / q_step - floor(v / q_step)``, else ``floor(v / q_step)``;
        the shape of ``v``.

    Raises
    ------
    ValueError
        If ``q_step`` is not finite and > 0, ``v`` holds NaN/Inf, or ``|v / q_step| >= 2^63``.
    """
    step = _check_step(q_step)
    s = _scaled(v, step)
    low = np.floor(s)
    up = rng.random(s.shape) < (s - low)
    return low.astype(np.int64) + up.astype(np.int64)


def dequantize(levels: ArrayLike, q_step: float) -> NDArray[np.float64]:
    """The receiver's reconstruction ``z = q_step * m`` (float64) from integer levels."""
    step = _check_step(q_step)
    m = np.asarray(levels)
    if not np.issubdtype(m.dtype, np.integer):
        raise TypeError(f"levels must be integers, got dtype {m.dtype}")
    return m.astype(np.float64) * step


def quantize(v: ArrayLike, q_step: float | None, rng: np.random.Generator) -> NDArray[np.float64]:
    """``Q(v)`` of eq. (3) as float64 values on the grid; ``q_step`` 0 or None is the identity (no draws).

    Equal to ``dequantize(quantize_levels(v, q_step, rng), q_step)``.
    """
    if q_step is None or (not isinstance(q_step, bool) and isinstance(q_step, (int, float)) and q_step == 0):
        return np.array(v, dtype=np.float64)
    return dequantize(quantize_levels(v, q_step, rng), q_step)


def quantizer_variance(v: ArrayLike, q_step: float) -> NDArray[np.float64]:
    """Exact conditional variance ``q_step^2 p (1 - p)`` of Q(v), p = v / q_step - floor(v / q_step) (<= q_step^2/4)."""
    step = _check_step(q_step)
    s = _scaled(v, step)
    p = s - np.floor(s)
    return step * step * p * (1.0 - p)


# ----------------------------------------------------------------------------------------------------------- sizes


def _as_levels(levels: ArrayLike) -> NDArray[np.int64]:
    arr = np.asarray(levels)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"levels must have an integer dtype, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"levels must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
        raise ValueError(f"levels must fit in int64, got {int(arr.max())}")
    return arr.astype(np.int64, copy=False)


def level_width(levels: ArrayLike) -> int:
    """Bits per coordinate b = ceil(log2 R), R = max - min + 1 (0 for a constant or empty vector; spec 3)."""
    m = _as_levels(levels)
    if m.size == 0:
        return 0
    return (int(m.max()) - int(m.min())).bit_length()


def message_bits(levels: ArrayLike) -> int:
    """Spec 3 / 7.5 accounting size of one quantized message: ``d * b + 40`` bits (:data:`HEADER_BITS`)."""
    m = _as_levels(levels)
    return int(m.size) * level_width(m) + HEADER_BITS


def float32_message_bits(dim: int) -> int:
    """Size of the unquantized message and of the compression reference: ``32 * d`` bits."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 0:
        raise ValueError(f"dim must be an integer >= 0, got {dim!r}")
    return 32 * int(dim)


def empirical_entropy_bits(levels: ArrayLike) -> float:
    """Empirical entropy of the levels in bits per coordinate (a lower bound for entropy coding; 0 if empty)."""
    m = _as_levels(levels)
    if m.size == 0:
        return 0.0
    _, counts = np.unique(m, return_counts=True)
    p = counts / m.size
    return float(max(0.0, -np.sum(p * np.log2(p))))


# ----------------------------------------------------------------------------------------------------------- codec


def encode_levels(levels: ArrayLike) -> dict[str, NDArray[np.uint8]]:
    """Bit-pack integer levels with the width their range needs (module docstring for the layout).

    Parameters
    ----------
    levels
        1-D integer array (any integer dtype whose values fit in int64), e.g. from :func:`quantize_levels`.

    Returns
    -------
    dict[str, NDArray[np.uint8]]
        ``{"qlevels": uint8[13 + ceil(d * w / 8)]}``.

    Raises
    ------
    TypeError, ValueError
        If ``levels`` is not a 1-D integer array within int64, or has more than 2^32 - 1 entries.
    """
    m = _as_levels(levels)
    count = int(m.size)
    if count > _MAX_COUNT:
        raise ValueError(f"at most {_MAX_COUNT} levels fit one message, got {count}")
    offset = int(m.min()) if count else 0
    width = level_width(m)
    header = np.empty(WIRE_HEADER_BYTES, dtype=np.uint8)
    header[0:8] = np.frombuffer(np.array([offset], dtype="<i8").tobytes(), dtype=np.uint8)
    header[8] = width
    header[9:13] = np.frombuffer(np.array([count], dtype="<u4").tobytes(), dtype=np.uint8)
    if width == 0:
        return {_LEVELS: header}
    # m - offset modulo 2^64 is the exact non-negative difference (< 2^width <= 2^64), also for a 64-bit span.
    diff = m.astype(np.uint64) - np.uint64(offset % 2**64)
    # Row i = the 64 bits of diff[i], MSB first; keep the low `width` columns and pack row after row.
    bits = np.unpackbits(diff.astype(">u8").view(np.uint8).reshape(count, 8), axis=1)[:, _MAX_WIDTH - width :]
    return {_LEVELS: np.concatenate([header, np.packbits(bits.reshape(-1))])}


def _header(raw: NDArray[Any]) -> tuple[int, int, int]:
    if raw.shape[0] < WIRE_HEADER_BYTES:
        raise MalformedPayload(
            f"'{_LEVELS}' has {raw.shape[0]} bytes, shorter than its {WIRE_HEADER_BYTES}-byte header"
        )
    offset = int(np.frombuffer(raw[0:8].tobytes(), dtype="<i8")[0])
    width = int(raw[8])
    count = int(np.frombuffer(raw[9:13].tobytes(), dtype="<u4")[0])
    return offset, width, count


def decode_levels(arrays: Mapping[str, Any], count: int | None = None) -> NDArray[np.int64]:
    """Validate and decode an :func:`encode_levels` payload back to the exact int64 levels.

    Parameters
    ----------
    arrays
        The received arrays by key; exactly ``{"qlevels": uint8[...]}``.
    count
        Expected number of coordinates d (the model dimension), or None to accept the header's count.

    Returns
    -------
    NDArray[np.int64]
        The levels, length ``count``.

    Raises
    ------
    MalformedPayload
        On wrong keys, a non-ndarray, wrong dtype or ndim, a payload shorter than the header, width > 64, a header
        count different from ``count``, a body length other than ``ceil(count * width / 8)``, non-zero padding bits,
        ``offset + value`` beyond int64, or a non-canonical header (offset other than the smallest level, width
        other than the bits the span needs: :func:`encode_levels` never writes one).
    """
    keys = set(arrays.keys())
    if keys != {_LEVELS}:
        raise MalformedPayload(f"quantized payload must have exactly the key {_LEVELS!r}, got {sorted(keys)}")
    raw = arrays[_LEVELS]
    if not isinstance(raw, np.ndarray):
        raise MalformedPayload(f"{_LEVELS!r} is not an ndarray (got {type(raw).__name__})")
    if raw.ndim != 1:
        raise MalformedPayload(f"{_LEVELS!r} has wrong ndim {raw.ndim}, expected 1")
    if raw.dtype != np.uint8:
        raise MalformedPayload(f"{_LEVELS!r} has wrong dtype {raw.dtype}, expected uint8")
    offset, width, n = _header(raw)
    if width > _MAX_WIDTH:
        raise MalformedPayload(f"header width {width} exceeds {_MAX_WIDTH} bits")
    if count is not None and n != count:
        raise MalformedPayload(f"header count {n} != expected count {count}")
    body = raw[WIRE_HEADER_BYTES:]
    nbits = n * width
    expected = (nbits + 7) // 8
    if body.shape[0] != expected:
        raise MalformedPayload(
            f"body has {body.shape[0]} bytes, but count {n} x width {width} needs ceil({nbits}/8) = {expected}"
        )
    if width == 0:
        if n == 0 and offset != 0:
            raise MalformedPayload(f"non-canonical header: an empty message has offset 0, got {offset}")
        return np.full(n, offset, dtype=np.int64)
    flat = np.unpackbits(body)
    if np.any(flat[nbits:]):
        raise MalformedPayload("padding bits after the last level are not zero")
    full = np.zeros((n, _MAX_WIDTH), dtype=np.uint8)
    full[:, _MAX_WIDTH - width :] = flat[:nbits].reshape(n, width)
    diff = np.packbits(full, axis=1).view(">u8").reshape(n).astype(np.uint64)
    # The encoding is canonical (offset = the smallest level, width = the bits the span needs), so one level vector
    # has exactly one payload: a sender cannot pad its message (the server forwards it to every neighbour) or
    # disguise its level range.
    low, span = int(diff.min()), int(diff.max())
    if low != 0:
        raise MalformedPayload(f"non-canonical header: offset {offset} is not the smallest level ({offset + low})")
    if span.bit_length() != width:
        raise MalformedPayload(f"non-canonical header: width {width}, but the levels span {span} needs "
                               f"{span.bit_length()} bits")
    if offset + span > _INT64_MAX:
        raise MalformedPayload(f"offset {offset} + value {span} overflows int64")
    return (diff + np.uint64(offset % 2**64)).view(np.int64)


def encode_float32(x: ArrayLike) -> dict[str, NDArray[np.float32]]:
    """Unquantized message / reference encoding ``{"dense": float32[d]}`` (as ``codec.encode_dense``)."""
    return {_DENSE: np.asarray(x).reshape(-1).astype(np.float32)}


def decode_float32(arrays: Mapping[str, Any], count: int | None = None) -> NDArray[np.float64]:
    """Validate and decode ``{"dense": float32[d]}`` to float64 (finite values, length ``count`` if given)."""
    keys = set(arrays.keys())
    if keys != {_DENSE}:
        raise MalformedPayload(f"dense payload must have exactly the key {_DENSE!r}, got {sorted(keys)}")
    raw = arrays[_DENSE]
    if not isinstance(raw, np.ndarray):
        raise MalformedPayload(f"{_DENSE!r} is not an ndarray (got {type(raw).__name__})")
    if raw.ndim != 1:
        raise MalformedPayload(f"{_DENSE!r} has wrong ndim {raw.ndim}, expected 1")
    if raw.dtype != np.float32:
        raise MalformedPayload(f"{_DENSE!r} has wrong dtype {raw.dtype}, expected float32")
    if count is not None and raw.shape[0] != count:
        raise MalformedPayload(f"{_DENSE!r} length {raw.shape[0]} != expected count {count}")
    if not np.all(np.isfinite(raw)):
        raise MalformedPayload(f"{_DENSE!r} contains non-finite values (NaN or Inf)")
    return raw.astype(np.float64)


def decode_message(arrays: Mapping[str, Any], q_step: float | None, count: int | None = None) -> NDArray[np.float64]:
    """Decode one DPQ-DSGD message to the float64 vector z the receiver mixes.

    With ``q_step > 0`` only the quantized form is accepted and ``z = q_step * m``; with ``q_step`` 0 or None only
    the float32 form. A message in the other form raises :class:`MalformedPayload` (no silent mode mixing).
    """
    if q_step is None or (not isinstance(q_step, bool) and isinstance(q_step, (int, float)) and q_step == 0):
        return decode_float32(arrays, count)
    step = _check_step(q_step)
    return decode_levels(arrays, count).astype(np.float64) * step


@dataclass(frozen=True)
class Quantizer:
    """The b-bit unbiased stochastic quantizer as a codec: levels in [-L, L], L = 2^(b-1) - 1, of the step
    s = max|v| / L, rounded randomly as in eq. (3) (:func:`quantize_levels`), so ``E[decode(encode(v))] = v``
    coordinate-wise and the error is below s per coordinate. The payload is the bit-packed levels (b bits each,
    :func:`encode_levels`) plus the float64 step.

    Parameters
    ----------
    bits
        b >= 2 bits per coordinate.
    """

    bits: int
    name: ClassVar[str] = "quant"
    #: a dense code, but each client has its own step: encodings of different clients do not sum to the code of
    #: the sum (a secure sum needs a common step)
    shared_support: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 32:
            raise ValueError(f"Quantizer bits must be an integer in [2, 32], got {self.bits!r}")

    @property
    def spec(self) -> str:
        """``"quant:<bits>"``, the form a message carries."""
        return f"{self.name}:{self.bits}"

    @property
    def max_level(self) -> int:
        """L = 2^(b-1) - 1."""
        return int(2 ** (self.bits - 1)) - 1

    def encode(self, v: ArrayLike, rng: np.random.Generator | None = None) -> dict[str, NDArray[Any]]:
        """Bit-packed levels and the step of v (``rng`` draws the rounding and is required)."""
        if rng is None:
            raise ValueError("the stochastic quantizer needs a random generator")
        vec = np.asarray(v, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(vec)):
            raise ValueError("cannot quantize NaN or Inf")
        peak = float(np.max(np.abs(vec))) if vec.size else 0.0
        step = peak / self.max_level if peak > 0 else 1.0
        levels = np.clip(quantize_levels(vec, step, rng), -self.max_level, self.max_level)
        return {**encode_levels(levels), "step": np.array([step], dtype=np.float64)}

    def decode(self, arrays: Mapping[str, Any], dim: int) -> NDArray[np.float64]:
        """The dense reconstruction ``step * levels`` (MalformedPayload on any inconsistency)."""
        if set(arrays) != {_LEVELS, "step"}:
            raise MalformedPayload(f"a quantized payload has keys ['qlevels', 'step'], got {sorted(arrays)}")
        step_arr = np.asarray(arrays["step"])
        if step_arr.dtype != np.float64 or step_arr.shape != (1,) or not np.isfinite(step_arr[0]) or step_arr[0] <= 0:
            raise MalformedPayload("'step' must be one finite float64 > 0")
        levels = decode_levels({_LEVELS: arrays[_LEVELS]}, count=dim)
        if levels.size and int(np.max(np.abs(levels))) > self.max_level:
            raise MalformedPayload(f"levels exceed +-{self.max_level} of a {self.bits}-bit quantizer")
        return levels.astype(np.float64) * float(step_arr[0])
