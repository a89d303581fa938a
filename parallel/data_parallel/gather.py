"""The ZeRO-1 optimizer's step: local Muon/AdamW on the owned main copies, then the all-gather of the
updated params (blocking, or issued and waited for behind the next forward).

All-gather behind the next forward (``overlap_param_gather=True``, issue 19 item 4)
    :meth:`ParamGather.step` runs the local Muon/AdamW, ISSUES every bucket's all-gather
    (``async_op=True``; the bucket holding the earliest params in ``model.parameters()`` order
    first, the order the next forward needs them) and returns. A forward pre-hook on each "block"
    (:func:`parallel.data_parallel.layout.forward_blocks`: for a K3Model a decoder layer, the
    embedding, the head, the vision tower) waits for the buckets holding that block's params and
    copies them in before the block runs, so the gathers of later layers proceed while earlier layers
    compute; once a bucket is copied the hooks of this step do nothing more for it.
    :meth:`ParamGather.finish_param_gather` waits for whatever is left; every reader of parameter
    values outside a forward must call it, and the optimizer calls it itself wherever it can: in
    ``reduce_gradients`` (the next step; a param no forward used is still pending there), ``step``,
    ``state_dict`` / ``load_state_dict``, ``export_state``, and,
    through hooks, in ``state_dict()`` / ``load_state_dict()`` of every module of the model
    (the trainer's checkpoint save and load). Code that reads ``model.parameters()`` values directly
    after a step (tests, tools) calls it. The gathers run on dedicated communicators
    (``gather_groups``: same ranks as the dp / edp groups), because a collective issued on a gloo
    group waits for that group's pending work and the next step's token-count and
    Quantile-Balancing all-reduces use the dp group; building them makes the construction
    collective over the default group. Same layout, same buffers, same collective: bitwise the
    non-overlapped result (tests/test_overlap.py). All gathers of a step are issued before any rank
    waits for one, in one order on every rank, so no layout can deadlock on them; ``RankStep`` uses
    it under every layout (tp, pp, ep, cp included).
    How much can hide is bounded by the bucket layout: buckets pack each rank's params in LPT order
    (largest first), not by model position, so one bucket mixes layers far apart and the first
    blocks need many buckets (k3_tiny, dp2, 4 MiB buckets: the embedding needs 19% of the gathered
    bytes, the first decoder layer 30%, the middle one 81%; at dp8, 75% before the embedding).
    Not built: a position-ordered layout (packing each rank's params in model order instead pads
    14-38% with whole-parameter ownership, and hides little more).
"""
from __future__ import annotations

import torch

from .comm import _rank, _size
from .layout import _Bucket


class ParamGather:
    """Step and all-gather half of :class:`parallel.data_parallel.ShardedOptimizer` (a mixin: it
    reads the specs, groups, buckets and main copies that ``ShardedOptimizer.__init__`` sets)."""

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
        held = self._hold_absent()       # batch-dependent params no rank had a gradient for
        for o in self.optimizers:
            o.step()
        self._restore_absent(held)
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
        :meth:`export_state`, and hooks it to ``state_dict`` /
        ``load_state_dict`` of every module of the model (checkpoint saves and loads). Not in
        :meth:`zero_grad`: it touches gradients only, and comes right after :meth:`step`."""
        if self._gather_pending:
            self._wait_gathers(list(self._gather_pending), "finish")
