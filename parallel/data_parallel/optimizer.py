"""The ZeRO-1 sharded Muon/AdamW (:class:`ShardedOptimizer`) and its wiring from a
:class:`parallel.plan.ParallelPlan` (:func:`build_sharded_optimizer`).

Tensor parallelism (:meth:`ShardedOptimizer.set_tensor_parallel`)
    Under TP each TP rank builds its own ShardedOptimizer over its DP group from its TP-sharded
    model. Shard shapes are equal on every TP rank, so ownership is too (checked): the TP ranks of
    one DP index own the same params. The grad norm then sums the per-param squared norms of
    TP-sharded params over the TP group (replicated params counted once), and a whole-matrix Muon
    param that is a TP shard is registered with ``Muon.set_tp_shard`` on the owner's main copy, so
    Newton–Schulz sees the full matrix (all its owners, one per TP rank, take part in the gather).

Expert parameters: ``edp_group`` (or a ``group_for(name, param)`` callable) puts params whose name
contains ``.mlp.experts.`` on their own replication group; each group has its own ownership and
buckets.

Partitioned models (:meth:`ShardedOptimizer.add_norm_partition`)
    When ranks of some group hold DIFFERENT parameters (pipeline stages hold different layers, EP
    ranks hold different experts), the global grad norm sums the squared norms over that group:
    ``add_norm_partition(pp_group)`` for every parameter, ``add_norm_partition(ep_group,
    experts_only=True)`` for the expert-sharded ones. The result is the single-process norm of the
    whole model (up to the order of the fp32 sum).
"""
from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from megak3.optim import MuonWithAdamW, OptimConfig, build_optimizer

from ..plan import canonical_name
from .comm import ProcessGroup, _all_gather, _rank, _reduce_scatter, _size, _timeout_of
from .gather import ParamGather
from .grads import GradReduction
from .layout import DEFAULT_BUCKET_BYTES, EXPERT_NAME_PART, _Bucket, _Slot, assign_owners, forward_blocks, plan_buckets
from .state import OptimizerState


class ShardedOptimizer(GradReduction, ParamGather, OptimizerState):
    """ZeRO-1 Muon + AdamW over data-parallel ranks; see the package docstring
    (parallel/data_parallel/__init__.py). Construction, ownership and TP declaration live here;
    gradient reduction and clipping in :class:`~parallel.data_parallel.grads.GradReduction`, the
    step and its all-gathers in :class:`~parallel.data_parallel.gather.ParamGather`, checkpoint
    state and accounting in :class:`~parallel.data_parallel.state.OptimizerState`.

    Args:
        model: the full single-process model, identical on every rank of each group.
        optim_cfg: the same :class:`OptimConfig` single-process training uses.
        dp_group: data-parallel group (``None`` = one process, no collectives).
        edp_group: replication group for expert params (name contains ``.mlp.experts.``);
            default: ``dp_group``.
        group_for: ``(name, param) -> group`` overriding both (the most general form).
        bucket_bytes: fp32 gradient bytes per bucket.
        tp_group, shard_dim: if given, :meth:`set_tensor_parallel` is called with them.
        overlap_grad_reduce: install the hooks that issue each bucket's reduce-scatter during the
            backward armed by :meth:`start_grad_overlap` (see parallel/data_parallel/grads.py).
        overlap_param_gather: :meth:`step` issues the all-gathers on dedicated communicators and
            returns; each is waited for by a forward pre-hook before its params' first use, or by
            :meth:`finish_param_gather` (see parallel/data_parallel/gather.py). Construction is then collective
            over the default group (it creates those communicators).
    """

    def __init__(self, model: nn.Module, optim_cfg: OptimConfig, dp_group: ProcessGroup = None,
                 *, edp_group: ProcessGroup = None,
                 group_for: Callable[[str, nn.Parameter], ProcessGroup] | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 tp_group: ProcessGroup = None, shard_dim: dict[str, Optional[int]] | None = None,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False):
        if bucket_bytes < 4:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 4 (one fp32 element)")
        # build_optimizer does the Muon/AdamW split, the Per-Head Muon heads and the hyperparameters;
        # its optimizers hold no state yet, and below we re-create them over owned main copies only.
        full: MuonWithAdamW = build_optimizer(model, optim_cfg)
        self.specs = full.specs
        self.dp_group = dp_group
        devices = {s.param.device for s in self.specs}
        if len(devices) > 1:
            raise ValueError(f"ShardedOptimizer needs every trainable param on one device, "
                             f"got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        """where the communication buffers live (nccl needs CUDA tensors)"""
        if group_for is None:
            def group_for(name, _param):
                return edp_group if (edp_group is not None and EXPERT_NAME_PART in name) else dp_group
        self.groups: list[ProcessGroup] = []      # distinct groups, by first appearance (same order on all ranks)
        self.group_of: list[int] = []             # per spec: index into self.groups
        for s in self.specs:
            g = group_for(s.name, s.param)
            gid = next((k for k, h in enumerate(self.groups) if h is g), None)
            if gid is None:
                gid = len(self.groups)
                self.groups.append(g)
            self.group_of.append(gid)

        dep = getattr(model, "batch_dependent_parameters", None)
        dep_ids = {id(p) for p in dep()} if callable(dep) else set()
        self.batch_dependent: list[bool] = [id(s.param) in dep_ids for s in self.specs]
        """per spec: the model says whether it gets a gradient depends on the batch (grads.py)"""
        self._presence_checked = False
        self._present: dict[int, torch.Tensor] = {}
        self.members: list[list[int]] = [[i for i, k in enumerate(self.group_of) if k == gid]
                                         for gid in range(len(self.groups))]
        # ---- ownership and buckets, per group ----
        self.owner: list[int] = [0] * len(self.specs)   # rank within the param's group
        self.buckets: list[_Bucket] = []
        bucket_numel = max(1, bucket_bytes // 4)
        for gid, g in enumerate(self.groups):
            idx = self.members[gid]
            numels = [self.specs[i].param.numel() for i in idx]
            owners = assign_owners(numels, _size(g))
            for i, r in zip(idx, owners):
                self.owner[i] = r
            self._check_same_model(g, idx)
            dtypes = list(dict.fromkeys(self.specs[i].param.dtype for i in idx))
            for dt in dtypes:  # one all-gather dtype per bucket
                sub = [j for j, i in enumerate(idx) if self.specs[i].param.dtype == dt]
                for seg_len, entries in plan_buckets([numels[j] for j in sub], [owners[j] for j in sub],
                                                     _size(g), bucket_numel):
                    slots = [_Slot(idx[sub[e]], r, off, numels[sub[e]]) for e, r, off in entries]
                    self.buckets.append(_Bucket(gid, dt, seg_len, slots))

        # ---- fp32 main copies of owned params (the param itself when it already is fp32) ----
        self.main: dict[int, torch.Tensor] = {}
        for i, s in enumerate(self.specs):
            if self._owns(i):
                p = s.param.detach()
                self.main[i] = p if p.dtype == torch.float32 else p.float().clone()
        main_of = {id(self.specs[i].param): m for i, m in self.main.items()}
        self.muon = self._local_optimizer(full.muon, main_of)
        self.adamw = self._local_optimizer(full.adamw, main_of)
        self._reduced = False
        self.tp_group: ProcessGroup = None
        self.tp_sharded: list[bool] = [False] * len(self.specs)
        """per spec: a TP shard (its squared grad norm is summed over ``tp_group``)"""
        self.norm_partitions: list[tuple[ProcessGroup, bool]] = []
        self._expert_mask: Optional[torch.Tensor] = None
        """[params] bool on the device, expert params True (clip_grad_norm_ under norm partitions)"""
        """(group, experts_only): groups over which ranks hold different params (see add_norm_partition)"""
        if tp_group is not None or shard_dim is not None:
            self.set_tensor_parallel(tp_group, shard_dim or {})
        # ---- overlapped reduce-scatter (hooks; armed per step by start_grad_overlap) ----
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self._armed = False
        self._hooks: list = []
        self.overlap_log: list[tuple[str, int]] = []
        """("launch", bucket) per bucket issued during backward in the last armed step, in order"""
        first = self._first_positions(model) if overlap_grad_reduce or overlap_param_gather else {}
        if self.overlap_grad_reduce:
            self._bucket_of = [-1] * len(self.specs)
            for k in first:
                for sl in self.buckets[k].slots:
                    self._bucket_of[sl.index] = k
            # earliest param (in model order) completes last in backward: issue those buckets last
            self._launch_order = sorted(first, key=lambda k: (-first[k], k))
            for i, s in enumerate(self.specs):
                if self._bucket_of[i] >= 0:
                    self._hooks.append(s.param.register_post_accumulate_grad_hook(self._make_hook(i)))
        # ---- all-gather behind the next forward (issued by step, waited by forward pre-hooks) ----
        self.overlap_param_gather = bool(overlap_param_gather)
        self._gather_pending: dict[int, tuple] = {}      # bucket -> (work, gathered buffer, sent buffer)
        self.gather_log: list[tuple[str, int]] = []
        """since the last :meth:`step`: ("issue", bucket) per all-gather it issued, then ("forward",
        bucket) / ("finish", bucket) as each was waited for by a forward pre-hook / by
        :meth:`finish_param_gather`"""
        if self.overlap_param_gather:
            # the next forward needs the earliest params (in model order) first: issue those first
            self._gather_order = sorted(first, key=lambda k: (first[k], k))
            self.gather_groups = self._make_gather_groups()
            block_of = forward_blocks(model)
            waits: dict[int, tuple[nn.Module, list[int]]] = {}   # id(block) -> (block, its buckets)
            for k in self._gather_order:
                for sl in self.buckets[k].slots:
                    blk = block_of[id(self.specs[sl.index].param)]
                    ks = waits.setdefault(id(blk), (blk, []))[1]
                    if k not in ks:
                        ks.append(k)
            for blk, ks in waits.values():  # prepend: before any pre-hook of the model's own
                self._hooks.append(blk.register_forward_pre_hook(self._make_gather_hook(ks), prepend=True))
            for m in model.modules():  # model.state_dict() / load_state_dict(): checkpoints
                self._hooks.append(m.register_state_dict_pre_hook(lambda *_: self.finish_param_gather()))
                self._hooks.append(m.register_load_state_dict_pre_hook(lambda *_: self.finish_param_gather()))

    def _first_positions(self, model: nn.Module) -> dict[int, int]:
        """Multi-rank bucket -> position of its earliest param in ``model.parameters()`` (the order
        the forward uses them and, reversed, the order the backward completes them)."""
        pos = {id(p): k for k, p in enumerate(model.parameters())}
        return {k: min(pos.get(id(self.specs[sl.index].param), 0) for sl in b.slots)
                for k, b in enumerate(self.buckets) if _size(self.groups[b.group_id]) > 1}

    def remove_hooks(self) -> None:
        """Remove every hook this optimizer installed on the model (gradient, forward pre-, state-dict
        hooks), after waiting for its gathers: call it before building another optimizer over the
        same model."""
        self.finish_param_gather()
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def add_norm_partition(self, group: ProcessGroup, experts_only: bool = False) -> None:
        """Declare that the ranks of ``group`` hold different parameters (all of them, or only the
        expert-sharded ones when ``experts_only``): the grad norm sums squared norms over it.
        Partitions are applied in the order they are added (experts first, then e.g. pipeline)."""
        if group is not None and _size(group) > 1:
            self.norm_partitions.append((group, bool(experts_only)))

    def set_tensor_parallel(self, tp_group: ProcessGroup, shard_dim: dict[str, Optional[int]]) -> None:
        """Declare the model TP-sharded over ``tp_group``: ``shard_dim[canonical name]`` is the
        sharded dim of each param (None = replicated), e.g. ``ParallelPlan.tp_shard_dim``.

        Collective over ``tp_group`` (every TP rank calls it, after construction, before the first
        step): checks that every TP rank derived the same ownership, then registers the owned
        whole-matrix Muon params that are TP shards with ``Muon.set_tp_shard`` (per-head params
        hold whole heads and need nothing).
        """
        names = [canonical_name(s.name) for s in self.specs]
        missing = [n for n in names if n not in shard_dim]
        if missing:
            raise ValueError(f"set_tensor_parallel: shard_dim lacks {len(missing)} params, e.g. "
                             f"{missing[:3]}; pass the ParallelPlan.tp_shard_dim of this model")
        self.tp_group = tp_group
        tp = _size(tp_group)
        self.tp_sharded = [tp > 1 and shard_dim[n] is not None for n in names]
        if tp == 1:
            return
        text = ";".join(f"{n}:{tuple(s.param.shape)}:{self.owner[i]}:{shard_dim[n]}"
                        for i, (n, s) in enumerate(zip(names, self.specs)))
        mine = torch.tensor([zlib.crc32(text.encode())], dtype=torch.int64, device=self.device)
        every = torch.empty(tp, dtype=torch.int64, device=self.device)
        _all_gather(every, mine, group=tp_group)
        if len(set(every.tolist())) != 1:
            raise ValueError(f"ShardedOptimizer: the tensor-parallel ranks derived different ownership or "
                             f"shard shapes (crc per TP rank {every.tolist()}); every TP rank must build the "
                             f"same model, parallelize it with the same plan and use the same dp size")
        if self.muon is not None:
            for i, m in self.main.items():
                s = self.specs[i]
                if s.optimizer == "muon" and s.heads is None and self.tp_sharded[i]:
                    self.muon.set_tp_shard(m, shard_dim[names[i]], tp_group)

    # ---------------------------------------------------------------- construction helpers
    def _owns(self, i: int) -> bool:
        return self.owner[i] == _rank(self.groups[self.group_of[i]])

    def _check_same_model(self, group: ProcessGroup, idx: list[int]) -> None:
        """Ownership is only consistent if every rank sees the same parameter list: compare fingerprints."""
        if _size(group) == 1:
            return
        text = ";".join(f"{self.specs[i].name}:{tuple(self.specs[i].param.shape)}" for i in idx)
        mine = torch.tensor([len(idx), sum(self.specs[i].param.numel() for i in idx),
                             zlib.crc32(text.encode())], dtype=torch.int64, device=self.device)
        every = torch.empty(_size(group) * 3, dtype=torch.int64, device=self.device)
        _all_gather(every, mine, group=group)
        for r, row in enumerate(every.view(-1, 3).tolist()):
            if row != mine.tolist():
                raise ValueError(f"ShardedOptimizer: rank {_rank(group)} and rank {r} of the data-parallel "
                                 f"group see different models ([params, numel, crc] {mine.tolist()} vs {row}); "
                                 f"build the same model with the same config on every rank")

    def _make_gather_groups(self) -> list[ProcessGroup]:
        """Per group (as ``self.groups``): a second communicator over the same ranks, for the
        overlapped all-gathers (None for a one-rank group). Their own communicator, because a
        collective issued on a gloo group runs after that group's pending work (measured: a
        1-element all-reduce behind 3 in-flight 8M-element all-gathers took 0.55 s instead of
        0.016 s on another group), and the next step's token-count and Quantile-Balancing
        all-reduces use the dp group; on NCCL it is a separate stream. ``new_group`` is collective
        over the default group, so every rank gathers every rank's groups and all create them in
        one order (as parallel/state.py does); each takes its twin's timeout."""
        mine = [tuple(dist.get_process_group_ranks(g)) if _size(g) > 1 else None for g in self.groups]
        if not any(mine):
            return [None] * len(self.groups)
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, [r for r in mine if r])
        made = {}
        for ranks in sorted({r for part in every for r in part}):
            twin = next((g for g, r in zip(self.groups, mine) if r == ranks), None)
            made[ranks] = dist.new_group(list(ranks), timeout=_timeout_of(twin, self.device))
        return [None if r is None else made[r] for r in mine]

    @staticmethod
    def _local_optimizer(opt: torch.optim.Optimizer | None, main_of: dict[int, torch.Tensor]):
        """Same class and group hyperparameters as ``opt``, restricted to owned params' main copies."""
        if opt is None:
            return None
        groups = []
        for g in opt.param_groups:
            keep = [k for k, p in enumerate(g["params"]) if id(p) in main_of]
            if not keep:
                continue
            ng = {key: v for key, v in g.items() if key not in ("params", "heads")}
            ng["params"] = [main_of[id(g["params"][k])] for k in keep]
            if "heads" in g:
                ng["heads"] = [g["heads"][k] for k in keep]
            groups.append(ng)
        return type(opt)(groups) if groups else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @property
    def param_groups(self) -> list[dict]:
        """This rank's Muon + AdamW groups (for :func:`megak3.optim.set_lr`; may be empty)."""
        return [g for o in self.optimizers for g in o.param_groups]

    # ---------------------------------------------------------------- collectives (hookable)
    def _reduce_scatter(self, out: torch.Tensor, flat: torch.Tensor, group: ProcessGroup) -> None:
        _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=group)

    def _all_gather(self, out: torch.Tensor, mine: torch.Tensor, group: ProcessGroup) -> None:
        _all_gather(out, mine, group=group)

    def _reduce_scatter_async(self, out: torch.Tensor, flat: torch.Tensor, group: ProcessGroup):
        return _reduce_scatter(out, flat, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def _all_gather_async(self, out: torch.Tensor, mine: torch.Tensor, group: ProcessGroup):
        return _all_gather(out, mine, group=group, async_op=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop model and main gradients (``set_to_none=False`` is not supported: grads are views)."""
        if not set_to_none:
            raise ValueError("ShardedOptimizer.zero_grad(set_to_none=False): main gradients are views "
                             "into per-bucket shards; use set_to_none=True")
        for s in self.specs:
            s.param.grad = None
        for m in self.main.values():
            m.grad = None
        self._reduced = False
        self._armed = False


def build_sharded_optimizer(model: nn.Module, optim_cfg: OptimConfig, plan, overlap_grad_reduce: bool = False,
                            bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                            overlap_param_gather: bool = False) -> ShardedOptimizer:
    """The ZeRO-1 optimizer of a parallelized model, wired from its :class:`parallel.plan.ParallelPlan`:
    each gradient reduces over ``plan.grad_group`` (dp, or expert-dp for expert shards; None when
    that group has one rank), TP shards are declared, and the norm partitions are added."""
    ps = plan.ps
    opt = ShardedOptimizer(model, optim_cfg, ps.dp_cp_group, group_for=plan.make_grad_group_fn(),
                           overlap_grad_reduce=overlap_grad_reduce, bucket_bytes=bucket_bytes,
                           overlap_param_gather=overlap_param_gather)
    if ps.tp_size > 1:
        opt.set_tensor_parallel(ps.tp_group, plan.tp_shard_dim)
    for group, experts_only in plan.norm_partitions:
        opt.add_norm_partition(group, experts_only=experts_only)
    return opt
