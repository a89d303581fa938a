"""A pool of environment workers: episodes spread over worker processes, recovered from snapshots.

``EnvPool(num_workers, store_dir, backend="process" | "ray")``. Each worker is a
``python -m megak3.envs.worker`` process (backend ``process``: a child of this process, see
``process_backend``; backend ``ray``: owned by a Ray actor, one per worker, placed by Ray — see
``ray_backend``). The pool keeps,
per episode, its worker and its last snapshot id; with ``snapshot_every_step`` (the default) every
``reset``/``step`` ends with a snapshot, so the last snapshot is the state after the last completed
step. When a worker dies (its process ends, its pipe breaks, its Ray actor dies, or a reply takes
longer than ``reply_timeout``) the pool starts a replacement, restores each of the dead worker's
episodes from its last snapshot on the least-loaded worker, and re-sends the interrupted request
once. ``checkpoint()`` is the JSON the RL checkpoint stores (store path + last snapshot per episode);
``EnvPool.from_checkpoint`` brings every episode back in a new pool.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from megak3.envs.env import StepResult
from megak3.envs.process_backend import ProcessWorker, WorkerDied
from megak3.envs.sandbox import SandboxLimits, remove_stale_cgroups, remove_tree
from megak3.envs.toolcall import ToolCall


class EnvError(Exception):
    """A request the worker refused (unknown episode, bad task spec, ...)."""


@dataclass
class PoolEvent:
    kind: str               # "worker_died"
    worker: int
    moved: Dict[str, int] = field(default_factory=dict)   # episode -> new worker index


class EnvPool:
    def __init__(self, num_workers: int = 2, store_dir: Optional[str] = None, base_dir: Optional[str] = None,
                 limits: Optional[Dict] = None, backend: str = "process", snapshot_every_step: bool = True,
                 reply_timeout: Optional[float] = None):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be a positive integer")
        if backend not in ("process", "ray"):
            raise ValueError(f"backend={backend!r} must be 'process' or 'ray'")
        self.limits = SandboxLimits.from_dict(limits).to_dict()
        self.own_base = base_dir is None
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="megak3-envs-")
        self.store_dir = os.path.abspath(store_dir or os.path.join(self.base_dir, "store"))
        self.backend, self.snapshot_every_step = backend, snapshot_every_step
        self.reply_timeout = reply_timeout or 2 * self.limits["wall_seconds"] + 60
        self.generation = 0
        self.workers: List[Any] = [self._start_worker() for _ in range(num_workers)]
        self.where: Dict[str, int] = {}
        self.last_snap: Dict[str, str] = {}
        self.events: List[PoolEvent] = []

    # ---- workers --------------------------------------------------------------------------------
    def _start_worker(self):
        self.generation += 1
        base = os.path.join(self.base_dir, f"w{self.generation}")
        if self.backend == "ray":
            from megak3.envs.ray_backend import RayWorker
            return RayWorker(self.store_dir, base, self.limits, self.reply_timeout)
        return ProcessWorker(self.store_dir, base, self.limits, self.reply_timeout)

    @property
    def isolation(self) -> str:
        return self.workers[0].isolation

    def _least_loaded(self, exclude: int = -1) -> int:
        load = [sum(1 for w in self.where.values() if w == i) for i in range(len(self.workers))]
        return min((i for i in range(len(self.workers)) if i != exclude), key=lambda i: (load[i], i), default=exclude)

    def _recover(self, dead: int):
        """Replace worker ``dead``; restore its episodes from their last snapshots elsewhere."""
        try:
            self.workers[dead].kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
        remove_stale_cgroups()
        self.workers[dead] = self._start_worker()
        event = PoolEvent("worker_died", dead)
        for eid in sorted(e for e, w in self.where.items() if w == dead):
            target = self._least_loaded(exclude=dead) if len(self.workers) > 1 else dead
            self.where[eid] = target
            if eid in self.last_snap:
                self._raw(target, {"op": "restore", "episode": eid, "snap": self.last_snap[eid]})
            else:
                del self.where[eid]                     # never snapshotted: nothing to resume
            event.moved[eid] = target
        self.events.append(event)

    def _raw(self, w: int, req: Dict) -> Dict:
        reply = self.workers[w].submit(req).result()
        if not reply.pop("ok"):
            raise EnvError(reply["error"])
        return reply

    def _call(self, eid: str, req: Dict) -> Dict:
        if eid not in self.where:
            raise EnvError(f"episode {eid!r} is not in this pool")
        for attempt in (0, 1):
            w = self.where[eid]
            try:
                reply = self._raw(w, {**req, "episode": eid})
                break
            except WorkerDied:
                if attempt:
                    raise
                self._recover(w)
                if eid not in self.where:
                    raise EnvError(f"episode {eid!r} was lost with its worker before its first snapshot")
        if "snap" in reply:
            self.last_snap[eid] = reply["snap"]
        return reply

    def _batch(self, reqs: Dict[str, Dict]) -> Dict[str, Dict]:
        """Send every request, then collect: different workers run theirs at the same time."""
        order, out = sorted(reqs), {}
        pending = []
        for eid in order:
            try:
                pending.append((eid, self.workers[self.where[eid]].submit({**reqs[eid], "episode": eid})))
            except WorkerDied:
                pending.append((eid, None))
        for eid, handle in pending:
            try:
                if handle is None:
                    raise WorkerDied
                reply = handle.result()
                if not reply.pop("ok"):
                    raise EnvError(reply["error"])
                if "snap" in reply:
                    self.last_snap[eid] = reply["snap"]
                out[eid] = reply
            except WorkerDied:
                out[eid] = None
        for eid in order:                               # episodes of dead workers: recover and redo one by one
            if out[eid] is None:
                out[eid] = self._call(eid, reqs[eid])
        return out

    # ---- episodes -------------------------------------------------------------------------------
    def reset(self, eid: str, task) -> str:
        if eid in self.where:
            raise EnvError(f"episode {eid!r} already exists; close it first")
        self.where[eid] = self._least_loaded()
        try:
            return self._call(eid, {"op": "reset", "task": task, "snapshot": self.snapshot_every_step})["observation"]
        except Exception:
            self.where.pop(eid, None)
            raise

    def step(self, eid: str, action) -> StepResult:
        return self.step_batch({eid: action})[eid]

    def step_batch(self, actions: Dict[str, Any]) -> Dict[str, StepResult]:
        reqs = {eid: {"op": "step", "action": _wire(a), "snapshot": self.snapshot_every_step}
                for eid, a in actions.items()}
        for eid in reqs:
            if eid not in self.where:
                raise EnvError(f"episode {eid!r} is not in this pool")
        return {eid: StepResult(r["observation"], r["done"], r["reward"], r["info"])
                for eid, r in self._batch(reqs).items()}

    def snapshot(self, eid: str) -> str:
        return self._call(eid, {"op": "snapshot"})["snap"]

    def restore(self, eid: str, snap_id: str) -> None:
        self._call(eid, {"op": "restore", "snap": snap_id})
        self.last_snap[eid] = snap_id

    def fork(self, eid: str, new_eid: str, snap_id: Optional[str] = None) -> None:
        """A new episode ``new_eid`` from ``snap_id`` (default: ``eid``'s last snapshot), on the least-loaded worker."""
        snap_id = snap_id or self.last_snap.get(eid) or self.snapshot(eid)
        if new_eid in self.where:
            raise EnvError(f"episode {new_eid!r} already exists")
        self.where[new_eid], self.last_snap[new_eid] = self._least_loaded(), snap_id
        self._call(new_eid, {"op": "restore", "snap": snap_id})

    def state(self, eid: str) -> Dict:
        return self._call(eid, {"op": "digest"})["state"]

    def digest(self, eid: str, mtimes: bool = True) -> str:
        """sha256 of the episode's tree (``snapshot.tree_digest``)."""
        return self._call(eid, {"op": "digest", "mtimes": mtimes})["digest"]

    def uid(self, eid: str) -> int:
        """The uid the episode's commands run as (unique among live sandboxes on its host)."""
        return self._call(eid, {"op": "digest", "mtimes": False})["uid"]

    def close(self, eid: str) -> None:
        if eid in self.where:
            try:
                self._raw(self.where[eid], {"op": "close", "episode": eid})
            except WorkerDied:
                pass
            self.where.pop(eid)
            self.last_snap.pop(eid, None)

    def worker_pid(self, eid: str) -> int:
        return self.workers[self.where[eid]].pid

    # ---- checkpoints ----------------------------------------------------------------------------
    def checkpoint(self) -> Dict:
        """JSON-serialisable: the store and each live episode's last snapshot."""
        return {"store": self.store_dir, "episodes": dict(sorted(self.last_snap.items()))}

    @classmethod
    def from_checkpoint(cls, ckpt: Dict, num_workers: int = 2, **kw) -> "EnvPool":
        pool = cls(num_workers, store_dir=ckpt["store"], **kw)
        for eid, snap in ckpt["episodes"].items():
            pool.where[eid], pool.last_snap[eid] = pool._least_loaded(), snap
            pool._call(eid, {"op": "restore", "snap": snap})
        return pool

    def gc(self, keep=()) -> int:
        """Delete every snapshot but the live episodes' last ones and ``keep`` (and objects only they
        used); returns bytes freed. Only for a store no other pool writes to at the same time."""
        from megak3.envs.snapshot import SnapshotStore
        return SnapshotStore(self.store_dir).gc(sorted(set(self.last_snap.values()) | set(keep)))

    def shutdown(self):
        for w in self.workers:
            try:
                w.close()
            except Exception:  # noqa: BLE001
                pass
        self.workers = []
        if self.own_base:
            try:
                remove_tree(self.base_dir)
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _wire(action) -> Any:
    if isinstance(action, ToolCall):
        return {"name": action.name, "arguments": action.arguments}
    return action
