"""Gradient reduction of the ZeRO-1 optimizer: bucketed reduce-scatter (blocking or overlapped with
the backward) into the owners' fp32 main gradients, and the global gradient-norm clip.

Which params have a gradient (:meth:`GradReduction._agreed_presence`): decided without a host sync.
Every rank of a group runs the same model under the same plan, so a param's gradient exists on all
of them or on none, and this rank's ``grad is not None`` is the answer (checked once, at the first
step). The model's batch-dependent params (``batch_dependent_parameters()``: the vision tower) are
always reduced and masked on the device instead: an owned one that no rank had a gradient for keeps
its value and optimizer state through the step (tests/test_data_parallel.py).

Overlapped reduce-scatter (``overlap_grad_reduce=True``, issue 19 item 4)
    Each param gets a post-accumulate-grad hook. :meth:`GradReduction.start_grad_overlap`, called
    before the backward of the LAST micro-batch of a step, arms them: a bucket's reduce-scatter is
    issued (``async_op=True``) as soon as every param of the bucket has its final gradient, while the
    rest of the backward runs. Buckets are issued in one fixed order on every rank (the collectives
    of a group must match): by descending position of their earliest parameter in
    ``model.parameters()``, i.e. roughly the order backward completes them; a bucket that is ready
    before its predecessors waits for them. :meth:`GradReduction.reduce_gradients` then issues what
    is left (params that got no gradient on this rank) and waits for all handles. Same flat layout, same buffers, same collective: the result is bitwise that of
    the non-overlapped form (tests/test_overlap.py). A gradient accumulated into a param whose bucket
    was already issued raises (it would be lost). Callers that modify gradients between backward and
    ``reduce_gradients`` (TP partial-gradient sums) or interleave other collectives on the same
    group must not arm it (``RankStep`` arms it only without tp/pp/ep/cp).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import _rank, _size
from .layout import EXPERT_NAME_PART, _Bucket


class GradReduction:
    """Gradient half of :class:`parallel.data_parallel.ShardedOptimizer` (a mixin: it reads the
    specs, groups, buckets and main copies that ``ShardedOptimizer.__init__`` sets)."""

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

    # ---------------------------------------------------------------- which params have a gradient
    def _agreed_presence(self) -> list[bool]:
        """Per spec: does the param get a main gradient this step. Host knowledge, no host sync.

        Static rule: whether a param gets a gradient is decided by the model's structure and the
        layout, the same on every rank of its group (same model, same plan, same code path), except
        for the params the model declares batch-dependent (``model.batch_dependent_parameters()``,
        e.g. the vision tower: only micro-batches with images run it). So this rank's own
        ``grad is not None`` is the group's answer for every other param. A batch-dependent param of
        a multi-rank group is always reduced (zeros from ranks without a gradient) and always gets a
        main gradient; whether ANY rank had one stays on the device (``_present``: one all-reduce of
        0/1 flags, never read on the host), and :meth:`_hold_absent` / :meth:`_restore_absent` undo
        the optimizer step of an owned one that no rank had a gradient for (param and state
        unchanged, as when its grad is None).

        The static rule is checked once, at the first call (one host read of the all-reduced
        flags, not per step): a param that has a gradient on some ranks of its group and not on
        others, and is not declared, raises there."""
        has = [s.param.grad is not None for s in self.specs]
        self._present = {}
        for gid, g in enumerate(self.groups):
            if _size(g) == 1:
                continue
            if not self._presence_checked:
                self._check_static_presence(g, self.members[gid], has)
            dep = [i for i in self.members[gid] if self.batch_dependent[i]]
            if dep:
                # filled by scalar writes on the device: no host-to-device copy, no sync
                part = torch.zeros(len(dep), dtype=torch.float32, device=self.device)
                for k, i in enumerate(dep):
                    if has[i]:
                        part[k] = 1.0
                dist.all_reduce(part, group=g)
                for k, i in enumerate(dep):
                    self._present[i] = part[k] > 0
                    has[i] = True
        self._presence_checked = True
        return has

    def _check_static_presence(self, g, members: list[int], has: list[bool]) -> None:
        """First step only: every rank of ``g`` agrees on which undeclared params have a gradient."""
        part = torch.tensor([float(has[i]) for i in members], device=self.device)
        dist.all_reduce(part, group=g)
        world = _size(g)
        odd = [self.specs[i].name for i, v in zip(members, part.tolist())
               if not self.batch_dependent[i] and v not in (0.0, float(world))]
        if odd:
            raise RuntimeError(f"ShardedOptimizer: {len(odd)} params got a gradient on some ranks of their "
                               f"data-parallel group and not on others (e.g. {odd[:3]}); a param whose use "
                               "depends on the batch must be listed by the model's batch_dependent_parameters()")

    def _hold_absent(self) -> list:
        """Before the local step: (main copy, present flag, its value, its optimizer state) of every
        owned batch-dependent param (:meth:`_agreed_presence`)."""
        held = []
        for i, present in self._present.items():
            m = self.main.get(i)
            if m is None:
                continue
            opt = next(o for o in self.optimizers if any(m is p for grp in o.param_groups for p in grp["params"]))
            state = {k: v.clone() for k, v in opt.state.get(m, {}).items() if torch.is_tensor(v)}
            held.append((m, present, m.clone(), opt, state))
        return held

    @staticmethod
    def _restore_absent(held: list) -> None:
        """After the local step: where no rank had a gradient, the param and its optimizer state are
        put back (state the step created goes back to zeros: the fresh state's values, so the next
        real step is the first one's)."""
        for m, present, value, opt, state in held:
            m.copy_(torch.where(present, m, value))
            for k, v in opt.state.get(m, {}).items():
                if torch.is_tensor(v):  # (host-resident state, optim.offload: the flag is read there)
                    keep = present if v.device == present.device else present.to(v.device)
                    v.copy_(torch.where(keep, v, state[k] if k in state else torch.zeros_like(v)))

    def _index_tensor(self, idx: tuple) -> torch.Tensor:
        """``idx`` as a device index tensor, built once per distinct tuple (no per-step host-to-device copy)."""
        cache = self.__dict__.setdefault("_index_cache", {})
        if idx not in cache:
            cache[idx] = torch.tensor(idx, dtype=torch.long, device=self.device)
        return cache[idx]

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sum model gradients over each group into the owners' main copies; release model ``.grad``.

        A param is updated iff some rank of its group produced a gradient (single-process semantics:
        Muon/AdamW skip params whose grad is None, weight decay included), decided without a host
        sync (see :meth:`_agreed_presence`). After an armed backward (:meth:`start_grad_overlap`)
        the buckets not yet issued are issued first (in the fixed order), then every handle is
        waited for.
        """
        self.finish_param_gather()  # buckets whose params no forward used are still in flight
        armed, self._armed = self._armed, False
        if armed:
            for k in self._launch_order[self._next:]:
                self._launch(k)
            self._next = len(self._launch_order)
        has = self._agreed_presence()
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
                idx = self._index_tensor(tuple(self.members[gid]))
                part = torch.stack([norms[idx], has[idx]])
                dist.all_reduce(part, group=g)
                norms[idx], has[idx] = part[0], part[1]
        if any(self.tp_sharded):  # TP shards: sum squared norms over the TP group
            idx = self._index_tensor(tuple(i for i, t in enumerate(self.tp_sharded) if t))
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
            idx = self._index_tensor(tuple(i for i, h in enumerate(self._has_grad) if h))
            total = torch.linalg.vector_norm(norms[idx]) if idx.numel() else norms.new_zeros(())
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for m in self.main.values():
            if m.grad is not None:
                m.grad.mul_(coef)
        return total
