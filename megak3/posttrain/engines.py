"""Rollout engines with their own layout and count, colocated on the trainer's ranks.

``rl.rollout.tp`` x ``rl.rollout.ep`` is one engine replica's layout (no pipeline or context parallelism,
no sequence parallelism: decoding runs one token per sequence); a replica spans ``E = lcm(tp, ep)`` ranks
(dense grid tp x dp=E/tp, expert grid ep x edp=E/ep, as a training layout of E ranks would be). Replica
``r`` of ``rl.rollout.replicas`` lives on the trainer's ranks ``[r*E, (r+1)*E)`` (colocated: the ranks
time-share the trainer's memory and cores; ``rl.rollout.release`` frees the engine's weights while the
trainer updates, and the refit re-creates them). Ranks beyond ``replicas*E`` hold no engine.

Why colocated is the default (and, for now, the only placement built): on a fixed set of ranks the trainer's
state is sharded over all of them instead of half, and the engine's weights are released during the update, so
the peak memory per rank is lower; in synchronous RL neither side idles while the other works. Measured by
tools/bench_rl_placement.py (2 gloo ranks, parity-sized model, against a trainer on one rank and an engine on
the other): peak memory per rank 0.74x with a tp2 trainer and engine, 0.86x with dp2 and two tp1 replicas; on
a shared 2-core CPU host the wall time per iteration was 1.15x / 1.42x the separate estimate (two ranks get no
parallel speed-up there), so the memory is the reason, not the time.

:func:`replica_groups` creates every replica's process groups (collective over the world: every rank
creates every group, in one order) and returns this rank's engine :class:`~parallel.state.ParallelState`.
:class:`ReplicaRollouts` sends each GRPO group to one replica, chosen by the cache-affine
:class:`megak3.inference.router.Router` (the replica holding the longest checkpointed prefix of the group's
context, guarded by load; every rank routes alike: the router is pure and sees the same rollouts) and kept
for the group's life (a paused sample's cache lives in its replica), runs the replica's
:class:`~megak3.posttrain.rollout.PartialRollouts`, then gives every rank the new tokens of every sample
(one ``all_gather_object`` over the world), so every rank's buffer stays identical.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from parallel.state import AXES, ParallelState

from .buffer import Rollout


@dataclass
class RolloutConfig:
    """The rollout engines (``rl.rollout.*``)."""

    tp: int = 0
    """tensor-parallel ranks of one engine replica (0: the trainer's parallel.tp)"""
    ep: int = 0
    """expert-parallel ranks of one engine replica (0: the trainer's parallel.ep, or 1 when the replica has tp > 1)"""
    replicas: int = 0
    """engine replicas, each on its own lcm(tp, ep) of the trainer's ranks (0: as many as the ranks hold)"""
    release: bool = True
    """free the engines' weights while the trainer updates (the refit re-creates them)"""

    def validate(self) -> "RolloutConfig":
        for f in ("tp", "ep", "replicas"):
            if getattr(self, f) < 0:
                raise ValueError(f"rl.rollout.{f}={getattr(self, f)} must be >= 0 (0: the default)")
        return self

    def resolve(self, par, world: int, model_cfg=None) -> "RolloutConfig":
        """The layout in use on ``world`` trainer ranks (defaults filled in); raises ValueError naming the field."""
        self.validate()
        tp = self.tp or par.tp
        ep = self.ep or (par.ep if tp == 1 else 1)
        if ep > 1 and tp > 1:
            raise ValueError(f"rl.rollout.ep={ep} with rl.rollout.tp={tp}: an engine decodes without sequence "
                             "parallelism, which expert parallelism under tp needs; set rl.rollout.tp=1 or "
                             "rl.rollout.ep=1")
        size = tp * ep // math.gcd(tp, ep)
        if size > world:
            raise ValueError(f"rl.rollout.tp={tp} x rl.rollout.ep={ep} needs {size} ranks per replica but the "
                             f"trainer has {world}; lower rl.rollout.tp or rl.rollout.ep")
        replicas = self.replicas or world // size
        if replicas * size > world:
            raise ValueError(f"rl.rollout.replicas={replicas} x {size} ranks each exceeds the trainer's {world} "
                             f"ranks; set rl.rollout.replicas <= {world // size}")
        if model_cfg is not None:
            n = model_cfg.moe.num_experts
            if n % ep:
                raise ValueError(f"rl.rollout.ep={ep} must divide model.moe.num_experts={n}")
            for what, heads in (("kda.num_heads", model_cfg.kda.num_heads), ("mla.num_heads", model_cfg.mla.num_heads)):
                if heads % tp:
                    raise ValueError(f"rl.rollout.tp={tp} must divide model.{what}={heads}")
        return dataclasses.replace(self, tp=tp, ep=ep, replicas=replicas)

    @property
    def size(self) -> int:
        """ranks of one replica (resolved config)"""
        return self.tp * self.ep // math.gcd(self.tp, self.ep)

    def parallel(self, par):
        """The engine's ``parallel.*``: the trainer's backend and timeouts, this layout, no pp / cp / SP."""
        return dataclasses.replace(par, tp=self.tp, ep=self.ep, etp=1, dp=self.size // self.tp, pp=1, vp=1, cp=1,
                                   pp_layout=None, sequence_parallel=False, cp_balance=False)


def replica_groups(cfg: RolloutConfig, par, rank: int, world: int) -> tuple:
    """(this rank's replica index or None, its engine ParallelState or None). Every rank calls this
    (``dist.new_group`` is collective over the world) with the resolved ``cfg``."""
    E = cfg.size
    layout = cfg.parallel(par).to_layout(E)
    replica = rank // E if rank < cfg.replicas * E else None
    if world == 1:
        return 0, ParallelState(layout=layout)
    dense, expert = layout.dense_groups(), layout.expert_groups()
    grid = {a: (dense if i < 7 else expert)[a.replace("_", "-")] for i, a in enumerate(AXES)}
    fields, made = {}, {}
    local = rank - (replica or 0) * E
    coords = layout.coords(local) if replica is not None else {}
    from datetime import timedelta

    timeout = timedelta(seconds=float(par.timeout_s))
    for axis, groups in grid.items():
        size = len(groups[0])
        if replica is not None:
            fields[f"{axis}_size"] = size
            fields[f"{axis}_rank"] = coords[axis.replace("_", "-")]
        if size == 1:
            continue
        for r in range(cfg.replicas):
            for ranks in groups:
                key = tuple(r * E + x for x in ranks)
                if key not in made:
                    made[key] = dist.new_group(list(key), timeout=timeout)
                if rank in key:
                    fields[f"{axis}_group"] = made[key]
    if replica is None:
        return None, None
    return replica, ParallelState(layout=layout, rank=local, world_size=E, host_group=dist.group.WORLD, **fields)


def _state(r: Rollout) -> tuple:
    return (list(r.token_ids), list(r.logprobs), list(r.versions), list(r.mask), r.finished, r.finish_reason,
            r.text)


class ReplicaRollouts:
    """:class:`PartialRollouts` of this rank's replica (``sampler``; None on a rank without one), with the
    samples' new tokens shared by every rank after each :meth:`run` (module docstring)."""

    def __init__(self, sampler, replica: Optional[int], replicas: int, leader: bool, sync: bool,
                 checkpoint_interval: int = 512, max_load_ratio: float = 1.25):
        from megak3.inference.router import Router

        self.sampler, self.replica, self.replicas, self.leader, self.sync = sampler, replica, replicas, leader, sync
        self.router = Router(replicas, checkpoint_interval=checkpoint_interval, balance=max_load_ratio)
        self.placed: dict = {}
        """GRPO group -> its replica (kept: a paused sample or an episode's next turn returns to its cache)"""
        self.on_finish = None
        """called with each rollout the moment every rank knows it finished (the resumable run's journal)"""

    def place(self, rollouts: List[Rollout]) -> None:
        """Route every group not placed yet (in buffer order, the same on every rank)."""
        groups: dict = {}
        for r in rollouts:
            groups.setdefault(r.group, []).append(r)
        for g, rs in groups.items():
            if g not in self.placed:
                ctx = list(rs[0].prompt_ids) + list(rs[0].token_ids)
                self.placed[g] = self.router.route(ctx, max_new=len(rs) * max(r.remaining for r in rs))

    def mine(self, rollouts: List[Rollout]) -> List[Rollout]:
        self.place(rollouts)
        return [r for r in rollouts if self.placed[r.group] == self.replica]

    def run(self, rollouts: List[Rollout], version: int, stop_after: Optional[int] = None) -> int:
        todo = [r for r in rollouts if not r.finished]
        self.place(todo)
        mine = self.mine(todo) if self.replica is not None else []
        share = None
        if stop_after is not None and mine:  # each replica's share of the samples to finish, rounded up
            share = math.ceil(stop_after * len(mine) / max(len(todo), 1))
        done = self.sampler.run(mine, version, stop_after=share) if mine else 0
        if not self.sync:  # one replica spans every rank: all ranks generated every sample alike
            for r in todo:
                if r.finished and self.on_finish is not None:
                    self.on_finish(r)
            return done
        out = {r.uid: _state(r) for r in mine} if self.leader else {}
        got: list = [None] * dist.get_world_size()
        dist.all_gather_object(got, out)
        by_uid = {r.uid: r for r in todo}
        finished = 0
        for part in got:
            for uid, (tok, lp, ver, mask, fin, why, text) in part.items():
                r = by_uid[uid]
                r.token_ids, r.logprobs, r.versions, r.mask = tok, lp, ver, mask
                r.finished, r.finish_reason, r.text = fin, why, text
                if fin:
                    finished += 1
                    if self.on_finish is not None:
                        self.on_finish(r)
        return finished

    def release_all(self) -> None:
        if self.sampler is not None:
            self.sampler.release_all()


@torch.no_grad()
def release_weights(model: torch.nn.Module) -> int:
    """Free the storage of every parameter and buffer of ``model`` (colocated engines during the update);
    :func:`restore_weights` re-creates it (uninitialised: the refit fills it). Returns the bytes freed."""
    n = 0
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        if s.size() > 0:
            n += s.size()
            s.resize_(0)
    return n


@torch.no_grad()
def restore_weights(model: torch.nn.Module) -> None:
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        need = (t.storage_offset() + t.numel()) * t.element_size()
        if s.size() < need:
            s.resize_(need)
