"""Wire format of (sparse) model vectors: k float32 values plus compact indices, never a dense array of zeros.

A payload is a ``dict[str, ndarray]`` (one Flower ``ArrayRecord``) in one of three forms:

* ``{"dense": float32[d]}``                      a dense vector (DP-FedPDM, eq. 11);
* ``{"val": float32[k], "idx": uint{8,16,32}[k]}``  k (index, value) pairs (BSDP-FedPDM, eqs. 19 and 27);
* ``{"val": float32[k], "mask": uint8[ceil(d/8)]}`` the same pairs with the index set as a packed bitmask;
* ``{"val": float32[k], "rice": uint8[...]}``      the same pairs with the gaps between indices Golomb-Rice coded.

The encoder takes whichever index form is smallest: the smallest unsigned dtype that holds d - 1, the bitmask, or
the Rice code (:func:`rice_nbytes`), e.g. d = 7850 and k = 785 (top 10 %): 1570 B of uint16, 982 B of mask, about
480 B of Rice code. At 10 % the Rice code costs about 4.8 bits per index, so a top-k payload is about 0.115 of the
dense float32 vector where the bitmask gives 0.131. Ties go to ``idx``, then ``mask``. Every form carries the
values in ascending index order. The decoder validates everything a client could get wrong or forge
(DESIGN.md, "Bad input") and raises :class:`MalformedPayload`.
"""

from __future__ import annotations

import math
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
    "rice_nbytes",
    "rice_parameter",
    "wire_round",
]

#: largest magnitude a value can have on the wire (float32); anything larger arrives as inf and is rejected
FLOAT32_MAX = float(np.finfo(np.float32).max)

_DENSE, _VAL, _IDX, _MASK, _RICE = "dense", "val", "idx", "mask", "rice"
_ACCEPTED_KEYSETS = ({_DENSE}, {_VAL, _IDX}, {_VAL, _MASK}, {_VAL, _RICE})


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
        ``{"val", "idx"}`` with the smallest unsigned index dtype, ``{"val", "mask"}`` with a packed bitmask
        (``np.packbits``, big bit order) or ``{"val", "rice"}`` with Rice-coded gaps, whichever is smallest. Ties
        go to ``idx``, then ``mask``.
    """
    val = v.values.astype(np.float32)
    idx_dtype = _index_dtype(v.dim)
    sizes = {_IDX: v.k * np.dtype(idx_dtype).itemsize, _MASK: _mask_nbytes(v.dim), _RICE: rice_nbytes(v.indices, v.dim)}
    form = min(sizes, key=lambda f: sizes[f])  # dicts keep their order: ties go to idx, then mask
    if form == _MASK:
        bits = np.zeros(v.dim, dtype=np.bool_)
        bits[v.indices] = True
        return {_VAL: val, _MASK: np.packbits(bits)}
    if form == _RICE:
        return {_VAL: val, _RICE: _rice_encode(v.indices, v.dim)}
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


def rice_parameter(k: int, dim: int) -> int:
    """The Rice parameter b (a power-of-two Golomb code, divisor 2^b) for k indices out of dim: both ends compute
    it from (k, dim), so it never travels. The gaps g = i_j - i_{j-1} - 1 of k uniformly spread indices are near
    geometric with mean mu = (dim - k) / k, for which b = round(log2(mu ln 2)) is the standard near-optimal choice
    (Gallager and Van Voorhis 1975; Kiely 2004)."""
    if k <= 0 or dim <= k:
        return 0
    return max(0, round(math.log2((dim - k) / k * math.log(2))))


def _rice_split(indices: NDArray[np.int64], b: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    gaps = np.diff(indices, prepend=-1) - 1
    return gaps >> b, gaps & ((1 << b) - 1)


def rice_nbytes(indices: NDArray[Any], dim: int) -> int:
    """Bytes of the Rice code of ascending ``indices`` (k b remainder bits, then sum(q) + k unary bits, each part
    padded to whole bytes): what :func:`encode_sparse` compares against the other index forms."""
    idx = np.asarray(indices, dtype=np.int64)
    b = rice_parameter(len(idx), dim)
    q, _ = _rice_split(idx, b)
    return (len(idx) * b + 7) // 8 + (int(q.sum()) + len(idx) + 7) // 8


def _rice_encode(indices: NDArray[np.int64], dim: int) -> NDArray[np.uint8]:
    # Two bit streams, so that decoding is vectorised: the fixed-width b-bit remainders (MSB first), then the
    # unary quotients (q ones, then a zero, per gap); each padded with zeros to a whole byte.
    k, b = len(indices), rice_parameter(len(indices), dim)
    q, r = _rice_split(indices, b)
    rbits = ((r[:, None] >> np.arange(b - 1, -1, -1)) & 1).astype(np.uint8).reshape(-1)
    ubits = np.zeros(int(q.sum()) + k, dtype=np.uint8)
    ends = np.cumsum(q + 1) - 1  # where each gap's terminating zero sits
    ubits[:] = 1
    ubits[ends] = 0
    return np.concatenate([np.packbits(rbits), np.packbits(ubits)])


def _decode_rice(raw: NDArray[Any], k: int, dim: int) -> NDArray[np.int64]:
    if raw.dtype != np.uint8:
        raise MalformedPayload(f"'rice' has wrong dtype {raw.dtype}, expected uint8")
    b = rice_parameter(k, dim)
    rbytes = (k * b + 7) // 8
    # a valid code has sum(q) <= (dim - k) / 2^b: refuse a longer stream before unpacking it
    most = rbytes + ((max(dim - k, 0) >> b) + k + 7) // 8
    if raw.shape[0] < rbytes or raw.shape[0] > most:
        raise MalformedPayload(f"'rice' length {raw.shape[0]} is outside [{rbytes}, {most}] for k = {k}, dim = {dim}")
    rbits = np.unpackbits(raw[:rbytes])
    if np.any(rbits[k * b:]):
        raise MalformedPayload("'rice' sets padding bits after the remainders")
    r = rbits[:k * b].reshape(k, b).astype(np.int64) @ (1 << np.arange(b - 1, -1, -1, dtype=np.int64))
    ubits = np.unpackbits(raw[rbytes:])
    ends = np.flatnonzero(ubits == 0)
    if ends.shape[0] < k:
        raise MalformedPayload(f"'rice' holds {ends.shape[0]} unary codes, expected k = {k}")
    ends = ends[:k]
    used = int(ends[-1]) + 1 if k else 0
    if raw.shape[0] - rbytes != (used + 7) // 8 or np.any(ubits[used:]):
        raise MalformedPayload("'rice' has trailing bytes or padding bits after the last gap")
    q = np.diff(ends, prepend=-1) - 1
    idx = np.cumsum((q << b) + r + 1) - 1
    if k and idx[-1] >= dim:
        raise MalformedPayload(f"'rice' decodes to an index out of range: {idx[-1]} >= dim = {dim}")
    return idx.astype(np.int64)


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
    if arr.size and float(np.max(np.abs(arr))) > FLOAT32_MAX:  # no float32 encoder can have sent it
        raise MalformedPayload(f"{key!r} holds a value beyond float32's range ({float(np.max(np.abs(arr))):.3g})")
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
            raise MalformedPayload("missing key: 'val' needs 'idx', 'mask' or 'rice'")
        if keys in ({_IDX}, {_MASK}, {_RICE}):
            raise MalformedPayload(f"missing key 'val' next to {sorted(keys)}")
        raise MalformedPayload(
            f"unexpected key combination {sorted(keys)}; expected ['dense'], ['idx', 'val'], ['mask', 'val'] or ['rice', 'val']"
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
    elif _RICE in keys:
        idx = _decode_rice(_array(arrays, _RICE), val.shape[0], dim)
    else:
        idx = _decode_mask(_array(arrays, _MASK), dim)
        if idx.shape[0] != val.shape[0]:
            raise MalformedPayload(f"'mask' popcount {idx.shape[0]} != len(val) = {val.shape[0]}")
    return SparseVector(indices=idx, values=val, dim=dim)


def payload_nbytes(arrays: Mapping[str, NDArray[Any]]) -> int:
    """Sum of the arrays' ``nbytes``: the payload size before Flower's serialisation overhead (informational)."""
    return int(sum(int(a.nbytes) for a in arrays.values()))
