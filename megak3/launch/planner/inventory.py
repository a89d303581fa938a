"""The model's parameters and buffers counted from the real module tree (meta device), the
pipeline stages the trainer cuts, and the layout check every plan runs first.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from parallel.sharding import EXPERT, tp_rule

from ...config import ModelConfig
from .config import PlanConfig, _key
from .vision import vision_image

_VALID: Dict[tuple, Optional[str]] = {}


def check_model(cfg: ModelConfig, pc: PlanConfig) -> None:
    """The divisibility the layout needs (as parallel/grid.validate_layout) and a stage partition."""
    from parallel.grid import Layout, validate_layout

    key = (_key(cfg), pc.world_size, pc.tp, pc.cp, pc.dp, pc.pp, pc.ep)
    if key not in _VALID:  # (a search asks for the same layout once per micro-batch size)
        try:
            validate_layout(Layout(world_size=pc.world_size, tp=pc.tp, cp=pc.cp, dp=pc.dp, pp=pc.pp, ep=pc.ep), cfg)
            _VALID[key] = None
        except ValueError as e:
            _VALID[key] = str(e)
    if _VALID[key] is not None:
        raise ValueError(_VALID[key])
    if pc.cp > 1:
        from parallel.context_parallel import check_context_parallel

        check_context_parallel(pc.cp, pc.tp, pc.sequence_parallel, pc.seq_len, cfg,
                               balance_split=pc.cp_balance_split if pc.cp_balance else 0)
    if pc.ep > 1 and pc.moonep:
        from moonep.config import MoonEPConfig

        MoonEPConfig(max_replicas_per_rank=pc.max_replicas_per_rank).validate(cfg.moe.num_experts, pc.ep)
    if pc.pp > 1:
        _chunks(cfg, pc)
    if pc.vision_fraction > 0:
        vision_image(cfg, pc)


# ---- parameters from the real module tree (TP rules: parallel/sharding.py, as parallelize_tp) ----------
_INVENTORY: Dict[str, tuple] = {}
_BUFFERS: Dict[str, tuple] = {}


def _where(name: str) -> int:
    if name.startswith("layers."):
        return int(name.split(".")[1])
    if name.startswith(("embed_tokens.", "vision.")):
        return -1
    return -2


def _inventory(cfg: ModelConfig) -> tuple:
    """((name, numel, layer index or -1 embed / -2 head, tp_sharded, expert, optimizer), ...)"""
    import torch

    from ...model.k3 import K3Model
    from ...optim.param_groups import classify_parameters

    with torch.device("meta"):
        model = K3Model(cfg)
    opt = {s.name: s.optimizer for s in classify_parameters(model)}
    out = []
    for name, p in model.named_parameters():
        rule = tp_rule(name)
        out.append((name, p.numel(), _where(name), rule.tp_dim is not None, rule.kind == EXPERT,
                    opt.get(name, "adamw")))
    params = {n for n, _ in model.named_parameters()}
    _BUFFERS[_key(cfg)] = tuple((n, t.numel(), _where(n), t.element_size())
                                for n, t in model.state_dict().items() if n not in params)
    return tuple(out)


def inventory(cfg: ModelConfig) -> tuple:
    """Every parameter of the single-process model, in ``named_parameters()`` order (the order the
    trainer's optimizer specs and ZeRO-1 ownership use): (name, numel, where, tp_sharded, expert,
    optimizer); where = decoder layer index, -1 embedding/vision (first stage), -2 output (last)."""
    key = _key(cfg)
    if key not in _INVENTORY:
        _INVENTORY[key] = _inventory(cfg)
    return _INVENTORY[key]


def buffer_inventory(cfg: ModelConfig) -> tuple:
    """The persistent buffers of the model's state_dict: (name, numel, where, element size)."""
    inventory(cfg)
    return _BUFFERS[_key(cfg)]


def stage_layers(num_layers: int, pp: int) -> List[range]:
    """An even split (the first num_layers % pp stages one layer more). Not what the trainer runs:
    see stage_chunks (parallel/pipeline/partition.py balances by cost at AttnRes block starts)."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def split_blocks(cfg: ModelConfig, pc: PlanConfig) -> bool:
    """parallel.pp_split_blocks as planned: the given value, else whether pp x vp model chunks
    (or the given pp_layout) need a stage boundary inside an AttnRes block."""
    if pc.pp_split_blocks is not None:
        return bool(pc.pp_split_blocks)
    bs = cfg.attn_res_block_size
    if pc.pp_layout is not None:
        starts = [sum(pc.pp_layout[:i]) for i in range(1, len(pc.pp_layout))]
        return any(s % bs for s in starts)
    block_starts = len([i for i in range(1, cfg.num_layers) if i % bs == 0])
    return pc.pp * pc.vp - 1 > block_starts


_PARTS: Dict[tuple, tuple] = {}


def _chunks(cfg: ModelConfig, pc: PlanConfig) -> tuple:
    """All pp x vp model chunks in virtual-stage order, as the trainer cuts them."""
    from parallel.pipeline.partition import partition_layers

    split = split_blocks(cfg, pc)
    key = (_key(cfg), pc.pp * pc.vp, pc.pp_layout, split)
    if key not in _PARTS:
        name = "parallel.pp" if pc.vp == 1 else f"parallel.pp * parallel.vp = {pc.pp} * {pc.vp}, chunks"
        _PARTS[key] = tuple(partition_layers(cfg, pc.pp * pc.vp, pc.pp_layout, split, name))
    return _PARTS[key]


def stage_chunks(cfg: ModelConfig, pc: PlanConfig, stage: int) -> List[range]:
    """The layer ranges pipeline rank ``stage`` holds: parallel/pipeline/partition.rank_chunks."""
    if pc.pp == 1:
        return [range(cfg.num_layers)]
    ch = _chunks(cfg, pc)
    return [ch[c * pc.pp + stage] for c in range(pc.vp)]


def _stage_layer_list(cfg: ModelConfig, pc: PlanConfig, stage: int) -> List[int]:
    return sorted(i for r in stage_chunks(cfg, pc, stage) for i in r)


_AGG: Dict[str, dict] = {}


def _aggregate(cfg: ModelConfig) -> dict:
    """Per place (layer index, -1, -2): {(tp_sharded, expert, optimizer): numel} and the numel of
    the replicated params whose gradients TP sums (cached per config): 'partial_attn' (region and
    image rules of parallel/sharding.py: always when tp > 1), 'partial_sp' / 'partial_sp_expert' (under SP; experts only
    when they are not EP-sharded)."""
    key = _key(cfg)
    if key not in _AGG:
        agg: dict = {}
        for name, n, where, tp_sh, is_exp, opt in inventory(cfg):
            w = agg.setdefault(where, {"numel": {}, "partial_attn": 0, "partial_sp": 0, "partial_sp_expert": 0})
            k = (tp_sh, is_exp, opt)
            w["numel"][k] = w["numel"].get(k, 0) + n
            rule = tp_rule(name)
            if rule.partial_grad(False):
                w["partial_attn"] += n
            elif rule.partial_grad(True):
                w["partial_sp_expert" if is_exp else "partial_sp"] += n
        _AGG[key] = agg
    return _AGG[key]


def _places(cfg: ModelConfig, layers, first: bool, last: bool) -> list:
    agg = _aggregate(cfg)
    out = [agg[i] for i in layers if i in agg]
    if first and -1 in agg:
        out.append(agg[-1])
    if last and -2 in agg:
        out.append(agg[-2])
    return out


def _on_stage(where: int, layers, first: bool, last: bool) -> bool:
    return where in layers if where >= 0 else (first if where == -1 else last)
