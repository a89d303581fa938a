"""Autograd-aware tensor- and sequence-parallel collectives: the only home of these in the project.

Every mapping takes its process group explicitly. ``group=None`` or a group of size 1 means "not
parallel": the mapping returns its input unchanged and issues no collective (PARALLEL.md: a
degree-1 axis costs nothing).

Forward / backward of each mapping (tp = group size, r = this rank's index in the group):

    mapping                 forward                          backward
    copy_to_tp              identity                         all-reduce (sum)
    reduce_from_tp          all-reduce (sum)                 identity
    scatter_to_tp           keep chunk r along dim           all-gather along dim
    gather_from_tp          all-gather along dim             keep chunk r along dim
    scatter_to_sp           keep token chunk r               all-gather tokens
    gather_from_sp          all-gather tokens                reduce-scatter tokens
    reduce_scatter_to_sp    reduce-scatter tokens            all-gather tokens

Chunks are contiguous: rank r holds ``x.chunk(tp, dim)[r]``. The ``*_tp`` pair defaults to the
feature axis (dim=-1), the ``*_sp`` family to the token axis of ``[B, T, D]`` (dim=1).

Why ``gather_from_sp`` reduces in backward: it feeds a column-parallel layer, whose input gradient
on each rank is only the part flowing through that rank's output columns; the true gradient is the
sum over ranks, and each rank keeps its own token chunk -- one reduce-scatter.

Backend notes (torch 2.13): gloo implements ``all_gather_single`` and ``reduce_scatter_single``
(the new names of ``all_gather_into_tensor`` / ``reduce_scatter_tensor``), and so does the threaded
test process group, so no all-reduce-and-chunk emulation is needed. Both collectives work on the
leading axis, so a gather along ``dim`` moves ``dim`` to the front, gathers, and moves it back
(concatenation along dim 0 of the moved tensors is concatenation along ``dim`` of the originals).

Replicated parameters with partial gradients (e.g. norm weights under SP):
each TP rank sees only its token chunk, so after backward call :func:`sync_replicated_grads` on
them (one flat all-reduce per dtype).

Counting: :class:`CollectiveCounter` records every collective issued on the current thread, so a
test can assert e.g. "a row-parallel forward issues exactly one all-reduce". CPU autograd runs the
backward on the thread that called ``.backward()``, so backward collectives are counted too.
"""
from __future__ import annotations

import threading
from collections import Counter
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


# --------------------------------------------------------------------------- group helpers
def group_size(group: Group) -> int:
    """Number of ranks in ``group``; 1 for ``None`` (no parallelism)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's index inside ``group`` (not its global rank); 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


# --------------------------------------------------------------------------- counting
_active = threading.local()  # per thread: threaded-PG tests run one rank per thread


class CollectiveCounter:
    """Context manager recording ``(kind, group_size)`` of each collective issued on this thread.

    kinds: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``. Nested counters all record.

        with CollectiveCounter() as cc:
            y = row(x)
        assert cc.counts() == {"all_reduce": 1}
    """

    def __init__(self) -> None:
        self.events: List[Tuple[str, int]] = []

    def __enter__(self) -> "CollectiveCounter":
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _active.stack.remove(self)

    def counts(self) -> dict:
        """{kind: number of calls}; kinds never issued are absent."""
        return dict(Counter(kind for kind, _ in self.events))

    def clear(self) -> None:
        self.events.clear()


def _record(kind: str, group: dist.ProcessGroup) -> None:
    for counter in getattr(_active, "stack", ()):
        counter.events.append((kind, dist.get_world_size(group)))


# --------------------------------------------------------------------------- raw collectives
# Callers have already returned early on size-1 groups. None of these mutates its argument:
# autograd may hand the same grad tensor to several functions (e.g. both inputs of an add),
# so reducing a grad in place would corrupt a sibling branch.

def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    _record("all_reduce", group)
    dist.all_reduce(out, op=op, group=group)
    return out


def _chunk_of(x: torch.Tensor, group: dist.ProcessGroup, dim: int, what: str) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim`` (no communication)."""
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} of a {tuple(x.shape)} tensor "
                         f"into {size} {what} shards (group size {size}, rank {dist.get_rank(group)})")
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (all shards have the same shape)."""
    size = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((size * x0.shape[0],) + tuple(x0.shape[1:]))
    _record("all_gather", group)
    dist.all_gather_single(out, x0, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int, what: str) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk along ``dim``."""
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} of a {tuple(x.shape)} "
                         f"tensor into {size} {what} shards (rank {dist.get_rank(group)})")
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // size,) + tuple(x0.shape[1:]))
    _record("reduce_scatter", group)
    dist.reduce_scatter_single(out, x0, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim).contiguous()


def all_reduce_max(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Element-wise max over the group (not differentiable; used for stable softmax)."""
    return x if group_size(group) == 1 else _all_reduce(x, group, op=dist.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Element-wise sum over the group, outside autograd (statistics, custom backwards)."""
    return x if group_size(group) == 1 else _all_reduce(x, group)


# --------------------------------------------------------------------------- autograd mappings
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)  # a new tensor object so autograd records this node

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    """fwd: keep chunk; bwd: all-gather. Used for both the feature (tp) and token (sp) axes."""

    @staticmethod
    def forward(ctx, x, group, dim, what):
        ctx.group, ctx.dim = group, dim
        return _chunk_of(x, group, dim, what)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, ctx.dim), None, None, None


class _GatherFromTP(torch.autograd.Function):
    """fwd: all-gather; bwd: keep chunk (the consumer of the gathered tensor is replicated)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _chunk_of(g, ctx.group, ctx.dim, "gradient"), None, None


class _GatherFromSP(torch.autograd.Function):
    """fwd: all-gather tokens; bwd: reduce-scatter (the consumer is column-parallel, grads partial)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.group, ctx.dim, "sequence-parallel gradient"), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """fwd: reduce-scatter tokens (row-parallel output); bwd: all-gather."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim, "sequence-parallel")

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a TP region with a replicated input. fwd identity; bwd all-reduce of the grad."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP region: sum partial outputs. fwd all-reduce; bwd identity."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """[.., D, ..] replicated -> [.., D/tp, ..] chunk r along ``dim``; bwd all-gather."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group, dim, "tensor-parallel")


def gather_from_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """[.., D/tp, ..] chunk -> [.., D, ..] concatenated along ``dim``; bwd keep chunk r."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group, dim)


def scatter_to_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """[B, T, D] replicated -> [B, T/tp, D] token chunk r; bwd all-gather tokens."""
    return x if group_size(group) == 1 else _ScatterToTP.apply(x, group, dim, "sequence-parallel")


def gather_from_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """[B, T/tp, D] -> [B, T, D] (input of a column-parallel layer); bwd reduce-scatter tokens."""
    return x if group_size(group) == 1 else _GatherFromSP.apply(x, group, dim)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """[B, T, D] partial sums -> [B, T/tp, D] summed token chunk r (row-parallel output); bwd all-gather."""
    return x if group_size(group) == 1 else _ReduceScatterToSP.apply(x, group, dim)


# --------------------------------------------------------------------------- replicated grads
def sync_replicated_grads(params: Iterable[torch.nn.Parameter], group: Group) -> None:
    """Sum over ``group`` the ``.grad`` of parameters every TP rank holds whole but applies to
    only part of the tokens (e.g. norm weights under sequence parallelism).

    Call after backward, before the optimizer / data-parallel reduction. Parameters without a
    grad are skipped (every rank must skip the same ones). One flat all-reduce per dtype.
    """
    if group_size(group) == 1:
        return
    by_dtype: dict = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype in sorted(by_dtype, key=str):  # same order on every rank
        grads = by_dtype[dtype]
        flat = _all_reduce(torch.cat([g.reshape(-1) for g in grads]), group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
