"""Two vectors on one index set in one message: SCAFFOLD's (x, c) downlink and (Delta y, Delta c) uplink.

The first vector travels in any of the codec's layouts (:mod:`fedpdm_flower.fedapp.compression.codec`, format code in
"payload-format"); the second follows as one extra float32 array of values at the *same* indices, so a sparse
pair costs k + k values and one index set instead of two.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.compression.codec import (
    MalformedPayload,
    SparseVector,
    decode_vector,
    encode_dense,
    encode_sparse,
)
from fedpdm_flower.fedapp.compression.payload import from_arrays, to_arrays

__all__ = ["pair_from_arrays", "pair_to_arrays"]


def pair_to_arrays(first: SparseVector, second: NDArray[Any], *, sparse: bool) -> tuple[list[NDArray[Any]], int]:
    """Encode ``first`` plus the values ``second`` taken at ``first.indices``.

    Parameters
    ----------
    first
        The vector whose index set both share.
    second
        Values of the second vector at ``first.indices`` (length ``first.k``).
    sparse
        True: values plus compact indices (:func:`encode_sparse`); False: ``first`` dense, zero-padded.

    Returns
    -------
    tuple[list[NDArray], int]
        The positional arrays (the codec layout of ``first``, then float32 ``second``) and the format code.
    """
    second = np.asarray(second).reshape(-1)
    if second.shape[0] != first.k:
        raise ValueError(f"second has {second.shape[0]} values, expected k = {first.k}")
    if sparse:
        arrays, code = to_arrays(encode_sparse(first))
        return [*arrays, second.astype(np.float32)], code
    arrays, code = to_arrays(encode_dense(first.to_dense()))
    full = np.zeros(first.dim, dtype=np.float32)
    full[first.indices] = second
    return [*arrays, full], code


def pair_from_arrays(
    arrays: list[NDArray[Any]], code: Any, dim: int, max_k: int | None = None
) -> tuple[SparseVector, SparseVector]:
    """Validate and decode what :func:`pair_to_arrays` produced.

    Parameters
    ----------
    arrays
        The received positional arrays.
    code
        The "payload-format" code of the first vector.
    dim
        Expected dimension d.
    max_k
        Largest number of entries accepted (None: no limit), as in :func:`decode_vector`.

    Returns
    -------
    tuple[SparseVector, SparseVector]
        Both vectors, on the same indices.

    Raises
    ------
    MalformedPayload
        If either part fails the codec's checks or the second part's length differs from the first's k.
    """
    if len(arrays) < 2:
        raise MalformedPayload(f"a paired payload needs the first vector's arrays plus one more, got {len(arrays)}")
    first = decode_vector(from_arrays(arrays[:-1], code), dim, max_k=max_k)
    second = decode_vector({"dense": arrays[-1]}, first.k)  # same checks: 1-D, floating, finite, length k
    return first, SparseVector(indices=first.indices, values=second.values, dim=dim)
