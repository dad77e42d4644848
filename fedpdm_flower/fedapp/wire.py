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


def named_record(arrays: Mapping[str, NDArray[Any]]) -> ArrayRecord:
    """An ArrayRecord holding ``arrays`` under their names, in order (0-d arrays stay 0-d)."""
    return ArrayRecord({k: Array(np.require(v, requirements="C")) for k, v in arrays.items()})


def recorddict_nbytes(content: RecordDict) -> int:
    """Serialized (protobuf) size in bytes of a message's content."""
    return int(recorddict_to_proto(content).ByteSize())


def array_record(arrays: list[NDArray[Any]]) -> ArrayRecord:
    """ArrayRecord from a list of numpy arrays (keys "0", "1", ... as in Flower's NumPyClient bridge)."""
    return ArrayRecord([np.require(a, requirements="C") for a in arrays])  # np.ascontiguousarray would make 0-d 1-d


def train_content(arrays: list[NDArray[Any]], config: Mapping[str, Any], *, arrays_key: str = "arrays",
                  config_key: str = "config") -> RecordDict:
    """The {"arrays", "config"} content Flower's built-in strategies also send (record names configurable)."""
    return RecordDict({arrays_key: array_record(arrays), config_key: ConfigRecord(dict(config))})


def reply_content(arrays: list[NDArray[Any]], num_examples: int, metrics: Mapping[str, Any], *,
                  arrays_key: str = "arrays") -> RecordDict:
    """The {"arrays", "metrics"} reply; "num-examples" is Flower's weighting key."""
    return RecordDict({arrays_key: array_record(arrays),
                       "metrics": MetricRecord({**metrics, "num-examples": int(num_examples)})})
