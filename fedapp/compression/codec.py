"""Wire format of (sparse) model vectors: k float32 values plus compact indices, never a dense array of zeros.

A payload is a ``dict[str, ndarray]`` (one Flower ``ArrayRecord``) in one of three forms:

* ``{"dense": float32[d]}``                      a dense vector (DP-FedPDM, eq. 11);
* ``{"val": float32[k], "idx": uint{8,16,32}[k]}``  k (index, value) pairs (BSDP-FedPDM, eqs. 19 and 27);
* ``{"val": float32[k], "mask": uint8[ceil(d/8)]}`` the same pairs with the index set as a packed bitmask.

The encoder picks the smallest index dtype that holds d - 1, and switches to the bitmask when it is smaller
(k * itemsize > ceil(d / 8), e.g. d = 7850 and k = 785: 1570 B of uint16 against 982 B of mask). Either way the
values travel in ascending index order. The decoder validates everything a client could get wrong or forge
(DESIGN.md, "Bad input") and raises :class:`MalformedPayload`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "FLOAT32_MAX",
    "MalformedPayload",
    "SparseVector",
    "decode_vector",
    "encode_dense",
    "encode_sparse",
    "payload_nbytes",
    "wire_round",
]

#: largest magnitude a value can have on the wire (float32); anything larger arrives as inf and is rejected
FLOAT32_MAX = float(np.finfo(np.float32).max)

_DENSE, _VAL, _IDX, _MASK = "dense", "val", "idx", "mask"
_ACCEPTED_KEYSETS = ({_DENSE}, {_VAL, _IDX}, {_VAL, _MASK})


class MalformedPayload(ValueError):
    """A received vector payload is invalid; the message names the problem."""


@dataclass(frozen=True, eq=False)
class SparseVector:
    """A vector of dimension ``dim`` given by its entries at ``indices`` (zero elsewhere).

    Parameters
    ----------
    indices
        Ascending, unique indices in [0, dim); stored as int64.
    values
        The entries at ``indices`` (same length); stored as float64. An explicit 0.0 still counts as sent (A10).
    dim
        Dimension d of the dense vector.
    """

    indices: NDArray[np.int64]
    values: NDArray[np.float64]
    dim: int

    def __post_init__(self) -> None:
        idx = np.asarray(self.indices)
        val = np.asarray(self.values)
        if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)) or self.dim < 1:
            raise ValueError(f"dim must be an integer >= 1, got {self.dim!r}")
        if idx.ndim != 1 or val.ndim != 1 or idx.shape != val.shape:
            raise ValueError(f"indices and values must be 1-D of equal length, got {idx.shape} and {val.shape}")
        if idx.size and not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"indices must be integers, got dtype {idx.dtype}")
        idx = idx.astype(np.int64, copy=False)
        if idx.size and (idx[0] < 0 or idx[-1] >= self.dim or np.any(np.diff(idx) <= 0)):
            raise ValueError(f"indices must be strictly ascending within [0, {self.dim})")
        # Bypass frozen to normalise dtypes once; callers then rely on int64/float64.
        object.__setattr__(self, "indices", idx)
        object.__setattr__(self, "values", val.astype(np.float64, copy=False))
        object.__setattr__(self, "dim", int(self.dim))

    @classmethod
    def from_dense(cls, x: NDArray[Any], indices: NDArray[np.int64]) -> SparseVector:
        """Gather ``x[indices]`` into a sparse vector of dimension ``len(x)``, e.g. after :func:`top_k`."""
        vec = np.asarray(x, dtype=np.float64).reshape(-1)
        idx = np.asarray(indices, dtype=np.int64)
        return cls(indices=idx, values=vec[idx], dim=vec.shape[0])

    @property
    def k(self) -> int:
        """Number of transmitted entries."""
        return int(self.indices.shape[0])

    def to_dense(self) -> NDArray[np.float64]:
        """Zero-padded dense vector of length ``dim`` (Alg. 2, lines 2 and 7)."""
        out = np.zeros(self.dim, dtype=np.float64)
        out[self.indices] = self.values
        return out


def _index_dtype(dim: int) -> type[np.unsignedinteger[Any]]:
    # Smallest unsigned dtype whose range holds every index 0..dim-1.
    for dtype in (np.uint8, np.uint16, np.uint32):
        if dim - 1 <= np.iinfo(dtype).max:
            return dtype
    return np.uint64


def _mask_nbytes(dim: int) -> int:
    return (dim + 7) // 8


def encode_sparse(v: SparseVector) -> dict[str, NDArray[Any]]:
    """Encode ``v`` as float32 values plus whichever index encoding is smaller.

    Parameters
    ----------
    v
        The sparse vector (indices ascending, so the values are in index order on the wire).

    Returns
    -------
    dict[str, NDArray]
        ``{"val", "idx"}`` with the smallest unsigned index dtype, or ``{"val", "mask"}`` with a packed bitmask
        (``np.packbits``, big bit order) when ``ceil(dim / 8) < k * itemsize``. Ties go to ``idx``.
    """
    val = v.values.astype(np.float32)
    idx_dtype = _index_dtype(v.dim)
    if _mask_nbytes(v.dim) < v.k * np.dtype(idx_dtype).itemsize:
        bits = np.zeros(v.dim, dtype=np.bool_)
        bits[v.indices] = True
        return {_VAL: val, _MASK: np.packbits(bits)}
    return {_VAL: val, _IDX: v.indices.astype(idx_dtype)}


def encode_dense(x: NDArray[Any]) -> dict[str, NDArray[Any]]:
    """Encode a dense vector as ``{"dense": float32[d]}`` (flattened row-major)."""
    return {_DENSE: np.asarray(x).reshape(-1).astype(np.float32)}


def wire_round(x: NDArray[Any]) -> NDArray[np.float64]:
    """The float64 value the receiver decodes from a dense upload or downlink of ``x`` (float32 on the wire).

    Algorithms whose two ends must compute identical numbers from a transmitted vector (DP-IADMM's replicated
    duals, spec 9.8) apply this to the sender's copy, so sender and receiver use the same array.
    """
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def _array(arrays: Mapping[str, Any], key: str) -> NDArray[Any]:
    arr = arrays[key]
    if not isinstance(arr, np.ndarray):
        raise MalformedPayload(f"{key!r} is not an ndarray (got {type(arr).__name__})")
    if arr.ndim != 1:
        raise MalformedPayload(f"{key!r} has wrong ndim {arr.ndim}, expected 1")
    return arr


def _floating(arrays: Mapping[str, Any], key: str) -> NDArray[np.float64]:
    arr = _array(arrays, key)
    if not np.issubdtype(arr.dtype, np.floating):
        raise MalformedPayload(f"{key!r} has wrong dtype {arr.dtype}, expected a floating dtype")
    if not np.all(np.isfinite(arr)):
        raise MalformedPayload(f"{key!r} contains non-finite values (NaN or Inf)")
    return arr.astype(np.float64)


def _check_k(k: int, max_k: int | None) -> None:
    if max_k is not None and k > max_k:
        raise MalformedPayload(f"payload is oversized: k = {k} entries exceed max_k = {max_k}")


def _decode_idx(raw: NDArray[Any], dim: int) -> NDArray[np.int64]:
    if not np.issubdtype(raw.dtype, np.integer):
        raise MalformedPayload(f"'idx' has wrong dtype {raw.dtype}, expected an integer dtype")
    if raw.size:
        # Range is checked in the sender's dtype, before the int64 cast could wrap huge uint64 values.
        if np.issubdtype(raw.dtype, np.signedinteger) and raw.min() < 0:
            raise MalformedPayload(f"'idx' has an index out of range: {raw.min()} < 0")
        if raw.max() >= dim:
            raise MalformedPayload(f"'idx' has an index out of range: {raw.max()} >= dim = {dim}")
    idx = raw.astype(np.int64)
    steps = np.diff(idx)
    if np.any(steps == 0):
        raise MalformedPayload("'idx' has duplicated indices")
    if np.any(steps < 0):
        raise MalformedPayload("'idx' is not in ascending order")
    return idx


def _decode_mask(raw: NDArray[Any], dim: int) -> NDArray[np.int64]:
    if raw.dtype != np.uint8:
        raise MalformedPayload(f"'mask' has wrong dtype {raw.dtype}, expected uint8")
    if raw.shape[0] != _mask_nbytes(dim):
        raise MalformedPayload(f"'mask' length {raw.shape[0]} is wrong, expected ceil({dim}/8) = {_mask_nbytes(dim)}")
    bits = np.unpackbits(raw)
    if np.any(bits[dim:]):
        raise MalformedPayload(f"'mask' sets padding bits beyond dim = {dim}")
    return np.flatnonzero(bits[:dim]).astype(np.int64)


def decode_vector(arrays: Mapping[str, Any], dim: int, max_k: int | None = None) -> SparseVector:
    """Validate and decode a received payload in any of the three forms.

    Parameters
    ----------
    arrays
        The received arrays by key (``{"dense"}``, ``{"val", "idx"}`` or ``{"val", "mask"}``).
    dim
        Expected dimension d.
    max_k
        Largest number of entries the receiver accepts (e.g. the configured k); None for no limit. It also applies
        to the dense form, whose k is ``dim``.

    Returns
    -------
    SparseVector
        The decoded vector; a dense payload decodes to all ``dim`` indices.

    Raises
    ------
    MalformedPayload
        On missing or unexpected keys, wrong dtype or ndim, NaN/Inf values, indices out of range, duplicated or
        not ascending, ``len(idx) != len(val)``, wrong mask length or popcount, ``k > max_k``, or a dense vector
        whose length is not ``dim``.
    """
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ValueError(f"dim must be an integer >= 1, got {dim!r}")
    keys = set(arrays.keys())
    if keys not in _ACCEPTED_KEYSETS:
        if not keys:
            raise MalformedPayload("payload is empty: missing keys, expected 'dense' or 'val' with 'idx'/'mask'")
        if keys == {_VAL}:
            raise MalformedPayload("missing key: 'val' needs 'idx' or 'mask'")
        if keys in ({_IDX}, {_MASK}):
            raise MalformedPayload(f"missing key 'val' next to {sorted(keys)}")
        raise MalformedPayload(
            f"unexpected key combination {sorted(keys)}; expected ['dense'], ['idx', 'val'] or ['mask', 'val']"
        )

    if keys == {_DENSE}:
        dense = _floating(arrays, _DENSE)
        if dense.shape[0] != dim:
            raise MalformedPayload(f"'dense' length {dense.shape[0]} != dim = {dim}")
        _check_k(dim, max_k)
        return SparseVector(indices=np.arange(dim, dtype=np.int64), values=dense, dim=dim)

    # Cheap shape checks first, so an oversized payload is rejected before its contents are scanned.
    raw_val = _array(arrays, _VAL)
    _check_k(raw_val.shape[0], max_k)
    val = _floating(arrays, _VAL)
    if _IDX in keys:
        raw_idx = _array(arrays, _IDX)
        if raw_idx.shape[0] != val.shape[0]:
            raise MalformedPayload(f"length mismatch: len(idx) = {raw_idx.shape[0]} != len(val) = {val.shape[0]}")
        idx = _decode_idx(raw_idx, dim)
    else:
        idx = _decode_mask(_array(arrays, _MASK), dim)
        if idx.shape[0] != val.shape[0]:
            raise MalformedPayload(f"'mask' popcount {idx.shape[0]} != len(val) = {val.shape[0]}")
    return SparseVector(indices=idx, values=val, dim=dim)


def payload_nbytes(arrays: Mapping[str, NDArray[Any]]) -> int:
    """Sum of the arrays' ``nbytes``: the payload size before Flower's serialisation overhead (informational)."""
    return int(sum(int(a.nbytes) for a in arrays.values()))
