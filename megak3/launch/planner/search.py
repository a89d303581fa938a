"""A whole plan of one layout (make_plan), the search over layouts (search) and the smallest
world size where one fits (min_gpus).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional

from ...config import ModelConfig
from .comm import bubble_factor, comm_per_step, stage_time
from .config import PlanConfig, _key
from .flops import flops_per_token
from .inventory import _stage_layer_list, check_model, split_blocks
from .memory import _param_memory, qb_method, stage_memory
from .vision import vision_figures


def trainer_overrides(pc: PlanConfig, split: bool = False) -> str:
    """The trainer's command-line overrides for this layout and batch."""
    out = [f"parallel.tp={pc.tp}", f"parallel.pp={pc.pp}", f"parallel.ep={pc.ep}"]
    if pc.cp > 1:
        out.append(f"parallel.cp={pc.cp}")
    if pc.tp > 1:
        out.append(f"parallel.sequence_parallel={str(pc.sequence_parallel).lower()}")
    if pc.pp > 1 and pc.pp_schedule != "1f1b":
        out.append(f"parallel.pp_schedule={pc.pp_schedule}")
    if pc.vp > 1:
        out.append(f"parallel.vp={pc.vp}")
    if split:
        out.append("parallel.pp_split_blocks=true")
    out += [f"train.micro_batch_size={pc.micro_batch_size}", f"train.global_batch_size={pc.global_batch_size}",
            f"data.seq_len={pc.seq_len}"]
    if not pc.activation_checkpointing:
        out.append("train.activation_checkpointing=false")
    if pc.offload == "cpu":
        out.append("optim.offload=cpu")
    if pc.cp > 1 and pc.cp_balance:
        out.append(f"parallel.cp_balance=true parallel.cp_balance_split={pc.cp_balance_split}")
    return " ".join(out)


def make_plan(cfg: ModelConfig, pc: PlanConfig, hw) -> dict:
    """Memory (worst stage), FLOPs, comm and step time (heaviest stage), fits -- see the module docstring."""
    pc = pc.resolved()
    check_model(cfg, pc)
    stages = [stage_memory(cfg, pc, s) for s in range(pc.pp)]
    worst = max(stages, key=lambda s: s["total"])
    m = pc.micro_batches
    bubble = bubble_factor(pc, m)
    comms = [comm_per_step(cfg, pc, s) for s in range(pc.pp)]
    times = [stage_time(cfg, pc, hw, s, comms[s], bubble) for s in range(pc.pp)]
    slow = max(range(pc.pp), key=lambda s: times[s]["step_s"])
    comm, t = comms[slow], dict(times[slow])
    fl = flops_per_token(cfg, pc.seq_len)
    tokens_step = pc.global_batch_size * pc.seq_len
    step = t["step_s"]
    vis = vision_figures(cfg, pc)
    model_flops = fl["train"] * tokens_step + (vis["train_flops_per_step"] if vis else 0.0)
    t.update(tokens_per_s=tokens_step / step, mfu=model_flops / pc.world_size / step / hw.peak_flops(pc.precision))
    usable = hw.memory_bytes * hw.usable_memory_fraction
    split = pc.pp > 1 and split_blocks(cfg, pc)
    out = {
        "layout": {"tp": pc.tp, "pp": pc.pp, "ep": pc.ep, "cp": pc.cp, "dp": pc.dp, "edp": pc.edp,
                   "world_size": pc.world_size,
                   "sequence_parallel": pc.sequence_parallel, "micro_batch_size": pc.micro_batch_size,
                   "seq_len": pc.seq_len, "global_batch_size": pc.global_batch_size,
                   "global_batch_default": pc.global_batch_default, "tokens_per_step": tokens_step,
                   "micro_batches": m, "activation_checkpointing": pc.activation_checkpointing,
                   "pp_schedule": pc.pp_schedule, "vp": pc.vp, "pp_split_blocks": split,
                   "stage_layers": [s["layers"] for s in stages],
                   "precision": pc.precision, "param_dtype": pc.param_dtype, "qb_method": qb_method(cfg, pc),
                   **({"offload": pc.offload} if pc.offload != "none" else {}),
                   **({"cp_balance": True, "cp_balance_split": pc.cp_balance_split} if pc.cp_balance else {})},
        "hardware": hw.name,
        "memory": worst, "stages": stages,
        "flops_per_token": fl,
        "comm_bytes_per_step": {k: comm[k] for k in ("tp", "tp_grad_sync", "ep", "ep_replicas_max", "cp", "dp", "pp",
                                                     "qb")},
        "cp_comm_bytes_per_step": {"kda": comm["cp_kda"], "mla": comm["cp_mla"]},
        "comm_stage": slow,
        "time": t, "stage_step_s": [x["step_s"] for x in times],
        "fits": worst["total"] <= usable, "usable_memory": usable,
        "trainer_overrides": trainer_overrides(pc, split),
    }
    if vis:  # only with data.vision_fraction > 0: text-only plans are exactly as before
        out["vision"] = {**vis, "images_per_s": vis["images_per_step"] / step,
                         "activations_stage0": stages[0]["vision_activations"],
                         "compute_s": times[0]["vision_compute_s"],
                         "gather_bytes_per_step": comms[0]["tp_vision"]}
    return out


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_SEARCHES: Dict[tuple, list] = {}


def _weights_fit(cfg: ModelConfig, pc: PlanConfig, hw) -> bool:
    """False when some stage's params + grads + main copies + optimizer state alone (parts of every
    plan's total that do not depend on the micro-batch) exceed the usable memory: search() skips the
    layout without planning each micro-batch size. True when the layout is invalid (make_plan says why)."""
    try:
        pc = pc.resolved()
        check_model(cfg, pc)
    except ValueError:
        return True
    usable = hw.memory_bytes * hw.usable_memory_fraction
    for s in range(pc.pp):
        mem = _param_memory(cfg, pc, _stage_layer_list(cfg, pc, s), s == 0, s == pc.pp - 1)
        if mem["params"] + mem["grads"] + mem["main_params"] + mem["optimizer_state"] > usable:
            return False
    return True


CP_MIN_LOCAL_TOKENS = 4096
"""search(): context-parallel degrees tried leave every CP rank at least this many tokens of a row"""


def cp_degrees(seq_len: int, tp: int, world_size: int, min_local: int = CP_MIN_LOCAL_TOKENS) -> List[int]:
    """The cp search() tries with a given tp: 1, 2, 4, ... while seq_len / cp >= min_local, seq_len
    divides by cp x tp (SP) and tp x cp divides world_size. cp = 1 only for seq_len < 2 x min_local."""
    out, cp = [], 1
    while seq_len // cp >= min_local or cp == 1:
        if seq_len % (cp * tp) == 0 and world_size % (tp * cp) == 0:
            out.append(cp)
        elif cp == 1:
            out.append(1)
        cp *= 2
    return out


def search(cfg: ModelConfig, world_size: int, hw, top: int = 3, base: Optional[PlanConfig] = None) -> List[dict]:
    """The `top` fitting layouts by estimated tokens/s over tp (<= one node), cp (cp_degrees: powers of
    two leaving >= CP_MIN_LOCAL_TOKENS per rank), pp, ep and micro-batch size, each at the global
    batch of ``base`` (default_global_batch() when it gives none: the same rule as make_plan, so a
    plain plan of the winner reproduces its numbers)."""
    base = base or PlanConfig()
    key = (_key(cfg), world_size, repr(hw), top, repr(base))
    if key in _SEARCHES:
        return list(_SEARCHES[key])
    found = []
    for tp in [d for d in _divisors(world_size) if d <= hw.gpus_per_node]:
        for cp in cp_degrees(base.seq_len, tp, world_size):
            if world_size % (tp * cp):
                continue
            for pp in [d for d in _divisors(world_size // (tp * cp)) if d <= cfg.num_layers]:
                for ep in _divisors(world_size // pp):
                    if cfg.moe.num_experts % ep or (ep > 1 and ep < tp):
                        continue
                    if not _weights_fit(cfg, replace(base, tp=tp, cp=cp, pp=pp, ep=ep, dp=0, world_size=world_size,
                                                     micro_batch_size=1), hw):
                        continue
                    for mbs in (1, 2, 4):
                        pc = replace(base, tp=tp, cp=cp, pp=pp, ep=ep, dp=0, world_size=world_size,
                                     micro_batch_size=mbs)
                        try:
                            p = make_plan(cfg, pc, hw)
                        except ValueError:
                            continue
                        if p["fits"]:
                            found.append(p)
    found.sort(key=lambda p: -p["time"]["tokens_per_s"])
    _SEARCHES[key] = found[:top]
    return list(found[:top])


def min_gpus(cfg: ModelConfig, hw, base: Optional[PlanConfig] = None, max_world: int = 2 ** 17) -> Optional[dict]:
    """The smallest world size on which some layout fits (search()), with that layout.

    Tries 1, 2, 4, ... up to one node, then node x 2^k, up to ``max_world``; from the first power of
    two W that fits it bisects over multiples of the node size between W/2 and W (memory per rank
    falls as ranks are added, so the bisection finds the boundary; divisibility can make a count in
    between fail where a smaller one fits). Returns None when nothing up to max_world fits, else
    {"world_size", "power_of_two", "plan" (the best layout there), "tried": {world: fits}}.
    """
    base = base or PlanConfig()
    node = hw.gpus_per_node
    tried: Dict[int, bool] = {}
    best: Dict[int, dict] = {}

    def fits(w: int) -> bool:
        if w not in tried:
            plans = search(cfg, w, hw, top=1, base=base)
            tried[w] = bool(plans)
            if plans:
                best[w] = plans[0]
        return tried[w]

    w, prev = 1, 0
    while w <= max_world and not fits(w):
        prev, w = w, w * 2
    if w > max_world:
        return None
    pow2 = w
    lo, hi = prev, w
    if lo >= node:
        while hi - lo > node:
            mid = max(node, (lo + hi) // 2 // node * node)
            if mid <= lo or mid >= hi:
                break
            if fits(mid):
                hi = mid
            else:
                lo = mid
    return {"world_size": hi, "power_of_two": pow2, "plan": best[hi], "tried": dict(sorted(tried.items()))}
