"""Exact per-rank figures of one rank (per_rank_figures): parameters, gradients, ZeRO-1 optimizer
state and checkpoint bytes counted parameter by parameter, as tools/simulate_scale.py measures
them on the trainer's own meta-device shards.
"""
from __future__ import annotations

from typing import Dict, List

from ...config import ModelConfig
from .config import PlanConfig, _key
from .inventory import _on_stage, _stage_layer_list, buffer_inventory, check_model, inventory, stage_chunks
from .memory import offload_figures


def _owners(numels: List[int], world: int) -> List[int]:
    """parallel.data_parallel.assign_owners (greedy LPT, ties to the lower index / rank) with a heap."""
    import heapq

    heap = [(0, r) for r in range(world)]
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + numels[i], r))
    return owner


def _stage_index(stage, pp: int) -> int:
    if isinstance(stage, str):
        named = {"first": 0, "middle": pp // 2, "last": pp - 1}
        if stage not in named:
            raise ValueError(f"stage={stage!r}: give an index 0..{pp - 1} or 'first', 'middle', 'last'")
        return named[stage]
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
        raise ValueError(f"stage={stage!r} must be 0..{pp - 1} (parallel.pp={pp})")
    return stage


def per_rank_figures(cfg: ModelConfig, pc: PlanConfig, stage="first", rank_in_stage: int = 0) -> dict:
    """Exact per-rank parameter, gradient, optimizer-state and checkpoint bytes of one rank, counted
    parameter by parameter from the real module tree (meta device) and sharded as the trainer shards:
    TP dims of parallel/parallelize.py (tensor numel / tp), E/ep routed experts per EP rank
    (parallel/expert_parallel.py), the stage's layers of parallel/pipeline/partition.rank_chunks
    (+ embedding/vision on the first, output AttnRes/norm/lm_head on the last stage), ZeRO-1
    whole-parameter ownership of parallel/data_parallel.assign_owners over the rank's params in
    optimizer (named_parameters) order -- dense params over dp, expert shards over edp (a separate
    group); without EP every param is on the dp group -- and the checkpoint shards the trainer writes
    (one saver per distinct shard, plus the optimizer state of the params the rank owns).

    stage: the pipeline rank: an int, 'first' | 'middle' (pp // 2) | 'last', or a coordinates dict
        as parallel.grid.Layout.coords(rank) returns it ({"pp", "tp", "dp", "ep", "edp", ...};
        rank_in_stage is then ignored; under CP its "dp-cp" entry is the dense ZeRO-1 rank).
    rank_in_stage: the rank's index among the world_size / pp ranks of its stage (default 0: the
        saver of every shard it holds). With the default order tp-cp-ep-dp-pp: tp_rank = r % tp,
        dp_rank = r // tp (the rank in the dp x cp group: dense params are owned and saved over
        dp x cp), ep_rank = r % ep, edp_rank = r // ep.

    Returns (counts are elements, *_bytes are bytes; dtypes as the trainer keeps them):
      stage, layers           pipeline rank and its layer ranges [[start, stop], ...]
      tp_rank, dp_rank, ep_rank, edp_rank
      params                  parameter elements this rank holds (TP shards + its E/ep experts)
      dense_params, expert_params   of which dense / routed-expert (EP-sharded when ep > 1) elements
      param_bytes             params x param_dtype size (4 for fp32, 2 for bf16)
      buffer_bytes            persistent buffers of the state_dict (the routers' e_score_correction_bias)
      grad_bytes              one gradient per local param, param dtype (the model's .grad)
      owned_params            elements this rank owns under ZeRO-1 (dense over dp, expert shards over edp)
      owned_muon_params, owned_adamw_params
      optimizer_state_bytes   owned Muon momentum 4 B/elem + AdamW exp_avg + exp_avg_sq 8 B/elem
      main_param_bytes        fp32 main copies of owned params (0 with fp32 params: the param is the copy)
      checkpoint_model_bytes  model tensors (params + buffers) the rank writes: its dense shards when
                              dp_rank == 0, its expert shards when edp_rank == 0 (dp_rank without EP)
      checkpoint_optimizer_bytes  its owned optimizer state tensors (= optimizer_state_bytes; AdamW's
                              scalar 'step' travels as metadata)
      checkpoint_bytes        the sum: tensor bytes this rank writes per checkpoint (after the first step)
      checkpoint_meta_read_bytes  metadata bytes it reads to resume: :func:`checkpoint_meta_read_bytes`
    With ``optim.offload=cpu`` also: optimizer_state_device_bytes (Muon's 4 B/elem) and
    :func:`offload_figures` of the owned AdamW elements (host bytes, PCIe and host-memory bytes per step).
    """
    pc = pc.resolved()
    check_model(cfg, pc)
    per_stage = pc.world_size // pc.pp
    if isinstance(stage, dict):
        s = _stage_index(int(stage.get("pp", 0)), pc.pp)
        tp_rank = int(stage.get("tp", 0))
        dp_rank = int(stage.get("dp-cp", stage.get("dp", 0))) if pc.cp > 1 else int(stage.get("dp", 0))
        ep_rank, edp_rank = int(stage.get("ep", 0)), int(stage.get("edp", 0))
    else:
        s = _stage_index(stage, pc.pp)
        r = rank_in_stage
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < per_stage:
            raise ValueError(f"rank_in_stage={r!r} must be 0..{per_stage - 1} (world_size / pp)")
        tp_rank, dp_rank, ep_rank, edp_rank = r % pc.tp, r // pc.tp, r % pc.ep, r // pc.ep
    layers = set(_stage_layer_list(cfg, pc, s))
    first, last = s == 0, s == pc.pp - 1
    pbytes = 4 if pc.param_dtype == "fp32" else 2
    ep_on = pc.ep > 1
    dense, expert = [], []          # (local numel, optimizer) in named_parameters order
    for _, n, where, tp_sh, is_exp, opt in inventory(cfg):
        if not _on_stage(where, layers, first, last):
            continue
        if is_exp and ep_on:
            expert.append((n // pc.ep, opt))
        else:
            dense.append((n // pc.tp if tp_sh and pc.tp > 1 else n, opt))
    groups = [(dense, pc.dp_cp, dp_rank), (expert, pc.edp, edp_rank)] if ep_on else [(dense, pc.dp_cp, dp_rank)]
    owned = {"muon": 0, "adamw": 0}
    for items, world, rank in groups:
        for (n, opt), o in zip(items, _owners([n for n, _ in items], world)):
            if o == rank:
                owned["muon" if opt == "muon" else "adamw"] += n
    n_dense, n_expert = sum(n for n, _ in dense), sum(n for n, _ in expert)
    buffers = sum(n * es for _, n, where, es in buffer_inventory(cfg) if _on_stage(where, layers, first, last))
    ckpt_model = (n_dense * pbytes + buffers if dp_rank == 0 else 0) + (n_expert * pbytes if edp_rank == 0 else 0)
    state = 4 * owned["muon"] + 8 * owned["adamw"]
    return {"stage": s, "layers": [[c.start, c.stop] for c in stage_chunks(cfg, pc, s)],
            "tp_rank": tp_rank, "dp_rank": dp_rank, "ep_rank": ep_rank, "edp_rank": edp_rank,
            "params": n_dense + n_expert, "dense_params": n_dense, "expert_params": n_expert,
            "param_bytes": (n_dense + n_expert) * pbytes, "buffer_bytes": buffers,
            "grad_bytes": (n_dense + n_expert) * pbytes,
            "owned_params": owned["muon"] + owned["adamw"], "owned_muon_params": owned["muon"],
            "owned_adamw_params": owned["adamw"], "optimizer_state_bytes": state,
            "main_param_bytes": 0 if pc.param_dtype == "fp32" else 4 * (owned["muon"] + owned["adamw"]),
            "checkpoint_model_bytes": ckpt_model, "checkpoint_optimizer_bytes": state,
            "checkpoint_bytes": ckpt_model + state,
            "checkpoint_meta_read_bytes": checkpoint_meta_read_bytes(cfg, pc, layers, first, last),
            **({"optimizer_state_device_bytes": 4 * owned["muon"],
                **offload_figures(owned["adamw"])} if pc.offload == "cpu" else {})}


_SHAPES: Dict[str, dict] = {}


def checkpoint_meta_read_bytes(cfg: ModelConfig, pc: PlanConfig, layers, first: bool, last: bool) -> int:
    """Metadata bytes a rank of the stage (``layers``, first / last) reads to resume from a per-shard
    checkpoint (megak3.checkpoint.key_index.read_bytes): the manifest, index.json (every key of the model)
    and the index parts of the stage's model and optimizer keys; a key's chunks: E/ep pieces of a
    routed expert tensor (ep > 1), tp pieces of a TP-sharded one, else one. Independent of dp, so
    constant in the world size for fixed tp, pp and ep."""
    from ...checkpoint import key_index as shard_index

    key = _key(cfg)
    if key not in _SHAPES:
        import torch

        from ...model.k3 import K3Model

        with torch.device("meta"):
            model = K3Model(cfg)
        _SHAPES[key] = {n.replace(".inner.", "."): tuple(t.shape) for n, t in model.state_dict().items()}
    shapes = _SHAPES[key]
    pbytes = 4 if pc.param_dtype == "fp32" else 2
    keys, object_keys, read = [f"model/{n}" for n in shapes], [], {}
    for name, _, where, tp_sh, is_exp, opt in inventory(cfg):
        n = name.replace(".inner.", ".")
        states = shard_index.optimizer_state_names(opt)
        keys += [f"optim/{n}/{st}" for st in states]
        object_keys.append(f"optim_meta/{n}")
        if _on_stage(where, layers, first, last):
            chunks = pc.ep if is_exp and pc.ep > 1 else (pc.tp if tp_sh and pc.tp > 1 else 1)
            read[f"model/{n}"] = (shapes[n], pbytes, chunks)
            read.update({f"optim/{n}/{st}": (shapes[n], 4, chunks) for st in states})
    for name, _, where, es in buffer_inventory(cfg):
        if _on_stage(where, layers, first, last):
            n = name.replace(".inner.", ".")
            read[f"model/{n}"] = (shapes[n], es, 1)
    return shard_index.read_bytes(keys, read, pc.world_size, object_keys)["total"]
