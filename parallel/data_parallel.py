"""Data parallelism with a ZeRO-1 sharded Muon/AdamW that is exactly single-process megak3.optim.

Why whole parameters
    Muon orthogonalises whole matrices (or per-head / per-expert blocks of one matrix), so a
    parameter cannot be split across ranks the way ZeRO splits flat AdamW state. Each DP rank
    therefore OWNS a set of whole parameters, holds the fp32 main copy and the optimizer state
    (Muon momentum, Adam exp_avg/exp_avg_sq) only for those, and computes only their update with
    the unchanged :class:`megak3.optim.Muon` / ``torch.optim.AdamW``. Per-Head Muon blocks and
    stacked experts [E, A, B] need nothing special: their owner sees the whole tensor.

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

Loss-normalisation contract: gradients are SUMMED over DP, never averaged
    The caller backpropagates its local share of the GLOBAL token mean,
    ``loss_sum_local / global_tokens`` with ``global_tokens`` summed over the DP group (as the
    trainer already does over micro-batches: ``loss_sum / step_tokens``). The sum over ranks of
    those gradients is then exactly the gradient of the global-batch mean, whatever the per-rank
    token counts, which a local mean followed by averaging is not.

Call order per optimizer step::

    loss.backward()                # every micro-batch; grads accumulate in model .grad
    opt.reduce_gradients()         # reduce-scatter; model .grad are released
    opt.clip_grad_norm_(max_norm)  # global norm from the owners' shards (one all-reduce)
    set_lr(opt, lr); opt.step()    # local Muon/AdamW on owned params, then all-gather (or only
    opt.zero_grad()                # issue it: overlap_param_gather, waited in the next forward)

Overlapped reduce-scatter (``overlap_grad_reduce=True``, issue 19 item 4)
    Each param gets a post-accumulate-grad hook. :meth:`ShardedOptimizer.start_grad_overlap`, called
    before the backward of the LAST micro-batch of a step, arms them: a bucket's reduce-scatter is
    issued (``async_op=True``) as soon as every param of the bucket has its final gradient, while the
    rest of the backward runs. Buckets are issued in one fixed order on every rank (the collectives
    of a group must match): by descending position of their earliest parameter in
    ``model.parameters()``, i.e. roughly the order backward completes them; a bucket that is ready
    before its predecessors waits for them. :meth:`reduce_gradients` then issues what is left (params
    that got no gradient on this rank), runs the has-gradient all-reduce, and waits for all handles.
    Same flat layout, same buffers, same collective: the result is bitwise that of the
    non-overlapped form (tests/test_overlap.py). A gradient accumulated into a param whose bucket was
    already issued raises (it would be lost). Callers that modify gradients between backward and
    :meth:`reduce_gradients` (TP partial-gradient sums) or interleave other collectives on the same
    group must not arm it (``RankStep`` arms it only without tp/pp/ep/cp).

All-gather behind the next forward (``overlap_param_gather=True``, issue 19 item 4)
    :meth:`ShardedOptimizer.step` runs the local Muon/AdamW, ISSUES every bucket's all-gather
    (``async_op=True``; the bucket holding the earliest params in ``model.parameters()`` order
    first, the order the next forward needs them) and returns. A forward pre-hook on each "block"
    (:func:`forward_blocks`: for a K3Model a decoder layer, the embedding, the head, the vision
    tower) waits for the buckets holding that block's params and copies them in before the block
    runs, so the gathers of later layers proceed while earlier layers compute; once a bucket is
    copied the hooks of this step do nothing more for it. :meth:`~ShardedOptimizer.finish_param_gather`
    waits for whatever is left; every reader of parameter values outside a forward must call it,
    and this module calls it itself wherever it can: in ``reduce_gradients`` (the next step; a
    param no forward used is still pending there), ``step``, ``state_dict`` / ``load_state_dict``,
    ``export_state`` (hence ``consolidate_optimizer_state``), ``load_consolidated_state``, and,
    through hooks, in ``state_dict()`` / ``load_state_dict()`` of every module of the model
    (the trainer's checkpoint save and load, ``consolidate_model_state``, ``load_full_state``).
    Code that reads ``model.parameters()`` values directly after a step (tests, tools) calls it.
    The gathers run on dedicated communicators (``gather_groups``: same ranks as the dp / edp
    groups), because a collective issued on a gloo group waits for that group's pending work and
    the next step's token-count and Quantile-Balancing all-reduces use the dp group; building them
    makes the construction collective over the default group. Same layout, same buffers, same
    collective: bitwise the non-overlapped result (tests/test_overlap.py). All gathers of a step
    are issued before any rank waits for one, in one order on every rank, so no layout can
    deadlock on them; ``RankStep`` uses it under every layout (tp, pp, ep, cp included).
    How much can hide is bounded by the bucket layout: buckets pack each rank's params in LPT order
    (largest first), not by model position, so one bucket mixes layers far apart and the first
    blocks need many buckets (k3_tiny, dp2, 4 MiB buckets: the embedding needs 19% of the gathered
    bytes, the first decoder layer 30%, the middle one 81%; at dp8, 75% before the embedding).
    Not built: a position-ordered layout (packing each rank's params in model order instead pads
    14-38% with whole-parameter ownership, and hides little more).

Collectives used: ``reduce_scatter_single`` / ``all_gather_single`` (``reduce_scatter_tensor`` /
``all_gather_into_tensor`` before torch 2.13) and ``all_reduce``; gloo supports all of them in
torch 2.13 (checked with two gloo ranks), as does nccl. A group of size 1 (or ``None``) calls no
collective. Groups carry their own timeouts (parallel/state.py creates them).

Tensor parallelism (:meth:`ShardedOptimizer.set_tensor_parallel`)
    Under TP each TP rank builds its own ShardedOptimizer over its DP group from its TP-sharded
    model. Shard shapes are equal on every TP rank, so ownership is too (checked): the TP ranks of
    one DP index own the same params. The grad norm then sums the per-param squared norms of
    TP-sharded params over the TP group (replicated params counted once), and a whole-matrix Muon
    param that is a TP shard is registered with ``Muon.set_tp_shard`` on the owner's main copy, so
    Newton–Schulz sees the full matrix (all its owners, one per TP rank, take part in the gather).

Layout-free optimizer state
    :meth:`ShardedOptimizer.export_state` gives this rank's owned params' state under canonical
    (single-process) names; :func:`consolidate_optimizer_state` gathers every rank's export on
    global rank 0 and concatenates TP shards: exactly what a single-process ShardedOptimizer
    exports. :func:`load_consolidated_state` slices it back for any (tp, dp) layout;
    :func:`consolidate_model_state` does the same gather for the model tensors (load those with
    :func:`parallel.parallelize.load_full_state`).

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
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from megak3.optim import MuonWithAdamW, OptimConfig, build_optimizer

from .parallelize import canonical_name

ProcessGroup = Optional[dist.ProcessGroup]
EXPERT_NAME_PART = ".mlp.experts."
"""parameters whose name contains this go to ``edp_group`` when one is given"""
STATE_FORMAT = "megak3.zero1.v1"
CANONICAL_FORMAT = "megak3.optim.canonical.v1"
"""format tag of :meth:`ShardedOptimizer.export_state` / :func:`consolidate_optimizer_state`"""
DEFAULT_BUCKET_BYTES = 40 * 2**20
"""fp32 gradient bytes per bucket (10M elements; Megatron-Core defaults to 40M, smaller keeps the
transient dp·S-element buffer of each reduce-scatter modest on CPU)"""

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size(group: ProcessGroup) -> int:
    return 1 if group is None else group.size()


def _rank(group: ProcessGroup) -> int:
    return 0 if group is None else group.rank()


def _timeout_of(group: ProcessGroup, device: torch.device):
    """The timeout ``group`` was created with (None: the default)."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


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


class ShardedOptimizer:
    """ZeRO-1 Muon + AdamW over data-parallel ranks; see the module docstring.

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
            backward armed by :meth:`start_grad_overlap` (see the module docstring).
        overlap_param_gather: :meth:`step` issues the all-gathers on dedicated communicators and
            returns; each is waited for by a forward pre-hook before its params' first use, or by
            :meth:`finish_param_gather` (see the module docstring). Construction is then collective
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
            for m in model.modules():  # model.state_dict() / load_state_dict(): checkpoints, consolidation
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
        sharded dim of each param (None = replicated), e.g. ``TPPlan.shard_dim``.

        Collective over ``tp_group`` (every TP rank calls it, after construction, before the first
        step): checks that every TP rank derived the same ownership, then registers the owned
        whole-matrix Muon params that are TP shards with ``Muon.set_tp_shard`` (per-head params
        hold whole heads and need nothing).
        """
        names = [canonical_name(s.name) for s in self.specs]
        missing = [n for n in names if n not in shard_dim]
        if missing:
            raise ValueError(f"set_tensor_parallel: shard_dim lacks {len(missing)} params, e.g. "
                             f"{missing[:3]}; pass the TPPlan.shard_dim of this model")
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

    # ---------------------------------------------------------------- overlapped reduce-scatter
    def _make_hook(self, i: int):
        def hook(_param):
            if self._armed:
                self._grad_ready(i)
        return hook

    def start_grad_overlap(self) -> None:
        """Arm the overlap for the coming backward (the last micro-batch of the step): each bucket's
        reduce-scatter is issued once all its params' gradients are final. No-op unless built with
        ``overlap_grad_reduce=True``. :meth:`reduce_gradients` completes it."""
        if not self.overlap_grad_reduce:
            return
        self._armed = True
        self._ready = [False] * len(self.specs)
        self._left = [len(b.slots) for b in self.buckets]
        self._next = 0                                   # index into _launch_order
        self._inflight: dict[int, tuple] = {}            # bucket -> (work, shard, flat)
        self.overlap_log = []

    @torch.no_grad()
    def _grad_ready(self, i: int) -> None:
        k = self._bucket_of[i]
        if self._ready[i]:
            if k in self._inflight:
                raise RuntimeError(f"ShardedOptimizer(overlap_grad_reduce=True): {self.specs[i].name!r} received "
                                   "another gradient after its bucket's reduce-scatter was issued (a param used "
                                   "by two backward passes of one micro-batch?); turn the overlap off")
            return
        self._ready[i] = True
        self._left[k] -= 1
        while self._next < len(self._launch_order) and self._left[self._launch_order[self._next]] == 0:
            self._launch(self._launch_order[self._next])
            self.overlap_log.append(("launch", self._launch_order[self._next]))
            self._next += 1

    def _flat_grads(self, b: _Bucket) -> torch.Tensor:
        """The bucket's ``[rank0 | pad | rank1 | pad | ...]`` fp32 buffer of the model gradients."""
        flat = torch.zeros(_size(self.groups[b.group_id]) * b.seg_len, dtype=torch.float32, device=self.device)
        for sl in b.slots:
            grad = self.specs[sl.index].param.grad
            if grad is not None:
                start = sl.owner * b.seg_len + sl.offset
                flat[start:start + sl.numel].copy_(grad.reshape(-1))
        return flat

    def _launch(self, k: int) -> None:
        b = self.buckets[k]
        flat = self._flat_grads(b)
        shard = torch.empty(b.seg_len, dtype=torch.float32, device=self.device)
        self._inflight[k] = (self._reduce_scatter_async(shard, flat, self.groups[b.group_id]), shard, flat)

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum model gradients over each group into the owners' main copies; release model ``.grad``.

        A param gets a main gradient iff some rank of its group produced one (single-process
        semantics: Muon/AdamW skip params whose grad is None, weight decay included). After an armed
        backward (:meth:`start_grad_overlap`) the buckets not yet issued are issued first (in the
        fixed order), then every handle is waited for.
        """
        self.finish_param_gather()  # buckets whose params no forward used are still in flight
        armed, self._armed = self._armed, False
        if armed:
            for k in self._launch_order[self._next:]:
                self._launch(k)
            self._next = len(self._launch_order)
        has = [s.param.grad is not None for s in self.specs]
        for gid, g in enumerate(self.groups):
            if _size(g) > 1:
                part = torch.tensor([float(has[i]) for i in self.members[gid]], device=self.device)
                dist.all_reduce(part, group=g)
                for i, v in zip(self.members[gid], part.tolist()):
                    has[i] = v > 0
        self._has_grad = has
        for k, b in enumerate(self.buckets):
            g = self.groups[b.group_id]
            world, me = _size(g), _rank(g)
            if world == 1:
                for sl in b.slots:
                    grad = self.specs[sl.index].param.grad
                    self.main[sl.index].grad = None if grad is None else grad.float()
                continue
            if armed:
                work, shard, _flat = self._inflight.pop(k)
                work.wait()
            else:
                flat = self._flat_grads(b)
                shard = torch.empty(b.seg_len, dtype=torch.float32, device=self.device)
                self._reduce_scatter(shard, flat, g)
            for sl in b.slots:
                if sl.owner == me:
                    m = self.main[sl.index]
                    m.grad = shard[sl.offset:sl.offset + sl.numel].view(m.shape) if has[sl.index] else None
        for s in self.specs:
            s.param.grad = None
        self._reduced = True

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients to global L2 norm <= ``max_norm``; returns the global (pre-clip) norm.

        Owners compute each owned param's gradient norm; one all-reduce per group of a vector with
        exactly one nonzero contributor per entry (so the sum is exact) gives every rank all
        per-param norms, and the total is torch's ``vector_norm(stack(norms))`` in parameter order:
        the same number ``torch.nn.utils.clip_grad_norm_`` computes single-process from the same
        gradients. The scale ``min(1, max_norm / (norm + 1e-6))`` is torch's too. Under TP
        (:meth:`set_tensor_parallel`) a sharded param's norm is the root of its shards' squared
        norms summed over the TP group, so the total is the single-process norm of the full model.
        """
        if not self._reduced:
            raise RuntimeError("ShardedOptimizer.clip_grad_norm_ before reduce_gradients(): the owned "
                               "gradients are not summed yet")
        norms = torch.zeros(len(self.specs), dtype=torch.float32, device=self.device)
        has = torch.zeros(len(self.specs), dtype=torch.float32, device=self.device)
        for i, m in self.main.items():
            if m.grad is not None:
                norms[i] = torch.linalg.vector_norm(m.grad)
                has[i] = 1.0
        for gid, g in enumerate(self.groups):
            if _size(g) > 1:
                idx = torch.tensor(self.members[gid], device=self.device)
                part = torch.stack([norms[idx], has[idx]])
                dist.all_reduce(part, group=g)
                norms[idx], has[idx] = part[0], part[1]
        if any(self.tp_sharded):  # TP shards: sum squared norms over the TP group
            idx = torch.tensor([i for i, t in enumerate(self.tp_sharded) if t], device=self.device)
            part = torch.stack([norms[idx].square(), has[idx]])
            dist.all_reduce(part, group=self.tp_group)
            norms[idx], has[idx] = part[0].sqrt(), part[1]
        if self.norm_partitions:  # ranks of these groups hold different params: sum squares over them
            if self._expert_mask is None:  # constant: built once, no per-step host-to-device copy
                self._expert_mask = torch.tensor([EXPERT_NAME_PART in s.name for s in self.specs],
                                                 device=self.device)
            expert = self._expert_mask
            sq = norms.square() * (has > 0)
            # torch.where, not boolean-mask indexing: the mask's result size would be read on the host
            dense_sq = torch.where(expert, 0.0, sq).sum().reshape(1)
            expert_sq = torch.where(expert, sq, 0.0).sum().reshape(1)
            for g, experts_only in self.norm_partitions:
                if experts_only:
                    dist.all_reduce(expert_sq, group=g)
                else:
                    both = torch.cat([dense_sq, expert_sq])
                    dist.all_reduce(both, group=g)
                    dense_sq, expert_sq = both[:1].clone(), both[1:].clone()
            total = (dense_sq + expert_sq).sqrt().reshape(())
        else:
            # which params have a gradient is host knowledge (reduce_gradients): no mask, no sync
            idx = [i for i, h in enumerate(self._has_grad) if h]
            total = (torch.linalg.vector_norm(norms[torch.tensor(idx, device=self.device)]) if idx
                     else norms.new_zeros(()))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for m in self.main.values():
            if m.grad is not None:
                m.grad.mul_(coef)
        return total

    @torch.no_grad()
    def step(self) -> None:
        """Muon/AdamW on this rank's main copies, then all-gather every bucket back into the model.

        With ``overlap_param_gather`` the all-gathers are only issued (``async_op``, on
        ``gather_groups``, the bucket of the earliest params in model order first) and this returns
        with them in flight: the forward pre-hooks wait for each before its params' first use, and
        :meth:`finish_param_gather` waits for the rest."""
        if not self._reduced:
            raise RuntimeError("ShardedOptimizer.step before reduce_gradients(): call it after backward")
        self.finish_param_gather()
        for o in self.optimizers:
            o.step()
        if self.overlap_param_gather:
            self.gather_log = []
            for k in self._gather_order:
                b = self.buckets[k]
                every, mine = self._gather_buffers(b)
                work = self._all_gather_async(every, mine, self.gather_groups[b.group_id])
                self._gather_pending[k] = (work, every, mine)  # the buffers live until the wait
                self.gather_log.append(("issue", k))
        for b in self.buckets:
            g = self.groups[b.group_id]
            if _size(g) == 1:
                for sl in b.slots:
                    p, m = self.specs[sl.index].param, self.main[sl.index]
                    if m.data_ptr() != p.data_ptr():
                        p.copy_(m)
            elif not self.overlap_param_gather:
                every, mine = self._gather_buffers(b)
                self._all_gather(every, mine, g)
                self._copy_gathered(b, every)
        self._reduced = False

    def _gather_buffers(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """(receive buffer of ``world`` segments, this rank's segment holding its updated params)."""
        g = self.groups[b.group_id]
        world, me = _size(g), _rank(g)
        mine = torch.zeros(b.seg_len, dtype=b.dtype, device=self.device)
        for sl in b.slots:
            if sl.owner == me:
                mine[sl.offset:sl.offset + sl.numel].copy_(self.main[sl.index].reshape(-1))
        return torch.empty(world * b.seg_len, dtype=b.dtype, device=self.device), mine

    def _copy_gathered(self, b: _Bucket, every: torch.Tensor) -> None:
        me = _rank(self.groups[b.group_id])
        for sl in b.slots:
            p = self.specs[sl.index].param
            if sl.owner == me and self.main[sl.index].data_ptr() == p.data_ptr():
                continue  # updated in place already
            start = sl.owner * b.seg_len + sl.offset
            p.copy_(every[start:start + sl.numel].view(p.shape))

    # ---------------------------------------------------------------- all-gather behind the forward
    def _make_gather_hook(self, ks: list[int]):
        def hook(_module, _args):
            if self._gather_pending:
                self._wait_gathers(ks, "forward")
        return hook

    @torch.no_grad()
    def _wait_gathers(self, ks, where: str) -> None:
        for k in ks:
            if k in self._gather_pending:
                work, every, _mine = self._gather_pending.pop(k)
                work.wait()  # the gather group's timeout bounds it
                self._copy_gathered(self.buckets[k], every)
                self.gather_log.append((where, k))

    def finish_param_gather(self) -> None:
        """Wait for every all-gather :meth:`step` left in flight (``overlap_param_gather``) and copy
        it into the params, in issue order; a no-op when none is. Anything that reads or writes
        parameter values outside a forward must call it first. This class calls it itself in
        :meth:`reduce_gradients`, :meth:`step`, :meth:`state_dict`, :meth:`load_state_dict`,
        :meth:`export_state` (so in :func:`consolidate_optimizer_state`) and
        :func:`load_consolidated_state`, and hooks it to ``state_dict`` / ``load_state_dict`` of
        every module of the model (checkpoint saves and loads, :func:`consolidate_model_state`,
        ``load_full_state``). Not in :meth:`zero_grad`: it touches gradients only, and comes right
        after :meth:`step`."""
        if self._gather_pending:
            self._wait_gathers(list(self._gather_pending), "finish")

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

    # ---------------------------------------------------------------- checkpointing
    def ownership(self) -> dict:
        """``{name: [owner rank, group size, shape]}`` for every trainable param (same on all ranks of a group)."""
        return {s.name: [self.owner[i], _size(self.groups[self.group_of[i]]), list(s.param.shape)]
                for i, s in enumerate(self.specs)}

    def state_dict(self) -> dict:
        """This rank's shard: local Muon/AdamW state, fp32 main copies that are not the model's own
        tensors (bf16 models), and the ownership map a loader checks."""
        self.finish_param_gather()
        return {
            "format": STATE_FORMAT,
            "rank": [_rank(g) for g in self.groups],
            "ownership": self.ownership(),
            "muon": None if self.muon is None else self.muon.state_dict(),
            "adamw": None if self.adamw is None else self.adamw.state_dict(),
            "main_params": {self.specs[i].name: m.clone() for i, m in self.main.items()
                            if m.data_ptr() != self.specs[i].param.data_ptr()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Load a shard saved by the same rank of the same layout; ``ValueError`` names the mismatch."""
        self.finish_param_gather()  # a gather landing later would overwrite what is loaded
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"optimizer state format {state.get('format')!r} is not {STATE_FORMAT!r}")
        mine, theirs = self.ownership(), state["ownership"]
        if mine != theirs:
            diff = sorted(set(mine) ^ set(theirs)) or [n for n in mine if mine[n] != theirs[n]]
            raise ValueError(f"optimizer shard does not match this layout (first difference: {diff[0]!r}: "
                             f"saved {theirs.get(diff[0])}, now {mine.get(diff[0])} as [owner, dp, shape]); "
                             f"resume with the same model and data-parallel size")
        ranks = [_rank(g) for g in self.groups]
        if state["rank"] != ranks:
            raise ValueError(f"optimizer shard was saved by rank(s) {state['rank']}, loading on {ranks}")
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if (opt is None) != (state[key] is None):
                raise ValueError(f"optimizer shard and this rank disagree on whether a {key} part exists")
            if opt is not None:
                opt.load_state_dict(state[key])
        name_to = {self.specs[i].name: i for i in self.main}
        with torch.no_grad():
            for name, t in state["main_params"].items():
                self.main[name_to[name]].copy_(t)

    def export_state(self, canonical: bool = True) -> dict:
        """Layout-free optimizer state of the params THIS rank owns (TP shards as held here)::

            {"format": CANONICAL_FORMAT,
             "state": {name: {key: tensor}},      # Muon momentum_buffer; AdamW exp_avg, exp_avg_sq, step
             "optimizer": {name: "muon" | "adamw"},
             "hyperparameters": {name: {key: value}}}  # the param's group values (lr, weight_decay, ...)

        ``name`` is the canonical (single-process) name, or the model's own name if not
        ``canonical``. A param that was never stepped has ``{}`` state (before the first step:
        every param). Tensors are copies.
        """
        self.finish_param_gather()
        out = {"format": CANONICAL_FORMAT, "state": {}, "optimizer": {}, "hyperparameters": {}}
        groups = {id(p): (o, g) for o in self.optimizers for g in o.param_groups for p in g["params"]}
        for i in sorted(self.main):
            s, m = self.specs[i], self.main[i]
            opt, group = groups[id(m)]
            name = canonical_name(s.name) if canonical else s.name
            out["state"][name] = {k: v.detach().clone() if torch.is_tensor(v) else v
                                  for k, v in opt.state.get(m, {}).items()}
            out["optimizer"][name] = s.optimizer
            out["hyperparameters"][name] = {k: v for k, v in group.items() if k not in ("params", "heads")}
        return out

    # ---------------------------------------------------------------- accounting
    def memory_report(self) -> dict:
        """Bytes this rank holds for the optimizer, measured and analytic.

        ``main_param_bytes`` = 4·owned numel (fp32 main weights; for an fp32 model they are the
        model's own tensors). ``optimizer_state_bytes`` is measured from the local optimizers'
        state (0 before the first step); ``optimizer_state_host_bytes`` is the part of it held in
        host memory while the params are on an accelerator (``optim.offload=cpu``). Analytic per element: Muon 4 B (momentum), AdamW 8 B
        (exp_avg, exp_avg_sq); ``expected_*`` is the whole model's total / dp, and
        ``owned_expected_state_bytes`` the analytic value for this rank's own params.
        ``numel_per_rank`` / ``imbalance`` (max / mean) cover the params on ``dp_group``;
        ``comm_padding`` is the fraction of reduce-scatter / all-gather elements that are padding.
        """
        def state_per_elem(i: int) -> int:
            return 4 if self.specs[i].optimizer == "muon" else 8

        world = _size(self.dp_group)
        numel_per_rank: dict[int, int] = {}
        for i, s in enumerate(self.specs):
            if self.groups[self.group_of[i]] is self.dp_group:
                numel_per_rank[self.owner[i]] = numel_per_rank.get(self.owner[i], 0) + s.param.numel()
        per_rank = [numel_per_rank.get(r, 0) for r in range(world)]
        owned = list(self.main)
        state = [t for o in self.optimizers for st in o.state.values() for t in st.values() if torch.is_tensor(t)]
        measured = sum(t.numel() * t.element_size() for t in state)
        # optim.offload=cpu keeps the AdamW state in host memory while the params are on a GPU
        on_host = sum(t.numel() * t.element_size() for t in state
                      if t.device.type == "cpu" and self.device.type != "cpu")
        total_numel = sum(s.param.numel() for s in self.specs)
        total_state = sum(state_per_elem(i) * s.param.numel() for i, s in enumerate(self.specs))
        payload = sum(sl.numel for b in self.buckets for sl in b.slots)
        padded = sum(_size(self.groups[b.group_id]) * b.seg_len for b in self.buckets)
        return {
            "dp_size": world,
            "owned_params": len(owned),
            "owned_numel": sum(self.specs[i].param.numel() for i in owned),
            "total_numel": total_numel,
            "numel_per_rank": per_rank,
            "imbalance": max(per_rank) / max(1.0, sum(per_rank) / world),
            "main_param_bytes": 4 * sum(self.specs[i].param.numel() for i in owned),
            "optimizer_state_bytes": measured,
            "optimizer_state_host_bytes": on_host,
            "owned_expected_state_bytes": sum(state_per_elem(i) * self.specs[i].param.numel() for i in owned),
            "expected_main_param_bytes": 4 * total_numel / world,
            "expected_state_bytes": total_state / world,
            "buckets": len(self.buckets),
            "comm_padding": 1.0 - payload / max(1, padded),
        }


# -------------------------------------------------------------------- layout-free checkpoints
def consolidate_model_state(model: nn.Module, plan: TPPlan | None, tp_group: ProcessGroup) -> dict:
    """Full, canonical-named model state (params and buffers) on every rank of ``tp_group``: TP
    shards are all-gathered and concatenated along their ``plan.shard_dim``. Collective over the
    TP group. Load it into any layout with :func:`parallel.parallelize.load_full_state`."""
    tp = _size(tp_group)
    out = {}
    for key, t in model.state_dict().items():
        name = canonical_name(key)
        dim = None if plan is None else plan.shard_dim.get(name)
        if dim is None or tp == 1:
            out[name] = t.detach().clone()
            continue
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=tp_group)
        out[name] = torch.cat(parts, dim=dim)
    return out


def consolidate_optimizer_state(sharded_opt: ShardedOptimizer, plan: TPPlan | None, tp_group: ProcessGroup,
                                dp_group: ProcessGroup) -> dict | None:
    """The FULL optimizer state of every canonical param on global rank 0 (None elsewhere).

    Every rank of the default group calls it. Each sends its :meth:`~ShardedOptimizer.export_state`
    on CPU (one ``gather_object``, pickled: simple, and rank 0 holds the full state anyway); rank 0
    merges the DP owners' entries and concatenates each TP-sharded param's state along its shard
    dim (scalars such as AdamW's ``step`` must agree across the shards). The result equals what a single-process
    ``ShardedOptimizer(model, cfg, dp_group=None).export_state()`` gives after the same training.
    Without an initialised default group this is just ``export_state()``.
    """
    if dp_group is not sharded_opt.dp_group:
        raise ValueError("consolidate_optimizer_state: dp_group is not the group this ShardedOptimizer "
                         "was built over")
    tp = _size(tp_group)
    if plan is not None and plan.tp_size != tp:
        raise ValueError(f"consolidate_optimizer_state: plan.tp_size={plan.tp_size} but tp_group has {tp} ranks")
    exp = sharded_opt.export_state(canonical=True)
    exp["state"] = {n: {k: v.cpu() if torch.is_tensor(v) else v for k, v in st.items()}
                    for n, st in exp["state"].items()}  # device-free pickles (nccl) and result
    mine = (_rank(tp_group), exp)
    if dist.is_initialized() and dist.get_world_size() > 1:
        pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, pieces, dst=0)
        if dist.get_rank() != 0:
            return None
    else:
        pieces = [mine]
    return merge_optimizer_exports(pieces, {} if plan is None else plan.shard_dim, tp)


def merge_optimizer_exports(pieces: list, shard_dim: dict, tp: int) -> dict:
    """Merge ``(tp_rank, export_state())`` pieces of every rank into the full canonical state:
    DP owners' entries united, TP shards concatenated along ``shard_dim``. Used on gathered pieces
    (:func:`consolidate_optimizer_state`) and on the per-rank parts of a checkpoint."""
    by_name: dict[str, dict[int, tuple]] = {}
    for tp_rank, exp in pieces:
        for name, st in exp["state"].items():
            entry = by_name.setdefault(name, {})
            if tp_rank in entry:
                raise ValueError(f"consolidate_optimizer_state: {name!r} is owned by two ranks of TP rank "
                                 f"{tp_rank}; the ranks' ownership disagrees")
            entry[tp_rank] = (st, exp["optimizer"][name], exp["hyperparameters"][name])
    out = {"format": CANONICAL_FORMAT, "state": {}, "optimizer": {}, "hyperparameters": {}}
    order = list(shard_dim) + sorted(set(by_name) - set(shard_dim))
    for name in (n for n in order if n in by_name):
        entry = by_name[name]
        if sorted(entry) != list(range(tp)):
            raise ValueError(f"consolidate_optimizer_state: {name!r} has state from TP ranks {sorted(entry)}, "
                             f"expected all of 0..{tp - 1}")
        states = [entry[r][0] for r in range(tp)]
        dim = shard_dim.get(name)
        if dim is None or tp == 1:
            full = states[0]
        else:
            if any(st.keys() != states[0].keys() for st in states):
                raise ValueError(f"consolidate_optimizer_state: the TP shards of {name!r} hold different "
                                 f"state keys {[sorted(st) for st in states]} (stepped on some ranks only?)")
            full = {}
            for k, v in states[0].items():
                if torch.is_tensor(v) and v.ndim > 0:
                    full[k] = torch.cat([st[k] for st in states], dim=dim)
                elif all(torch.equal(torch.as_tensor(st[k]), torch.as_tensor(v)) for st in states):
                    full[k] = v
                else:
                    raise ValueError(f"consolidate_optimizer_state: {name!r} state {k!r} differs across "
                                     f"TP shards: {[st[k] for st in states]}")
        out["state"][name] = full
        out["optimizer"][name] = entry[0][1]
        out["hyperparameters"][name] = entry[0][2]
    return out


@torch.no_grad()
def load_consolidated_state(sharded_opt: ShardedOptimizer, full_state: dict, plan: TPPlan | None) -> None:
    """Load a consolidated (full, canonical) optimizer state into ``sharded_opt`` on any layout.

    For every param this rank owns, its full state tensors are sliced to this rank's TP shard
    (``plan.shard_dim``, chunk ``plan.tp_rank``) and become the local Muon/AdamW state of the
    owner's main copy; ``{}`` clears it (never stepped). Group hyperparameters are restored from the
    saved ones (``torch.optim.Optimizer.load_state_dict`` semantics). Needs no collective. Raises
    ``ValueError`` if the state is for another model (missing/extra names, another optimizer, shapes).
    """
    sharded_opt.finish_param_gather()
    if not isinstance(full_state, dict) or full_state.get("format") != CANONICAL_FORMAT:
        got = full_state.get("format") if isinstance(full_state, dict) else type(full_state).__name__
        raise ValueError(f"load_consolidated_state: state format {got!r} is not {CANONICAL_FORMAT!r} "
                         f"(use consolidate_optimizer_state / export_state output)")
    tp, tp_rank = (1, 0) if plan is None else (plan.tp_size, plan.tp_rank)
    names = [canonical_name(s.name) for s in sharded_opt.specs]
    saved = full_state["state"]
    if set(names) != set(saved):
        missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        raise ValueError(f"load_consolidated_state: the state is for another model: {len(missing)} params "
                         f"missing (e.g. {missing[:3]}), {len(extra)} unknown (e.g. {extra[:3]})")
    groups = {id(p): (o, g) for o in sharded_opt.optimizers for g in o.param_groups for p in g["params"]}
    new_hyper: dict[int, tuple[str, dict]] = {}
    for i, m in sharded_opt.main.items():
        s, name = sharded_opt.specs[i], names[i]
        if full_state["optimizer"][name] != s.optimizer:
            raise ValueError(f"load_consolidated_state: {name!r} was optimised by "
                             f"{full_state['optimizer'][name]}, here by {s.optimizer}")
        dim = None if plan is None else plan.shard_dim.get(name)
        local = {}
        for k, v in saved[name].items():
            if torch.is_tensor(v) and v.ndim > 0:
                if dim is not None and tp > 1:
                    if v.ndim <= dim or v.shape[dim] % tp:
                        raise ValueError(f"load_consolidated_state: {name!r} state {k!r} of shape "
                                         f"{tuple(v.shape)} cannot be split into {tp} shards along dim {dim}")
                    v = v.chunk(tp, dim=dim)[tp_rank]
                if v.shape != m.shape:
                    raise ValueError(f"load_consolidated_state: {name!r} state {k!r} has shape {tuple(v.shape)} "
                                     f"for this rank's shard, the param is {tuple(m.shape)}; the state was "
                                     f"saved from another model config (or is not consolidated)")
                v = v.to(device=m.device, dtype=m.dtype).clone()
            elif torch.is_tensor(v):
                v = v.clone()
            local[k] = v
        opt, group = groups[id(m)]
        if local:
            opt.state[m] = local
        else:
            opt.state.pop(m, None)
        hp = full_state["hyperparameters"][name]
        prev = new_hyper.setdefault(id(group), (name, hp))
        if prev[1] != hp:
            raise ValueError(f"load_consolidated_state: {prev[0]!r} and {name!r} share a param group here "
                             f"but were saved with different hyperparameters ({prev[1]} vs {hp})")
    for o in sharded_opt.optimizers:
        for g in o.param_groups:
            if id(g) in new_hyper:
                g.update(new_hyper[id(g)][1])


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
