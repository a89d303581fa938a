"""Quantile-Balancing statistics across ranks: the bias update must see the GLOBAL batch.

Every rank that holds a MoE layer must compute the same new bias, from the router scores of all
tokens of the step. Tokens are split over data-parallel ranks and, under sequence parallelism,
over tensor-parallel ranks too; without SP every TP rank routes the same tokens (no reduction).
Histogram accumulators (fixed shape) are all-reduced; exact accumulators all-gather their margins
(each rank holds the same number of tokens, so the shapes match).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megak3.model.balancing import QBAccumulator


def reduce_balancer(acc: QBAccumulator, group) -> None:
    """Merge ``acc`` in place with the accumulators of every rank of ``group``."""
    if group is None or dist.get_world_size(group) == 1:
        return
    if acc.method == "histogram":
        for t in acc.state_tensors():
            dist.all_reduce(t, group=group)
        return
    local = torch.cat(acc._margins) if acc._margins else torch.zeros(0, acc.num_experts)
    n = torch.tensor([local.shape[0]], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, acc.num_experts, dtype=local.dtype)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    acc._margins = [p[: int(s.item())] for p, s in zip(parts, sizes)]
    acc.token_count = torch.tensor([sum(int(s.item()) for s in sizes)], dtype=torch.int64)
