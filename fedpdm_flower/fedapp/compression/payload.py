"""Bridge between the codec's named arrays and NumPyClient's positional array lists.

NumPyClient speaks lists of ndarrays; a sparse vector is [values, indices], [values, bitmask] or [values, Rice
code] and a dense one [vector]. Which layout a list has travels as the integer "payload-format" in the message's config (downlink) or
metrics (uplink) record, since MetricRecords cannot carry strings.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedpdm_flower.fedapp.compression.codec import MalformedPayload

DENSE, INDEXED, BITMASK, RICE = 0, 1, 2, 3
_LAYOUT = {DENSE: ("dense",), INDEXED: ("val", "idx"), BITMASK: ("val", "mask"), RICE: ("val", "rice")}
FORMAT_KEY = "payload-format"


def to_arrays(encoded: dict[str, NDArray[Any]]) -> tuple[list[NDArray[Any]], int]:
    """Codec dict -> (positional list, format code)."""
    for code, keys in _LAYOUT.items():
        if set(encoded) == set(keys):
            return [encoded[k] for k in keys], code
    raise ValueError(f"unknown payload layout {sorted(encoded)}")


def from_arrays(arrays: list[NDArray[Any]], code: Any) -> dict[str, NDArray[np.generic]]:
    """(positional list, format code) -> codec dict, rejecting a code or array count that does not match."""
    if (isinstance(code, bool) or not isinstance(code, int | float) or not math.isfinite(code)
            or int(code) not in _LAYOUT or int(code) != code):
        raise MalformedPayload(f"'{FORMAT_KEY}' must be one of {sorted(_LAYOUT)}, got {code!r}")
    keys = _LAYOUT[int(code)]
    if len(arrays) != len(keys):
        raise MalformedPayload(f"payload format {int(code)} expects {len(keys)} array(s) {keys}, got {len(arrays)}")
    return dict(zip(keys, arrays, strict=True))
