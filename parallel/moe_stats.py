"""Quantile-Balancing statistics across ranks: the bias update must see the GLOBAL batch.

Every rank that holds a MoE layer must compute the same new bias, from the router scores of all
tokens of the step. Tokens are split over data-parallel ranks and, under sequence parallelism,
over tensor-parallel ranks too; without SP every TP rank routes the same tokens (no reduction).
Histogram accumulators (fixed shape [E, bins] int64 + a count) are all-reduced; exact accumulators
all-gather their margins (padded to the largest rank's token count; normally all equal).

Every tensor handed to a collective lives on the accumulator's device (that of the router scores:
NCCL takes no CPU tensor). The exact path synchronises with the host once (the token counts, which
the gather's shapes need); the histogram path not at all.

Cost per MoE layer and step, per group of g ranks (the dp group; first the tp group under SP):
    exact:     gathers T_group x E x 4 bytes (T_group = tokens of the group's ranks), holds them;
    histogram: all-reduces E x bins x 8 + 8 bytes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megak3.model.balancing import QBAccumulator

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renamed it


def reduce_balancer(acc: QBAccumulator, group) -> None:
    """Merge ``acc`` in place with the accumulators of every rank of ``group``."""
    if group is None or dist.get_world_size(group) == 1:
        return
    if acc.method == "histogram":
        for t in acc.state_tensors():
            dist.all_reduce(t, group=group)
        return
    size, dev = dist.get_world_size(group), acc.device
    local = acc.margins()
    n = torch.full((1,), local.shape[0], dtype=torch.int64, device=dev)
    sizes_t = torch.empty(size, dtype=torch.int64, device=dev)
    _all_gather(sizes_t, n, group=group)
    sizes = sizes_t.tolist()  # the one host sync: the gathered buffer's shape depends on it
    width = max(sizes)
    if local.shape[0] == width:
        padded = local.contiguous()
    else:
        padded = torch.zeros(width, acc.num_experts, dtype=local.dtype, device=dev)
        padded[: local.shape[0]] = local
    parts = torch.empty(size * width, acc.num_experts, dtype=local.dtype, device=dev)
    _all_gather(parts, padded, group=group)
    if all(s == width for s in sizes):
        acc._margins = [parts]
    else:
        acc._margins = [torch.cat([parts[r * width: r * width + s] for r, s in enumerate(sizes)])]
    acc.set_token_count(sum(sizes))
