"""Apply expert parallelism (etp = 1) to a built model, from the outside.

Every rank builds the same single-process model (same seed => same full expert tensors), then
:func:`parallelize_ep` keeps, in every LatentMoE, this EP rank's E/ep home experts (contiguous
chunk r of dim 0 of ``experts.w1/w3/w2``: experts ``[r*E/ep, (r+1)*E/ep)``) and installs a
dispatcher in the layer's ``expert_dispatch`` hook:

    moonep.enabled=true   moonep.moonep.MoonEPDispatcher  (replicas, exactly S*K rows per rank)
    moonep.enabled=false  moonep.dispatch.BaselineDispatcher (home experts only, dynamic splits)

Everything else (router, latent projections, latent norm, shared experts) stays as it is, so this
composes with parallelize_tp (call either first): under TP without SP every TP rank routes the same
tokens and dispatches them over its own EP group; under SP each TP rank routes its own token
shard. The returned :class:`EPPlan` says which parameters are expert-sharded, for the optimizer
(expert-data-parallel gradient reduction over ``edp``), the gradient norm (sum of squares over the
EP group for these parameters) and checkpoints (concatenate the EP ranks' shards along dim 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megak3.model.moe import LatentMoE
from moonep.buffers import BufferPool
from moonep.config import MoonEPConfig
from moonep.dispatch import BaselineDispatcher

__all__ = ["EPPlan", "full_expert_tensor", "parallelize_ep"]


@dataclass
class EPPlan:
    """What parallelize_ep did."""

    ep_size: int
    ep_rank: int
    group: Optional[object]
    enabled: bool
    """MoonEP (True) or the baseline dispatcher (False)"""
    shard_dim: Dict[str, int] = field(default_factory=dict)
    """canonical parameter name -> sharded dim (always 0) over the EP group, expert params only"""
    dispatchers: List[object] = field(default_factory=list)
    """one per LatentMoE, in model order"""
    pool: Optional[BufferPool] = None
    """the fixed-buffer pool shared by every layer's MoonEP dispatcher"""
    replica_buffers: Optional[object] = None
    """moonep.moonep.ReplicaBuffers shared by every layer's MoonEP dispatcher (a buffer is reused by
    the next layer once no autograd graph holds its views: with activation checkpointing one buffer
    serves all layers)"""


def _group_of(ps_or_group):
    if ps_or_group is None or isinstance(ps_or_group, dist.ProcessGroup):
        return ps_or_group
    if hasattr(ps_or_group, "ep_group"):  # a ParallelState
        if getattr(ps_or_group, "etp_size", 1) != 1:
            raise ValueError(f"parallel.etp={ps_or_group.etp_size}: expert parallelism supports etp=1 only")
        return ps_or_group.ep_group
    raise TypeError(f"parallelize_ep needs a ParallelState or a ProcessGroup, got {type(ps_or_group).__name__}")


def parallelize_ep(model: nn.Module, ps_or_group, moonep_cfg: Optional[MoonEPConfig] = None,
                   pool: Optional[BufferPool] = None, recorder=None) -> EPPlan:
    """Shard the routed experts of every LatentMoE in ``model`` over the EP group, in place.

    ps_or_group: a ParallelState (its ep_group) or the EP ProcessGroup (None: one rank).
    moonep_cfg: MoonEPConfig (default: enabled, E/ep replica slots, auto planner).
    pool: fixed-buffer pool for MoonEP (default: a new one shared by this model's layers).
    recorder: optional load-statistics hook handed to every dispatcher (a moonep.stats.LoadRecorder).
    """
    group = _group_of(ps_or_group)
    cfg = moonep_cfg or MoonEPConfig()
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    moes = [(n, m) for n, m in model.named_modules() if isinstance(m, LatentMoE)]
    plan = EPPlan(size, rank, group, cfg.enabled, pool=pool or BufferPool())
    for layer_idx, (name, moe) in enumerate(moes):
        E = moe.num_experts
        cfg.validate(num_experts=E, ep=size)
        if size == 1:
            continue
        El = E // size
        ex = moe.experts
        for pname in ("w1", "w3", "w2"):
            p = getattr(ex, pname)
            if p.shape[0] != E:
                raise ValueError(f"{name}.experts.{pname} has {p.shape[0]} experts, expected the full "
                                 f"{E}; parallelize_ep was already applied")
            chunk = p.data[rank * El:(rank + 1) * El].clone()
            setattr(ex, pname, nn.Parameter(chunk, requires_grad=p.requires_grad))
            canon = f"{name}.experts.{pname}".replace(".inner.", ".")
            plan.shard_dim[canon.removeprefix(".")] = 0
        ex.num_experts = El
        if cfg.enabled:
            from moonep.moonep import MoonEPDispatcher, ReplicaBuffers

            if plan.replica_buffers is None:
                plan.replica_buffers = ReplicaBuffers()
            disp = MoonEPDispatcher(group, E, moe.top_k, cfg.replicas_per_rank(E, size),
                                    planner_backend=cfg.planner_backend, pool=plan.pool, recorder=recorder,
                                    layer_idx=layer_idx, tolerance=float(cfg.tolerance),
                                    replica_buffers=plan.replica_buffers)
        else:
            disp = BaselineDispatcher(group, E, recorder=recorder, layer_idx=layer_idx)
        moe.expert_dispatch = disp
        plan.dispatchers.append(disp)
    return plan


def full_expert_tensor(t: torch.Tensor, plan: EPPlan) -> torch.Tensor:
    """All-gather an expert-sharded tensor (a parameter or its gradient) to the full [E, ...]."""
    if plan.ep_size == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(plan.ep_size)]
    dist.all_gather(parts, t.detach().contiguous(), group=plan.group)
    return torch.cat(parts, dim=0)
