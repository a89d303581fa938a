"""NCCL point-to-point semantics on the CPU: a send completes only once its receive is posted.

gloo buffers a send, so a post order that deadlocks on NCCL runs fine in CPU tests. This module
replaces ``torch.distributed``'s ``isend``, ``irecv`` and ``batch_isend_irecv`` (threaded ranks,
one process) with :class:`NcclP2P`, which moves the data itself under NCCL's rules:

* a *launch* is one ``isend``/``irecv``, or one ``batch_isend_irecv`` (an NCCL group: its
  operations progress together and the launch completes when every one of them is matched);
* launches run on *streams* in the order posted: a launch starts only when the previous launch on
  its stream has completed. ``streams="rank"`` (the default, the strict check) puts all of a rank's
  point-to-point on one stream; ``streams="torch"`` follows ProcessGroupNCCL (a group on the
  process group's stream, a single ``isend``/``irecv`` on a stream per peer). Anything that runs
  under the strict model runs under torch's (fewer constraints can only finish more);
* the i-th send from rank a to rank b meets b's i-th receive from a (NCCL ignores tags), and only
  when both launches have started; a differing tag, shape or dtype is reported as an error (NCCL
  would silently deliver the wrong tensor, or hang);
* ``wait()`` blocks the calling rank until the operation's launch completes (on a GPU the compute
  stream blocks instead; every later operation of the rank is ordered after it either way).

``semantics="gloo"`` (sends complete when posted, streams never block) exists to *record* a post
order that deadlocks under NCCL (``record=True``): :func:`replay` runs recorded programs through
the same model without threads or tensors and returns ``None`` or the deadlock's description.

Deadlock: when every rank is blocked in a wait and nothing can be matched, every waiter raises
:class:`P2PDeadlock` with a description of what each rank waits for and which operations are
unmatched (``detect_deadlock=False`` leaves it to the wait's timeout, as NCCL itself would hang).

    with NcclP2P(world_size=2) as fabric:       # around run_threaded(2, fn); fn calls dist.isend, ...
        ...
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["NcclP2P", "P2PDeadlock", "P2PMismatch", "P2PModel", "replay"]


class P2PDeadlock(RuntimeError):
    """No rank can make progress under NCCL's point-to-point rules."""


class P2PMismatch(RuntimeError):
    """A send met a receive with a different tag, shape or dtype (NCCL matches by order only)."""


class _Op:
    __slots__ = ("rank", "peer", "send", "tensor", "tag", "shape", "launch", "done", "ordinal")

    def __init__(self, rank, peer, send, tensor, tag, shape):
        self.rank, self.peer, self.send, self.tensor, self.tag = rank, peer, send, tensor, tag
        self.shape = shape
        self.launch = None
        self.done = False
        self.ordinal = 0

    def describe(self, name: Callable[[int], str]) -> str:
        arrow = f"send -> {self.peer}" if self.send else f"recv <- {self.peer}"
        return f"{arrow} #{self.ordinal} {name(self.tag)}"


class _Launch:
    __slots__ = ("rank", "index", "ops", "stream", "started", "done")

    def __init__(self, rank, index, ops, stream):
        self.rank, self.index, self.ops, self.stream = rank, index, ops, stream
        self.started = self.done = False


class P2PModel:
    """The matching rules above, without threads: ``post`` launches, ``progress`` matches and
    completes what it can (copying send -> receive tensors when both are given)."""

    def __init__(self, world_size: int, streams: str = "rank", semantics: str = "nccl",
                 tag_name: Optional[Callable[[int], str]] = None):
        if streams not in ("rank", "torch") or semantics not in ("nccl", "gloo"):
            raise ValueError(f"streams={streams!r} (rank|torch), semantics={semantics!r} (nccl|gloo)")
        self.world_size, self.streams, self.semantics = world_size, streams, semantics
        self.tag_name = tag_name or (lambda tag: f"tag {tag}")
        self.queues: Dict[tuple, List[_Launch]] = {}    # (rank, stream) -> launches not yet done
        self.pending: Dict[tuple, List[_Op]] = {}       # (src, dst, is_send) -> unmatched ops in order
        self.count: Dict[tuple, int] = {}               # ordinals per (src, dst, is_send)
        self.launches: List[List[_Launch]] = [[] for _ in range(world_size)]
        self.error: Optional[Exception] = None

    def post(self, rank: int, ops: Sequence[tuple], batched: bool) -> _Launch:
        """ops: (is_send, peer, tensor or None, tag, shape) in the caller's order."""
        made = [_Op(rank, peer, send, t, tag, shape) for send, peer, t, tag, shape in ops]
        if self.streams == "rank":
            stream = "p2p"
        else:
            stream = "group" if batched else f"peer {made[0].peer}"
        launch = _Launch(rank, len(self.launches[rank]), made, stream)
        launch.started = self.semantics == "gloo"
        self.launches[rank].append(launch)
        for op in made:
            op.launch = launch
            pair = (rank, op.peer, True) if op.send else (op.peer, rank, False)
            op.ordinal = self.count.get(pair, 0)
            self.count[pair] = op.ordinal + 1
            self.pending.setdefault(pair, []).append(op)
            if op.send and self.semantics == "gloo":  # buffered: complete at once
                op.tensor = None if op.tensor is None else op.tensor.clone()
                op.done = True
        self.queues.setdefault((rank, stream), []).append(launch)
        return launch

    def progress(self) -> bool:
        """Start, match and complete until nothing changes; True if anything did."""
        any_change = False
        while True:
            changed = False
            for queue in self.queues.values():
                while queue:  # nccl: only the head of a stream runs; gloo: every launch started at post
                    head = queue[0]
                    if not head.started:
                        head.started = changed = True
                    if not all(op.done for op in head.ops):
                        break
                    head.done = changed = True
                    queue.pop(0)
                if self.semantics == "gloo":
                    for launch in [x for x in queue if all(op.done for op in x.ops)]:
                        launch.done = changed = True
                        queue.remove(launch)
            for (src, dst, is_send), sends in self.pending.items():
                recvs = self.pending.get((src, dst, False), []) if is_send else []
                while sends and recvs and sends[0].launch.started and recvs[0].launch.started:
                    self._match(sends.pop(0), recvs.pop(0))
                    changed = True
            if not changed:
                return any_change
            any_change = True

    def _match(self, s: _Op, r: _Op) -> None:
        if s.tag != r.tag or s.shape != r.shape:
            err = P2PMismatch(f"rank {s.rank}'s send #{s.ordinal} to rank {r.rank} ({self.tag_name(s.tag)}, "
                              f"{s.shape}) met rank {r.rank}'s receive #{r.ordinal} from rank {s.rank} "
                              f"({self.tag_name(r.tag)}, {r.shape}): NCCL matches by order, not tag, and would "
                              "deliver the wrong tensor")
            self.error = self.error or err
        elif s.tensor is not None and r.tensor is not None:
            r.tensor.copy_(s.tensor)
        s.done = r.done = True

    def blocked(self, waiting: Dict[int, _Launch]) -> str:
        """What each rank waits for and the unmatched operations holding its streams."""
        lines = []
        for rank in range(self.world_size):
            w = waiting.get(rank)
            if w is not None:
                lines.append(f"rank {rank} waits for its launch #{w.index} "
                             f"[{', '.join(op.describe(self.tag_name) for op in w.ops if not op.done)}]")
            for (r, stream), queue in self.queues.items():
                if r == rank and queue:
                    head = queue[0]
                    todo = [op.describe(self.tag_name) for op in head.ops if not op.done]
                    lines.append(f"  its stream '{stream}' is held by launch #{head.index}: unmatched "
                                 f"{', '.join(todo)}; {len(queue) - 1} launch(es) queued behind it")
        return "\n".join(lines)


def replay(programs: Sequence[Sequence[list]], streams: str = "rank",
           tag_name: Optional[Callable[[int], str]] = None) -> Optional[str]:
    """Run recorded per-rank programs under NCCL semantics, without tensors. A program item is
    ``["P", [[is_send, peer, tag, numel], ...], batched]`` (post a launch) or ``["W", i]`` (wait for
    the rank's i-th launch). Returns None when every program finishes and every launch completed
    (a send never received is an error too, as NCCL would hang on it), else a description of what
    is stuck (:meth:`P2PModel.blocked`)."""
    model = P2PModel(len(programs), streams, "nccl", tag_name)
    pos = [0] * len(programs)
    waiting: Dict[int, _Launch] = {}
    while True:
        moved = False
        for rank, prog in enumerate(programs):
            while pos[rank] < len(prog):
                item = prog[pos[rank]]
                if item[0] == "P":
                    model.post(rank, [(bool(s), peer, None, tag, (numel,)) for s, peer, tag, numel in item[1]],
                               bool(item[2]))
                    model.progress()
                else:
                    launch = model.launches[rank][item[1]]
                    if not launch.done:
                        waiting[rank] = launch
                        break
                    waiting.pop(rank, None)
                pos[rank] += 1
                moved = True
        if model.error is not None:
            raise model.error
        if all(p == len(prog) for p, prog in zip(pos, programs)):
            model.progress()
            if all(launch.done for mine in model.launches for launch in mine):
                return None
            return "every program ended with launches unmatched:\n" + model.blocked(waiting)
        if not moved and not model.progress():
            return model.blocked(waiting)


class _Work:
    """What the patched calls return: ``wait(timeout)`` and ``is_completed()`` like a torch Work."""

    def __init__(self, fabric: "NcclP2P", launch: _Launch):
        self.fabric, self.launch = fabric, launch

    def is_completed(self) -> bool:
        return self.launch.done

    def wait(self, timeout=None) -> bool:
        return self.fabric._wait(self.launch, timeout)


class NcclP2P:
    """Context manager: ``torch.distributed``'s point-to-point calls follow NCCL's rules (module
    docstring) for threaded ranks of one process (``parallel.testing.run_threaded``).

    world_size: ranks of the default group (peers are global ranks, as P2POp resolves them).
    streams, semantics, tag_name: as :class:`P2PModel`.
    timeout_s: the longest a wait blocks when the caller gives no timeout.
    detect_deadlock: raise :class:`P2PDeadlock` at once when every rank waits and nothing can move.
    record: keep every rank's program (:func:`replay`'s format) in ``self.programs``.
    """

    def __init__(self, world_size: int, streams: str = "rank", semantics: str = "nccl",
                 tag_name: Optional[Callable[[int], str]] = None, timeout_s: float = 60.0,
                 detect_deadlock: bool = True, record: bool = False):
        self.model = P2PModel(world_size, streams, semantics, tag_name)
        self.timeout_s, self.detect_deadlock = timeout_s, detect_deadlock
        self.cond = threading.Condition()
        self.waiting: Dict[int, _Launch] = {}
        self.programs: Optional[List[list]] = [[] for _ in range(world_size)] if record else None
        self._saved: list = []

    # ---- the patched torch.distributed calls -----------------------------------------------------
    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        return self._post([(True, self._global(group, dst, group_dst), tensor, tag)], batched=False)[0]

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        return self._post([(False, self._global(group, src, group_src), tensor, tag)], batched=False)[0]

    def batch_isend_irecv(self, p2p_op_list):
        ops = [(op.op == self.isend, op.peer, op.tensor, op.tag) for op in p2p_op_list]
        return self._post(ops, batched=True)

    @staticmethod
    def _global(group, peer, group_peer):
        if group_peer is not None:
            return dist.get_global_rank(group or dist.group.WORLD, group_peer)
        return peer

    def _post(self, ops, batched: bool) -> list:
        rank = dist.get_rank()
        with self.cond:
            launch = self.model.post(rank, [(s, peer, t, tag, (tuple(t.shape), t.dtype)) for s, peer, t, tag in ops],
                                     batched)
            if self.programs is not None:
                self.programs[rank].append(["P", [[int(s), peer, tag, t.numel()] for s, peer, t, tag in ops],
                                            int(batched)])
            self.model.progress()
            self.cond.notify_all()
        # NCCL's group call returns one coalesced work; a single op one work
        return [_Work(self, launch)]

    def _wait(self, launch: _Launch, timeout) -> bool:
        rank = launch.rank
        limit = self.timeout_s if timeout is None else (
            timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout))
        deadline = time.monotonic() + limit
        with self.cond:
            if self.programs is not None:
                self.programs[rank].append(["W", launch.index])
            self.waiting[rank] = launch
            try:
                while not launch.done:
                    if self.model.error is not None:
                        raise self.model.error
                    if self.model.progress():
                        self.cond.notify_all()
                        continue
                    stuck = [w for w in self.waiting.values() if not w.done]  # a woken waiter may not have left yet
                    if self.detect_deadlock and len(stuck) == self.model.world_size:
                        self.model.error = P2PDeadlock("NCCL point-to-point deadlock:\n" +
                                                       self.model.blocked(self.waiting))
                        self.cond.notify_all()
                        continue
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"rank {rank}: a point-to-point wait timed out after {limit:.1f} s "
                                           "under NCCL semantics:\n" + self.model.blocked(self.waiting))
                    self.cond.wait(min(left, 0.5))
            finally:
                self.waiting.pop(rank, None)
        return True

    # ---- install / remove ------------------------------------------------------------------------
    def __enter__(self) -> "NcclP2P":
        for mod in (dist, c10d):
            for name in ("isend", "irecv", "batch_isend_irecv"):
                self._saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, getattr(self, name))
        return self

    def __exit__(self, *exc) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved.clear()
