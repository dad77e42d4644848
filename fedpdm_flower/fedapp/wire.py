"""Bytes on the wire, counted from the serialized Flower records (not computed from k).

Flower's deployment transport ships a Message's RecordDict as protobuf; we count the protobuf size of the
content (arrays, config and metrics records) each message carries. Simulation pickles the same records, so the
same number is reported for every engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto
from numpy.typing import NDArray

#: the record of a model's buffers beside the algorithm's vector (BatchNorm statistics, integer counters), by
#: state-dict name: in a train message the server's, in the reply the client's after training
BUFFERS_KEY = "buffers"


#: npy headers Flower's own code wrote or accepted, so later arrays of the same dtype and shape skip its BytesIO
#: round trip (np.save into a buffer: about 90 us for a 7,840-entry vector, np.load back: about 130 us). Keys:
#: (dtype.str, shape) for writing, the header's bytes for reading. Bounded: a peer cannot grow it without limit.
_NPY_HEADERS_OUT: dict[tuple[str, tuple[int, ...]], bytes] = {}
_NPY_HEADERS_IN: dict[bytes, tuple[np.dtype[Any], tuple[int, ...]]] = {}
_NPY_CACHE_LIMIT = 1024
_NPY_MAGIC_V1 = b"\x93NUMPY\x01\x00"


def _npy_header_length(data: bytes) -> int | None:
    """Length of a version-1.0 npy header (magic, version, length field and header), None for anything else."""
    if len(data) < 10 or data[:8] != _NPY_MAGIC_V1:
        return None
    return 10 + int.from_bytes(data[8:10], "little")


def to_array(value: NDArray[Any]) -> Array:
    """``flwr.app.Array(value)``, byte for byte (the npy serialization Flower's ``np.save`` writes), without the
    BytesIO round trip once an array of the same dtype and shape has gone through Flower's own path: the header is
    taken from Flower's bytes and the data is the array's C-order bytes, as ``np.save`` writes them. Anything other
    than a plain numeric array (objects, structured dtypes) always takes Flower's path."""
    arr = np.require(value, requirements="C")  # np.ascontiguousarray would make 0-d 1-d
    if arr.dtype.kind not in "biufc" or arr.dtype.fields is not None:
        return Array(arr)
    key = (arr.dtype.str, tuple(int(n) for n in arr.shape))
    header = _NPY_HEADERS_OUT.get(key)
    if header is None:
        made = Array(arr)
        size = _npy_header_length(made.data)
        if size is not None and len(_NPY_HEADERS_OUT) < _NPY_CACHE_LIMIT:
            _NPY_HEADERS_OUT[key] = made.data[:size]
        return made
    return Array(dtype=str(arr.dtype), shape=key[1], stype="numpy.ndarray", data=header + arr.tobytes())


def to_numpy(array: Array) -> NDArray[Any]:
    """``array.numpy()`` (Flower's ``np.load``, pickles refused), with the same result for every input, faster for
    a header that ``np.load`` has already accepted in this process: then the array is read straight from the bytes
    after it (a writable copy, as ``np.load`` returns), provided they hold exactly its dtype and shape. Any other
    input -- untrusted, new, Fortran-ordered, truncated or padded -- takes Flower's own path and its errors."""
    data = array.data
    size = _npy_header_length(data) if array.stype == "numpy.ndarray" else None
    if size is not None:
        known = _NPY_HEADERS_IN.get(data[:size])
        if known is not None:
            dtype, shape = known
            count = int(np.prod(shape, dtype=np.int64))
            if len(data) - size == count * dtype.itemsize:
                return np.frombuffer(data, dtype=dtype, count=count, offset=size).reshape(shape).copy()
    out: NDArray[Any] = array.numpy()
    # learn the header np.load just accepted, for a plain numeric array laid out in C order (a Fortran-ordered
    # array of two or more real dimensions is not C-contiguous and stays on Flower's path)
    if (size is not None and out.dtype.kind in "biufc" and out.dtype.fields is None and out.flags.c_contiguous
            and len(data) - size == out.nbytes and len(_NPY_HEADERS_IN) < _NPY_CACHE_LIMIT):
        _NPY_HEADERS_IN[data[:size]] = (out.dtype, tuple(int(n) for n in out.shape))
    return out


def numpy_list(record: ArrayRecord) -> list[NDArray[Any]]:
    """``record.to_numpy_ndarrays()`` through :func:`to_numpy`."""
    return [to_numpy(a) for a in record.values()]


def named_record(arrays: Mapping[str, NDArray[Any]]) -> ArrayRecord:
    """An ArrayRecord holding ``arrays`` under their names, in order (0-d arrays stay 0-d)."""
    return ArrayRecord({k: to_array(v) for k, v in arrays.items()})


def recorddict_nbytes(content: RecordDict) -> int:
    """Serialized (protobuf) size in bytes of a message's content."""
    return int(recorddict_to_proto(content).ByteSize())


def array_record(arrays: list[NDArray[Any]]) -> ArrayRecord:
    """ArrayRecord from a list of numpy arrays (keys "0", "1", ... as in Flower's NumPyClient bridge)."""
    return ArrayRecord({str(i): to_array(a) for i, a in enumerate(arrays)})


def train_content(arrays: list[NDArray[Any]], config: Mapping[str, Any], *, arrays_key: str = "arrays",
                  config_key: str = "config") -> RecordDict:
    """The {"arrays", "config"} content Flower's built-in strategies also send (record names configurable)."""
    return RecordDict({arrays_key: array_record(arrays), config_key: ConfigRecord(dict(config))})


def reply_content(arrays: list[NDArray[Any]], num_examples: int, metrics: Mapping[str, Any], *,
                  arrays_key: str = "arrays") -> RecordDict:
    """The {"arrays", "metrics"} reply; "num-examples" is Flower's weighting key."""
    return RecordDict({arrays_key: array_record(arrays),
                       "metrics": MetricRecord({**metrics, "num-examples": int(num_examples)})})
