"""Communication compression: sparsifiers (top-k, rand-k, ConSpar) and the compact wire codec for sparse vectors."""

from typing import TYPE_CHECKING

from fedpdm_flower.fedapp.lazy import lazy_exports

if TYPE_CHECKING:
    from fedpdm_flower.fedapp.compression.codec import (
        MalformedPayload as MalformedPayload,
    )
    from fedpdm_flower.fedapp.compression.codec import (
        SparseVector as SparseVector,
    )
    from fedpdm_flower.fedapp.compression.codec import (
        decode_vector as decode_vector,
    )
    from fedpdm_flower.fedapp.compression.codec import (
        encode_dense as encode_dense,
    )
    from fedpdm_flower.fedapp.compression.codec import (
        encode_sparse as encode_sparse,
    )
    from fedpdm_flower.fedapp.compression.codec import (
        payload_nbytes as payload_nbytes,
    )
    from fedpdm_flower.fedapp.compression.conspar import (
        ConSpar as ConSpar,
    )
    from fedpdm_flower.fedapp.compression.sparsify import (
        RandK as RandK,
    )
    from fedpdm_flower.fedapp.compression.sparsify import (
        TopK as TopK,
    )
    from fedpdm_flower.fedapp.compression.sparsify import (
        rand_k as rand_k,
    )
    from fedpdm_flower.fedapp.compression.sparsify import (
        resolve_k as resolve_k,
    )
    from fedpdm_flower.fedapp.compression.sparsify import (
        top_k as top_k,
    )

__getattr__, __all__ = lazy_exports(__name__, {
    "conspar": ["ConSpar"],
    "codec": ["MalformedPayload", "SparseVector", "decode_vector", "encode_dense", "encode_sparse", "payload_nbytes"],
    "sparsify": ["RandK", "TopK", "rand_k", "resolve_k", "top_k"],
})
