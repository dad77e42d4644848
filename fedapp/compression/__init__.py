"""Communication compression: sparsifiers (top-k, rand-k) and the compact wire codec for sparse vectors."""

from fedapp.compression.codec import (
    MalformedPayload,
    SparseVector,
    decode_vector,
    encode_dense,
    encode_sparse,
    payload_nbytes,
)
from fedapp.compression.sparsify import rand_k, resolve_k, top_k

__all__ = [
    "MalformedPayload",
    "SparseVector",
    "decode_vector",
    "encode_dense",
    "encode_sparse",
    "payload_nbytes",
    "rand_k",
    "resolve_k",
    "top_k",
]
