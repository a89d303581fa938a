"""Assign decoder layers to pipeline stages.

Block AttnRes makes a stage boundary inside a block more expensive (the block's partial sum and
every committed block cross the wire either way, but a boundary at a block start keeps the
partial's history on one stage), so by default a stage starts only where a block starts
(layer index % model.attn_res_block_size == 0). Among the allowed cuts, the partition minimises
the most expensive stage under a per-layer cost model (KDA, MLA, MoE and dense FFN differ; the
embedding is charged to the first stage and the lm_head + loss to the last).
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence

# relative forward cost per token, in units of d^2 MACs (rough, from the layer shapes)
_ATTN = {"kda": 6.0, "mla": 5.0}
_FFN = {"moe": 8.0, "dense": 6.0}


def layer_costs(cfg) -> List[float]:
    """Relative cost of each decoder layer (attention kind + FFN kind)."""
    kinds = cfg.layer_kinds()
    return [_ATTN[k] + _FFN["moe" if cfg.is_moe_layer(i) else "dense"] for i, k in enumerate(kinds)]


def _head_cost(cfg) -> float:
    return 2.0 * cfg.vocab_size / cfg.hidden_size  # lm_head + softmax, same d^2 unit


def partition_layers(cfg, pp: int, layout: Optional[Sequence[int]] = None,
                     allow_split_blocks: bool = False, name: str = "parallel.pp") -> List[range]:
    """``pp`` contiguous layer ranges covering every layer (``pp`` = stages x model chunks per
    stage; ``name`` is how error messages call that count).

    layout: explicit layer counts per stage (sum = model.num_layers), checked but not balanced.
    allow_split_blocks: let a stage start inside an AttnRes block.
    """
    L, bs = cfg.num_layers, cfg.attn_res_block_size
    if pp < 1:
        raise ValueError(f"{name}={pp} must be >= 1")
    if pp > L:
        raise ValueError(f"{name}={pp} exceeds model.num_layers={L}: every stage needs a layer; "
                         "lower parallel.pp")
    cuts_ok = set(range(1, L)) if allow_split_blocks else {i for i in range(1, L) if i % bs == 0}
    if layout is not None:
        layout = list(layout)
        if len(layout) != pp or any(n < 1 for n in layout) or sum(layout) != L:
            raise ValueError(f"parallel.pp_layout={layout} must be {pp} positive layer counts summing to "
                             f"model.num_layers={L}")
        starts = [sum(layout[:i]) for i in range(1, pp)]
        bad = [s for s in starts if s not in cuts_ok]
        if bad:
            raise ValueError(f"parallel.pp_layout={layout} starts a stage inside an AttnRes block at layer(s) "
                             f"{bad} (block size {bs}); move the cut to a multiple of {bs} or set "
                             "parallel.pp_split_blocks=true")
        bounds = [0] + starts + [L]
        return [range(bounds[i], bounds[i + 1]) for i in range(pp)]
    if len(cuts_ok) < pp - 1:
        raise ValueError(f"{name}={pp} needs {pp - 1} stage boundaries but model.num_layers={L} with "
                         f"attn_res_block_size={bs} has only {len(cuts_ok)} block starts; lower parallel.pp or "
                         "set parallel.pp_split_blocks=true")
    cost = layer_costs(cfg)
    cost[0] += 1.0                        # embedding
    cost[-1] += _head_cost(cfg)           # lm_head + loss
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    cuts = sorted(cuts_ok)

    @lru_cache(maxsize=None)
    def best(start: int, stages: int):
        """(max stage cost, boundaries) for layers [start, L) in ``stages`` stages."""
        if stages == 1:
            return prefix[L] - prefix[start], ()
        out = (float("inf"), ())
        for c in cuts:
            if c <= start or L - c < stages - 1:
                continue
            rest, bnds = best(c, stages - 1)
            worst = max(prefix[c] - prefix[start], rest)
            if worst < out[0] - 1e-12:
                out = (worst, (c,) + bnds)
        return out

    _, bnds = best(0, pp)
    if len(bnds) != pp - 1:
        raise ValueError(f"{name}={pp}: no partition of {L} layers at AttnRes block starts; lower "
                         "parallel.pp or set parallel.pp_split_blocks=true")
    bounds = [0, *bnds, L]
    return [range(bounds[i], bounds[i + 1]) for i in range(pp)]


def rank_chunks(cfg, pp: int, rank: int, vp: int = 1, layout: Optional[Sequence[int]] = None,
                allow_split_blocks: bool = False) -> List[range]:
    """The ``vp`` model chunks of pipeline rank ``rank``: virtual stages rank, pp + rank, ...
    of ``partition_layers(cfg, pp * vp, layout, allow_split_blocks)``."""
    name = "parallel.pp" if vp == 1 else f"parallel.pp * parallel.vp = {pp} * {vp}, chunks"
    chunks = partition_layers(cfg, pp * vp, layout, allow_split_blocks, name)
    return [chunks[c * pp + rank] for c in range(vp)]
