"""Tensor + sequence parallel building blocks (see docs/PARALLEL.md).

``collectives``: the autograd-aware TP/SP mappings (the only home of these collectives) and a
collective counter; ``vocab``: vocabulary-parallel embedding and cross entropy. Every function
takes its process group explicitly; ``None`` or size 1 = no-op. The linear layers are not here:
:mod:`parallel.parallelize` shards plain ``nn.Linear`` layers in place and wraps each attention /
FFN module in a ``TPRegion`` (enter: copy_to_tp or gather_from_sp; exit: reduce_from_tp or
reduce_scatter_to_sp).
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
from .vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

__all__ = [
    "CollectiveCounter", "copy_to_tp", "gather_from_sp", "gather_from_tp", "group_rank", "group_size",
    "reduce_from_tp", "reduce_scatter_to_sp", "scatter_to_sp", "scatter_to_tp", "sync_replicated_grads",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
]
