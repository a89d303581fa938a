"""Refit by in-memory resharding: the trainer's shard boxes -> every engine rank's boxes, no files.

Both sides describe their tensors by the boxes of :class:`parallel.plan.ParallelPlan` (canonical name ->
global shape, offsets, local shape: the same boxes the checkpoint reader uses to load any layout). The
plan is made once (:class:`ReshardPlan`, one ``all_gather_object`` of every rank's boxes) and is pure
arithmetic: each engine rank's box of a tensor is cut into pieces, the intersections with the trainer's
distinct boxes of that tensor; every piece is taken from one trainer rank that holds it: the engine rank
itself when it does (a local copy), else one of the trainer ranks holding that box (data-parallel copies
of a box take turns across the engine ranks of a replica, so the sends spread over them). Each piece
thus leaves a trainer rank once for every engine rank that holds it: once per replica for a sharded
tensor, once per holding engine rank for one the engine replicates within a replica. With the engines on
ranks of their own (placement.py) no rank holds both, and every byte an engine rank holds arrives by message.

A refit (:meth:`ReshardPlan.run`) sends one flat buffer per (trainer rank, engine rank) pair whose
pieces it planned (point-to-point, fixed sizes known to both ends from the plan, cast to the engine's
dtype before sending), then copies each piece into its box of the engine's tensor. Under QAT the engine
model carries the same fake-quant hooks as the trainer's (megak3.quant.apply_quantization), so receiving
the master weights gives the engine the MXFP4 weights the trainer's forward runs.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from parallel.plan import canonical_name

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, shape) in the global tensor


def boxes_of(model: torch.nn.Module, plan) -> Dict[str, tuple]:
    """canonical name -> (global shape, offsets, local shape, dtype name) of every tensor ``model`` holds
    (``plan``: its ParallelPlan; None: a one-process model, whole tensors)."""
    out = {}
    for k, v in model.state_dict().items():
        name = canonical_name(k)
        sh = plan.tensors.get(name) if plan is not None else None
        if sh is None:
            out[name] = (tuple(v.shape), (0,) * v.dim(), tuple(v.shape), str(v.dtype))
        else:
            out[name] = (tuple(sh.global_shape), tuple(sh.offsets), tuple(sh.local_shape), str(v.dtype))
    return out


def _intersect(a: Box, b: Box) -> Optional[Box]:
    off = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    end = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1]))
    if any(e <= o for o, e in zip(off, end)) and off:
        return None
    return off, tuple(e - o for o, e in zip(off, end))


def _local(box: Box, origin: Tuple[int, ...]) -> tuple:
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(box[0], box[1], origin))


def plan_pieces(src: List[Optional[dict]], dst: List[Optional[dict]], replica_of: List[Optional[int]]) -> dict:
    """The pure plan: {(src rank, dst rank): [(name, box), ...]} in one order both ends compute alike.
    ``src[r]`` / ``dst[r]``: rank r's :func:`boxes_of` as trainer / engine (None: it holds none);
    ``replica_of[r]``: rank r's engine replica (None: no engine)."""
    pairs: Dict[tuple, list] = {}
    for d, want in enumerate(dst):
        if not want:
            continue
        for name in sorted(want):
            gshape, doff, dshape, _ = want[name]
            owners: Dict[Box, List[int]] = {}
            for s, have in enumerate(src):
                if have and name in have:
                    g, off, shp, _ = have[name]
                    if tuple(g) != tuple(gshape):
                        raise ValueError(f"refit: {name} is {tuple(g)} in the trainer but {tuple(gshape)} in the engine")
                    owners.setdefault((tuple(off), tuple(shp)), []).append(s)
            need = (tuple(doff), tuple(dshape))
            got = 0
            for box, ranks in sorted(owners.items()):
                piece = _intersect(need, box)
                if piece is None:
                    continue
                if d in ranks:
                    s = d
                else:  # data-parallel copies of the box take turns over the engine ranks
                    s = ranks[(d + (replica_of[d] or 0)) % len(ranks)]
                pairs.setdefault((s, d), []).append((name, piece))
                got += _numel(piece[1])
            if got != _numel(dshape):
                raise ValueError(f"refit: the trainer's boxes of {name} cover {got} of the {_numel(dshape)} "
                                 f"elements engine rank {d} holds")
    return pairs


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class ReshardPlan:
    """Planned once per (trainer layout, engine layout); :meth:`run` moves the weights (module docstring).
    Every rank of the world constructs it (one object collective) and calls :meth:`run` together.

    trainer, trainer_plan: this rank's trainer model and its ParallelPlan (plan None: one process), or
    (None, None) on a rank without a trainer (an engine rank of the separate placement).
    engine, engine_plan: this rank's engine model and plan, or (None, None) on a rank without an engine.
    replica: this rank's engine replica (None without one).
    """

    def __init__(self, trainer, trainer_plan, engine, engine_plan, replica: Optional[int], timeout_s: float = 300.0):
        self.trainer, self.engine = trainer, engine
        self.timeout = timedelta(seconds=float(timeout_s))
        mine = (boxes_of(trainer, trainer_plan) if trainer is not None else None,
                boxes_of(engine, engine_plan) if engine is not None else None, replica)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        every = [mine] if world == 1 else [None] * world
        if world > 1:
            dist.all_gather_object(every, mine)
        src, dst, rep = [e[0] for e in every], [e[1] for e in every], [e[2] for e in every]
        self.pairs = plan_pieces(src, dst, rep)
        self.src_boxes, self.dst_boxes = src[self.rank], dst[self.rank]
        self.dst_dtype = {n: getattr(torch, b[3].split(".")[-1]) for n, b in (self.dst_boxes or {}).items()}
        dtypes = [{n: b[3] for n, b in (d or {}).items()} for d in dst]
        self._dst_dtype_of = lambda d, name: getattr(torch, dtypes[d][name].split(".")[-1])
        self.shard_bytes = sum(_numel(b[2]) * self.dst_dtype[n].itemsize for n, b in (self.dst_boxes or {}).items())
        """bytes of this rank's engine tensors (0 without an engine)"""
        self.last: dict = {}

    def _tensors(self, model) -> Dict[str, torch.Tensor]:
        return {canonical_name(k): v for k, v in model.state_dict(keep_vars=True).items()}

    @torch.no_grad()
    def run(self) -> dict:
        """One refit. Returns (and keeps in ``last``) ``seconds``, ``bytes_in`` (bytes that landed in this
        rank's engine tensors, local copies included), ``bytes_remote`` (of them, received from other ranks),
        ``bytes_out`` (sent to other ranks) and ``shard_bytes``."""
        t0 = time.perf_counter()
        me = self.rank
        src_t = self._tensors(self.trainer) if self.trainer is not None else {}
        dst_t = self._tensors(self.engine) if self.engine is not None else {}

        def pack(d, pieces):
            parts = [src_t[n].detach()[_local(box, self.src_boxes[n][1])].to(self._dst_dtype_of(d, n)).reshape(-1)
                     for n, box in pieces]
            return torch.cat(parts) if parts else torch.empty(0)

        def unpack(buf, pieces):
            at = 0
            for n, box in pieces:
                k = _numel(box[1])
                dst_t[n].detach()[_local(box, self.dst_boxes[n][1])].copy_(buf[at:at + k].view(box[1]))
                at += k
            return at

        works, recvs, sends = [], [], []
        bytes_out = bytes_in = remote = 0
        for (s, d), pieces in sorted(self.pairs.items()):
            if (s == me) == (d == me):
                continue
            by_dtype: Dict[torch.dtype, list] = {}  # one message per dtype of the engine's tensors
            for n, box in pieces:
                by_dtype.setdefault(self._dst_dtype_of(d, n), []).append((n, box))
            for tag, (dt, group) in enumerate(sorted(by_dtype.items(), key=lambda kv: str(kv[0]))):
                if s == me:
                    buf = pack(d, group)
                    bytes_out += buf.numel() * buf.element_size()
                    sends.append(buf)
                    works.append((dist.isend(buf, d, tag=tag), f"send to rank {d}"))
                else:
                    buf = torch.empty(sum(_numel(b[1]) for _, b in group), dtype=dt)
                    recvs.append((buf, group))
                    works.append((dist.irecv(buf, s, tag=tag), f"receive from rank {s}"))
        for (s, d), pieces in self.pairs.items():
            if s == me and d == me:
                for n, box in pieces:
                    dst_t[n].detach()[_local(box, self.dst_boxes[n][1])].copy_(
                        src_t[n].detach()[_local(box, self.src_boxes[n][1])])
                    bytes_in += _numel(box[1]) * self.dst_dtype[n].itemsize
        for w, what in works:
            try:
                ok = w.wait(self.timeout)
            except Exception as e:  # noqa: BLE001 - backend-specific timeout/abort errors
                raise RuntimeError(f"refit: rank {me}'s {what} did not complete within "
                                   f"{self.timeout.total_seconds():.0f} s ({type(e).__name__}: {e}); that rank "
                                   "failed or hangs (see its error)") from e
            if ok is False:
                raise RuntimeError(f"refit: rank {me}'s {what} did not complete within "
                                   f"{self.timeout.total_seconds():.0f} s; that rank failed or hangs")
        for buf, pieces in recvs:
            unpack(buf, pieces)
            remote += buf.numel() * buf.element_size()
        bytes_in += remote
        self.last = {"seconds": time.perf_counter() - t0, "bytes_in": bytes_in, "bytes_remote": remote,
                     "bytes_out": bytes_out, "shard_bytes": self.shard_bytes}
        return self.last
