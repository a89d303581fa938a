"""Tensor + sequence parallel building blocks (see docs/PARALLEL.md).

``collectives``: the autograd-aware TP/SP mappings (the only home of these collectives) and a
collective counter; ``layers``: column/row-parallel linears, vocab-parallel embedding and cross
entropy. Every function takes its process group explicitly; ``None`` or size 1 = no-op.
"""
from .collectives import (
    CollectiveCounter,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    group_rank,
    group_size,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
    sync_replicated_grads,
)
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    partial_grad_parameters,
    shard_cols,
    shard_rows,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "CollectiveCounter", "copy_to_tp", "gather_from_sp", "gather_from_tp", "group_rank", "group_size",
    "reduce_from_tp", "reduce_scatter_to_sp", "scatter_to_sp", "scatter_to_tp", "sync_replicated_grads",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "partial_grad_parameters",
    "shard_cols", "shard_rows", "vocab_parallel_cross_entropy",
]
