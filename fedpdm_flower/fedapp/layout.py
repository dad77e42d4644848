"""One flat float vector for the arrays of any model, and back to the user's own layout.

The algorithms of this project move one vector x in R^d (the l1 prox, duals, noise, sparsifiers, masks and robust
aggregators all act coordinate-wise), while a Flower user hands over a model as named arrays: a torch
``state_dict`` (``ArrayRecord(net.state_dict())``) or a list of numpy arrays (keys ``"0"``, ``"1"``, ...).
:class:`ArrayLayout` is the map between the two:

* every **floating-point** entry, in the order given, is flattened row-major into x (float64 in the math, so that
  duals and accumulated sums do not drift; the user's dtype is restored on the way out);
* every other entry (an integer or bool array such as BatchNorm's ``num_batches_tracked``, a 0-d counter) is
  **carried beside x**: it is not part of x, and :meth:`ArrayLayout.unflatten` takes its value from the mapping it
  is given (the strategy's record of the model's state entries, :mod:`fedpdm_flower.strategies.base`);
* floating-point entries named in ``beside`` (:meth:`ArrayLayout.of`) are carried beside x too: **buffers**, state
  the model computes from the data outside the gradient (BatchNorm's running statistics, :func:`norm_buffer_names`).
  An algorithm that moves x by gradients, duals, control variates, sparsifiers or noise must not move them; they
  travel in their own record and are aggregated as Flower's FedAvg does (a weighted mean);
* names, shapes and dtypes are checked on every conversion, so a reply or a model of another architecture fails
  with a message naming the entry instead of being silently reshaped.

Framework-free (numpy only): the Flower layer converts ``ArrayRecord`` <-> ``dict[str, ndarray]``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]

__all__ = ["NORM_BUFFERS", "ArrayLayout", "Entry", "LayoutMismatch", "norm_buffer_names"]

#: state-dict suffixes of torch's normalisation-layer buffers (BatchNorm / InstanceNorm running statistics)
NORM_BUFFERS = ("running_mean", "running_var")


def norm_buffer_names(arrays: Mapping[str, NDArray[Any]]) -> list[str]:
    """The floating-point entries of ``arrays`` that are torch normalisation-layer buffers (names ending in
    ``running_mean`` / ``running_var``): what a server that holds only a state dict's names takes for buffers.

    ASSUMPTION: a state dict names its BatchNorm statistics the way torch does. A device knows its buffers exactly
    (``nn.Module.named_buffers``) and checks the server's layout against its own (the layout fingerprint).
    """
    return [k for k, v in arrays.items() if str(k).endswith(NORM_BUFFERS) and _is_float(np.asarray(v).dtype)]


class LayoutMismatch(ValueError):
    """Arrays do not match the layout (names, shapes, dtypes or the flat length); the message names the entry."""


@dataclass(frozen=True)
class Entry:
    """One named array of the model.

    Parameters
    ----------
    name
        Key in the record (a state-dict key, or ``"0"``, ``"1"``, ... for a list).
    shape
        The array's shape (``()`` for a 0-d array).
    dtype
        The array's dtype as given by the user (restored by :meth:`ArrayLayout.unflatten`).
    offset
        Start of the entry in x, or None for an entry carried beside x (not floating point, or a buffer).
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    offset: int | None

    @property
    def size(self) -> int:
        """Number of scalars in the entry."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def in_vector(self) -> bool:
        """True for an entry of x (a floating-point entry that is not a buffer)."""
        return self.offset is not None


def _is_float(dtype: np.dtype[Any]) -> bool:
    return bool(np.issubdtype(dtype, np.floating))


class ArrayLayout:
    """The flat-vector view of a model's named arrays (module docstring).

    Parameters
    ----------
    entries
        The entries in order; build one with :meth:`of`.
    """

    def __init__(self, entries: tuple[Entry, ...]) -> None:
        if not entries:
            raise LayoutMismatch("a model needs at least one array")
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise LayoutMismatch(f"duplicate array names in {names}")
        self.entries = entries
        self.dim = sum(e.size for e in entries if e.in_vector)
        if self.dim == 0:
            raise LayoutMismatch(f"no floating-point array among {names}: there is nothing to train")

    @classmethod
    def of(cls, arrays: Mapping[str, NDArray[Any]], *, beside: Iterable[str] = ()) -> ArrayLayout:
        """The layout of ``arrays`` (insertion order kept); the floating-point entries named in ``beside`` (buffers)
        are carried beside x instead of in it."""
        keep = set(beside)
        unknown = sorted(keep - {str(k) for k in arrays})
        if unknown:
            raise LayoutMismatch(f"buffer(s) {unknown} are not entries of the model")
        entries: list[Entry] = []
        off = 0
        for name, value in arrays.items():
            a = np.asarray(value)
            if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
                raise LayoutMismatch(f"array {name!r} has dtype {a.dtype}: only numeric arrays can be trained")
            if _is_float(a.dtype) and str(name) not in keep:
                entries.append(Entry(str(name), tuple(a.shape), a.dtype, off))
                off += int(a.size)
            else:
                entries.append(Entry(str(name), tuple(a.shape), a.dtype, None))
        return cls(tuple(entries))

    def spec(self) -> list[list[Any]]:
        """``[[name, shape, dtype], ...]``, JSON-able (checkpoints); :meth:`from_spec` rebuilds the layout."""
        return [[e.name, list(e.shape), e.dtype.str] for e in self.entries]

    @classmethod
    def from_spec(cls, spec: Any) -> ArrayLayout:
        """The layout :meth:`spec` described (LayoutMismatch on a malformed spec)."""
        try:
            return cls.of({str(name): np.zeros(tuple(int(n) for n in shape), dtype=np.dtype(str(dtype)))
                           for name, shape, dtype in spec})
        except (TypeError, ValueError) as err:
            raise LayoutMismatch(f"not a layout spec: {err}") from None

    @property
    def names(self) -> list[str]:
        """Entry names in order."""
        return [e.name for e in self.entries]

    @property
    def beside_names(self) -> list[str]:
        """The entries carried beside x (integer entries and buffers), in order."""
        return [e.name for e in self.entries if not e.in_vector]

    @property
    def buffer_names(self) -> list[str]:
        """The floating-point entries carried beside x (buffers), in order."""
        return [e.name for e in self.entries if not e.in_vector and _is_float(e.dtype)]

    def check(self, arrays: Mapping[str, NDArray[Any]], *, what: str = "arrays") -> None:
        """Raise :class:`LayoutMismatch` unless ``arrays`` have exactly these names, shapes and dtypes."""
        got = list(arrays)
        if got != self.names:
            missing = [n for n in self.names if n not in arrays]
            extra = [n for n in got if n not in set(self.names)]
            detail = f"missing {missing}" if missing else ""
            detail += (", " if detail and extra else "") + (f"unexpected {extra}" if extra else "")
            raise LayoutMismatch(f"{what} have entries {got[:6]}{'...' if len(got) > 6 else ''}, expected "
                                 f"{self.names[:6]}{'...' if len(self.names) > 6 else ''} ({detail or 'other order'})")
        for e in self.entries:
            a = np.asarray(arrays[e.name])
            if tuple(a.shape) != e.shape:
                raise LayoutMismatch(f"{what}: entry {e.name!r} has shape {tuple(a.shape)}, expected {e.shape}")
            if a.dtype != e.dtype:
                raise LayoutMismatch(f"{what}: entry {e.name!r} has dtype {a.dtype}, expected {e.dtype}")

    def flatten(self, arrays: Mapping[str, NDArray[Any]]) -> FloatArray:
        """x: the floating-point entries of ``arrays`` concatenated row-major, as float64."""
        self.check(arrays)
        parts = [np.asarray(arrays[e.name], dtype=np.float64).reshape(-1) for e in self.entries if e.in_vector]
        return np.concatenate(parts) if len(parts) > 1 else parts[0].copy()

    def unflatten(self, x: NDArray[Any], carried: Mapping[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
        """The user's named arrays from x (dtypes restored) and the entries beside x from ``carried``.

        ``carried`` is any mapping holding at least the entries beside x (e.g. the initial arrays); their values are
        cast to the layout's dtypes.
        """
        vec = np.asarray(x)
        if vec.shape != (self.dim,):
            raise LayoutMismatch(f"flat vector has shape {vec.shape}, expected ({self.dim},)")
        out: dict[str, NDArray[Any]] = {}
        for e in self.entries:
            if e.offset is None:
                if e.name not in carried:
                    raise LayoutMismatch(f"no value for the carried entry {e.name!r}")
                out[e.name] = np.array(carried[e.name], dtype=e.dtype, copy=True).reshape(e.shape)
            else:
                out[e.name] = np.array(vec[e.offset:e.offset + e.size].reshape(e.shape), dtype=e.dtype, order="C")
        return out

    def slices(self) -> dict[str, slice]:
        """Where each floating-point entry sits in x."""
        return {e.name: slice(e.offset, e.offset + e.size) for e in self.entries if e.offset is not None}

    def fingerprint(self) -> int:
        """CRC-32 of the names, shapes and kinds (in x or carried): both ends compare it to prove they share one
        layout. The float dtype is left out on purpose: the server may hold float64 where the device has float32."""
        text = ";".join(f"{e.name}:{','.join(map(str, e.shape))}:{int(e.in_vector)}" for e in self.entries)
        return zlib.crc32(text.encode())

    def describe(self) -> str:
        """``d`` and the entries, for logs and error messages."""
        carried = self.beside_names
        return (f"{len(self.entries)} arrays, d = {self.dim} floating-point parameters"
                + (f", beside x: {carried}" if carried else ""))
