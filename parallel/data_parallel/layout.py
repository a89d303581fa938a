"""Ownership of whole parameters, the flat bucket layout, and the forward blocks.

Ownership (:func:`assign_owners`)
    Greedy longest-processing-time over numel: parameters sorted by (-numel, name order), each
    given to the currently least-loaded rank (ties: lowest rank). A pure function of the parameter
    list and the group size, so identical on every rank (checked by a fingerprint all-gather at
    construction). Imbalance is bounded by the largest single parameter.

Flat layout and the collectives (one bucket = one reduce-scatter + one all-gather)
    A bucket holds, for every rank r of the group, a segment of r's owned params (taken in
    ownership order) padded to a common length S: ``[rank0 params | pad | rank1 params | pad | ...]``
    (dp·S elements). ``reduce_scatter`` over that buffer hands rank r exactly the summed gradients
    of its own params (reduced in fp32); after the local step ``all_gather`` over the same layout
    (in the parameter dtype) gives every rank the updated full params. Buckets target
    ``bucket_bytes`` of fp32 gradient; a segment grows up to max(bucket/dp, largest next param),
    which keeps the padding small (``memory_report()['comm_padding']``).

:func:`forward_blocks` names the module whose forward pre-hook waits for a param's all-gather under
``overlap_param_gather`` (parallel/data_parallel/gather.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

EXPERT_NAME_PART = ".mlp.experts."
"""parameters whose name contains this go to ``edp_group`` when one is given"""
DEFAULT_BUCKET_BYTES = 40 * 2**20
"""fp32 gradient bytes per bucket (10M elements; Megatron-Core defaults to 40M, smaller keeps the
transient dp·S-element buffer of each reduce-scatter modest on CPU)"""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def forward_blocks(model: nn.Module) -> dict[int, nn.Module]:
    """``id(param) -> module`` whose forward pre-hook waits for the param's all-gather under
    ``overlap_param_gather``: the OUTERMOST module below ``model`` on the param's path that is not a
    container (ModuleList / ModuleDict / Sequential), ``model`` itself for its own params. For a
    K3Model: each decoder layer, the embedding, the output AttnRes mix, the final norm, the head,
    the vision tower. Not the module that owns the param: forwards read their children's params
    directly (a decoder layer reads its AttnRes mixes' weights, the MoonEP dispatcher fetches the
    experts' weights in the MoE layer's forward), which a hook on the owner would see too late.
    A block must be entered as ``block(...)`` (which runs its hooks), not ``block.forward(...)``;
    tests/test_overlap.py checks with a torch-function spy that no K3 parameter is read before its
    block's hook ran, under dp, tp, pp, ep and cp."""
    out: dict[int, nn.Module] = {}

    def visit(mod: nn.Module, block: Optional[nn.Module]) -> None:
        for p in mod.parameters(recurse=False):
            out.setdefault(id(p), mod if block is None else block)
        for child in mod.children():
            visit(child, child if block is None and not isinstance(child, _CONTAINERS) else block)

    visit(model, None)
    return out


def assign_owners(numels: list[int], world: int) -> list[int]:
    """Owner rank of each item: greedy LPT over ``numels`` (largest first, least-loaded rank wins,
    ties to the lower item index / lower rank). Deterministic."""
    load = [0] * world
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


@dataclass(frozen=True)
class _Slot:
    """Where one parameter lives in its bucket: rank ``owner``'s segment at ``offset``."""

    index: int
    """index into ``ShardedOptimizer.specs``"""
    owner: int
    offset: int
    numel: int


@dataclass
class _Bucket:
    """One reduce-scatter / all-gather unit: ``world`` segments of ``seg_len`` elements each."""

    group_id: int
    dtype: torch.dtype
    """model-parameter dtype (the all-gather runs in it; gradients reduce in fp32)"""
    seg_len: int
    slots: list[_Slot]


def plan_buckets(numels: list[int], owners: list[int], world: int, bucket_numel: int
                 ) -> list[tuple[int, list[tuple[int, int, int]]]]:
    """Ownership-ordered flat layout: ``[(seg_len, [(item, owner, offset), ...]), ...]``.

    Rank r's items are taken in LPT order (largest first). Each bucket takes, per rank, items
    while its segment stays within ``target = max(bucket_numel // world, largest next item)``.
    """
    queues = [[i for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)) if owners[i] == r]
              for r in range(world)]
    heads = [0] * world
    out = []
    while any(heads[r] < len(queues[r]) for r in range(world)):
        target = max([bucket_numel // world] + [numels[queues[r][heads[r]]] for r in range(world)
                                                if heads[r] < len(queues[r])])
        entries, seg_len = [], 0
        for r in range(world):
            off = 0
            while heads[r] < len(queues[r]) and off + numels[queues[r][heads[r]]] <= target:
                i = queues[r][heads[r]]
                entries.append((i, r, off))
                off += numels[i]
                heads[r] += 1
            seg_len = max(seg_len, off)
        out.append((seg_len, entries))
    return out
