"""``to_array`` / ``to_numpy`` (fedpdm_flower.fedapp.wire) against Flower's own ``Array(ndarray)`` and
``Array.numpy()``: the same bytes on the wire and the same arrays back, for every dtype and shape, on the first
call (Flower's path) and on later ones (the cached header), and the same refusals for bytes that are not a
plain numeric npy payload (pickles, truncated or padded data, Fortran order)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from numpy.typing import NDArray

from fedpdm_flower.fedapp import wire
from fedpdm_flower.fedapp.wire import array_record, named_record, to_array, to_numpy

CASES: list[NDArray[Any]] = [
    np.arange(7840, dtype=np.float64) / 7.0,
    np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    np.array(3.5),  # 0-d stays 0-d
    np.array([], dtype=np.float64),
    np.arange(6, dtype=np.int64).reshape(2, 3, 1),
    np.array([True, False, True]),
    np.arange(5, dtype=np.uint8),
    np.array([1 + 2j, -3j], dtype=np.complex128),
    np.arange(4, dtype=">f8"),  # big-endian: written and read in its own byte order
    np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2],  # not contiguous: sent in C order, as Flower sends it
]


def _same(a: NDArray[Any], b: NDArray[Any]) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("value", CASES, ids=lambda v: f"{v.dtype.str}{list(v.shape)}")
def test_the_bytes_are_flowers_and_the_array_comes_back(value: NDArray[Any]) -> None:
    theirs = Array(np.require(value, requirements="C"))
    for _ in range(2):  # the first call learns the header from Flower's bytes, the second uses it
        ours = to_array(value)
        assert (ours.dtype, ours.shape, ours.stype, ours.data) == (theirs.dtype, theirs.shape, theirs.stype,
                                                                   theirs.data)
    for _ in range(2):
        back = to_numpy(theirs)
        _same(back, theirs.numpy())
        assert back.flags.writeable  # a copy, as np.load returns: the caller may change it in place
        if back.size:
            back.reshape(-1)[0] = 1
        _same(to_numpy(theirs), theirs.numpy())  # the message's bytes are untouched


def test_records_match_flowers_list_and_dict_records() -> None:
    arrays = [np.arange(3.0), np.ones((2, 2), dtype=np.float32)]
    ours, theirs = array_record(arrays), ArrayRecord(arrays)
    assert list(ours.keys()) == list(theirs.keys()) == ["0", "1"]
    assert [a.data for a in ours.values()] == [a.data for a in theirs.values()]
    named = named_record({"w": arrays[0], "b": arrays[1]})
    assert list(named.keys()) == ["w", "b"] and named["b"].data == theirs["1"].data


def _flower_error(array: Array) -> type[BaseException]:
    with pytest.raises(Exception) as info:
        array.numpy()
    return type(info.value)


def test_a_known_header_with_the_wrong_payload_gets_flowers_answer() -> None:
    good = Array(np.arange(10, dtype=np.float64))
    to_numpy(good)  # its header is now known
    short = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:-8])
    with pytest.raises(_flower_error(short)):
        to_numpy(short)
    padded = Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data + b"\x00" * 8)
    _same(to_numpy(padded), padded.numpy())  # np.load reads what the header says and ignores the rest: so do we


def test_a_pickle_is_refused_as_flower_refuses_it() -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    evil = Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=buf.getvalue())
    for _ in range(2):
        with pytest.raises(ValueError, match="allow_pickle"):
            to_numpy(evil)
    assert not any(dtype.hasobject for dtype, _ in wire._NPY_HEADERS_IN.values())


def test_fortran_order_is_read_by_numpy_every_time() -> None:
    value = np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4))
    buf = io.BytesIO()
    np.save(buf, value)
    fortran = Array(dtype="float64", shape=(3, 4), stype="numpy.ndarray", data=buf.getvalue())
    for _ in range(2):
        _same(to_numpy(fortran), value)
    assert fortran.data[:-value.nbytes] not in wire._NPY_HEADERS_IN
