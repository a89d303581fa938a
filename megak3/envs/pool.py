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

Failures are per episode: an episode whose worker could not serve it (its restore failed during
recovery or from a checkpoint, its worker died twice in one request) is *lost*: ``lost[eid]`` says why,
``events`` records it, and ``step_batch`` answers the other episodes and raises ``StepBatchError``
(an ``EnvError``) carrying both (``EpisodeDriver`` ends lost episodes with reward 0 and carries on).

The store (``store_limits``, ``snapshot.StoreLimits``): one snapshot holds at most ``episode_bytes`` /
``episode_entries`` (a bigger tree is not saved; the step's observation says so). After every
``gc_bytes`` new store bytes the pool collects garbage itself, keeping each live episode's last
``keep_last`` snapshots, those of the last ``keep_last`` ``checkpoint()`` calls, and every *pinned*
id (ids this pool returned from ``snapshot`` or was given in ``restore``/``fork``/``from_checkpoint``,
until ``release``). While the store is over
``pool_bytes`` after a collection (``store_full``), a step's snapshot that needs new file contents is
refused (the observation says so) and one that needs only its manifest (files deleted or unchanged)
is taken, so later collections can free the older ones; the pool collects at every batch (keeping
only each episode's last snapshot if need be) until the store is under ``pool_bytes`` again. The
bound is checked between requests: one batch can pass it by at most its episodes' ``episode_bytes``.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from megak3.envs.env import StepResult
from megak3.envs.process_backend import ProcessWorker, WorkerDied
from megak3.envs.sandbox import SandboxLimits, remove_stale_cgroups, remove_tree
from megak3.envs.snapshot import SnapshotStore, StoreLimits
from megak3.envs.toolcall import ToolCall


class EnvError(Exception):
    """A request the worker refused (unknown episode, bad task spec, ...)."""


class StepBatchError(EnvError):
    """Some episodes of a ``step_batch`` failed (not for their model text): ``results`` holds the
    others' StepResults, ``errors`` {eid: reason} the failed ones."""

    def __init__(self, results: Dict[str, StepResult], errors: Dict[str, str]):
        super().__init__("; ".join(f"episode {e!r}: {m}" for e, m in sorted(errors.items())))
        self.results, self.errors = results, errors


@dataclass
class PoolEvent:
    kind: str               # "worker_died" | "restore_failed" (from a checkpoint)
    worker: int
    moved: Dict[str, int] = field(default_factory=dict)   # episode -> new worker index
    failed: Dict[str, str] = field(default_factory=dict)  # episode -> why it could not be restored (lost)


class EnvPool:
    def __init__(self, num_workers: int = 2, store_dir: Optional[str] = None, base_dir: Optional[str] = None,
                 limits: Optional[Dict] = None, backend: str = "process", snapshot_every_step: bool = True,
                 reply_timeout: Optional[float] = None, store_limits: Optional[Dict] = None):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be a positive integer")
        if backend not in ("process", "ray"):
            raise ValueError(f"backend={backend!r} must be 'process' or 'ray'")
        self.limits = SandboxLimits.from_dict(limits).to_dict()
        self.store_limits = StoreLimits.from_dict(store_limits)
        self.own_base = base_dir is None
        self.base_dir = base_dir or tempfile.mkdtemp(prefix="megak3-envs-")
        self.store_dir = os.path.abspath(store_dir or os.path.join(self.base_dir, "store"))
        self.backend, self.snapshot_every_step = backend, snapshot_every_step
        self.reply_timeout = reply_timeout or 2 * self.limits["wall_seconds"] + 60
        self.store = SnapshotStore(self.store_dir, self.store_limits)
        self.store_bytes = self.store.disk_bytes()     # measured after each gc, plus what replies report
        self.written_since_gc, self.store_full = 0, False
        self.generation = 0
        self.workers: List[Any] = []
        self.workers = [self._start_worker() for _ in range(num_workers)]
        self.where: Dict[str, int] = {}
        self.last_snap: Dict[str, str] = {}
        self.recent: Dict[str, List[str]] = {}          # each episode's last keep_last snapshot ids
        self.pinned: set = set()
        self.checkpointed: List[set] = []               # snapshot ids of the last keep_last checkpoints
        self.lost: Dict[str, str] = {}
        self.events: List[PoolEvent] = []

    # ---- workers --------------------------------------------------------------------------------
    def _start_worker(self):
        self.generation += 1
        base = os.path.join(self.base_dir, f"w{self.generation}")
        if self.backend == "ray":
            from megak3.envs.ray_backend import RayWorker
            return RayWorker(self.store_dir, base, self.limits, self.reply_timeout, self.store_limits.to_dict())
        return ProcessWorker(self.store_dir, base, self.limits, self.reply_timeout,
                             store_limits=self.store_limits.to_dict())

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
                try:
                    self._raw(target, {"op": "restore", "episode": eid, "snap": self.last_snap[eid]})
                    event.moved[eid] = target
                except (EnvError, WorkerDied) as e:
                    event.failed[eid] = self._lose(eid, f"its restore after a worker died failed: {e}")
            else:                                       # never snapshotted: nothing to resume
                event.failed[eid] = self._lose(eid, "its worker died before its first snapshot")
        self.events.append(event)

    def _lose(self, eid: str, why: str) -> str:
        self.where.pop(eid, None)
        self.last_snap.pop(eid, None)
        self.recent.pop(eid, None)
        self.lost[eid] = why
        return why

    def _raw(self, w: int, req: Dict) -> Dict:
        reply = self.workers[w].submit(req).result()
        if not reply.pop("ok"):
            raise EnvError(reply["error"])
        return reply

    def _call(self, eid: str, req: Dict) -> Dict:
        if eid in self.lost:
            raise EnvError(f"episode {eid!r} was lost: {self.lost[eid]}")
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
                    raise EnvError(f"episode {eid!r} was lost: {self.lost[eid]}")
        self._saved(eid, reply)
        return reply

    def _saved(self, eid: str, reply: Dict):
        """Note the snapshot a reply carries: the episode's restore point, and new store bytes."""
        if "snap" not in reply:
            return
        self.last_snap[eid] = reply["snap"]
        recent = self.recent.setdefault(eid, [])
        if not recent or recent[-1] != reply["snap"]:
            recent.append(reply["snap"])
            del recent[:-self.store_limits.keep_last]
        n = reply.get("snap_stats", {}).get("bytes_written", 0)
        self.store_bytes += n
        self.written_since_gc += n

    def _batch(self, reqs: Dict[str, Dict]) -> Tuple[Dict[str, Dict], Dict[str, str]]:
        """Send every request, then collect: different workers run theirs at the same time.
        Returns (replies, {eid: error} of the episodes that failed)."""
        order, out = sorted(reqs), {}
        pending = []
        for eid in order:
            try:
                pending.append((eid, self.workers[self.where[eid]].submit({**reqs[eid], "episode": eid})))
            except WorkerDied:
                pending.append((eid, None))
        errors = {}
        for eid, handle in pending:
            try:
                if handle is None:
                    raise WorkerDied
                reply = handle.result()
                if not reply.pop("ok"):
                    raise EnvError(reply["error"])
                self._saved(eid, reply)
                out[eid] = reply
            except WorkerDied:
                out[eid] = None
            except EnvError as e:
                errors[eid] = str(e)
        for eid in order:                               # episodes of dead workers: recover and redo one by one
            if eid not in errors and out.get(eid) is None:
                try:
                    out[eid] = self._call(eid, reqs[eid])
                except (EnvError, WorkerDied) as e:
                    errors[eid] = str(e)
        return {e: r for e, r in out.items() if e not in errors}, errors

    # ---- episodes -------------------------------------------------------------------------------
    def reset(self, eid: str, task) -> str:
        if eid in self.where:
            raise EnvError(f"episode {eid!r} already exists; close it first")
        self.lost.pop(eid, None)
        self.where[eid] = self._least_loaded()
        try:
            obs = self._call(eid, {"op": "reset", "task": task, "snapshot": self.snapshot_every_step,
                                   "store_full": self.store_full})["observation"]
        except Exception:
            self.where.pop(eid, None)
            raise
        self._collect()
        return obs

    def step(self, eid: str, action) -> StepResult:
        """One step; model text never makes it raise (``StepBatchError`` only if the pool fails the episode)."""
        return self.step_batch({eid: action})[eid]

    def step_batch(self, actions: Dict[str, Any]) -> Dict[str, StepResult]:
        """One step of every episode in ``actions``; raises ``StepBatchError`` (after all were answered)
        when some episode failed for a reason other than its action (lost, its worker failed)."""
        for eid in actions:
            if eid not in self.where and eid not in self.lost:
                raise EnvError(f"episode {eid!r} is not in this pool")
        reqs = {eid: {"op": "step", "action": _wire(a), "snapshot": self.snapshot_every_step,
                      "store_full": self.store_full} for eid, a in actions.items() if eid not in self.lost}
        replies, errors = self._batch(reqs)
        errors.update({eid: f"episode {eid!r} was lost: {self.lost[eid]}" for eid in actions if eid in self.lost})
        results = {eid: StepResult(r["observation"], r["done"], r["reward"], r["info"]) for eid, r in replies.items()}
        self._collect()
        if errors:
            raise StepBatchError(results, errors)
        return results

    def snapshot(self, eid: str) -> str:
        snap = self._call(eid, {"op": "snapshot"})["snap"]
        self.pinned.add(snap)
        return snap

    def restore(self, eid: str, snap_id: str) -> None:
        self._call(eid, {"op": "restore", "snap": snap_id})
        self.pinned.add(snap_id)
        self.last_snap[eid] = snap_id

    def fork(self, eid: str, new_eid: str, snap_id: Optional[str] = None) -> None:
        """A new episode ``new_eid`` from ``snap_id`` (default: ``eid``'s last snapshot), on the least-loaded worker."""
        snap_id = snap_id or self.last_snap.get(eid) or self.snapshot(eid)
        if new_eid in self.where:
            raise EnvError(f"episode {new_eid!r} already exists")
        self.lost.pop(new_eid, None)
        self.where[new_eid], self.last_snap[new_eid] = self._least_loaded(), snap_id
        self.pinned.add(snap_id)
        try:
            self._call(new_eid, {"op": "restore", "snap": snap_id})
        except Exception:
            self.where.pop(new_eid, None)
            self.last_snap.pop(new_eid, None)
            raise

    def state(self, eid: str) -> Dict:
        return self._call(eid, {"op": "digest"})["state"]

    def digest(self, eid: str, mtimes: bool = True) -> str:
        """sha256 of the episode's tree (``snapshot.tree_digest``)."""
        return self._call(eid, {"op": "digest", "mtimes": mtimes})["digest"]

    def uid(self, eid: str) -> int:
        """The uid the episode's commands run as (unique among live sandboxes on its host)."""
        return self._call(eid, {"op": "digest", "mtimes": False})["uid"]

    def close(self, eid: str) -> None:
        self.lost.pop(eid, None)
        self.recent.pop(eid, None)
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
        """JSON-serialisable: the store and each live episode's last snapshot (gc keeps the snapshots of
        the last ``keep_last`` checkpoints)."""
        self.checkpointed.append(set(self.last_snap.values()))
        del self.checkpointed[:-self.store_limits.keep_last]
        return {"store": self.store_dir, "episodes": dict(sorted(self.last_snap.items()))}

    @classmethod
    def from_checkpoint(cls, ckpt: Dict, num_workers: int = 2, **kw) -> "EnvPool":
        """A new pool with ``ckpt``'s episodes; one whose restore fails is lost (``lost``, ``events``)."""
        pool = cls(num_workers, store_dir=ckpt["store"], **kw)
        failed = {}
        for eid, snap in ckpt["episodes"].items():
            pool.where[eid], pool.last_snap[eid] = pool._least_loaded(), snap
            pool.pinned.add(snap)
            try:
                pool._call(eid, {"op": "restore", "snap": snap})
            except (EnvError, WorkerDied) as e:
                failed[eid] = pool._lose(eid, f"its restore from the checkpoint failed: {e}")
        if failed:
            pool.events.append(PoolEvent("restore_failed", -1, failed=failed))
        return pool

    def release(self, snap_ids) -> None:
        """Unpin ``snap_ids``: gc may delete them once no live episode's last ``keep_last`` names them."""
        self.pinned.difference_update(snap_ids)

    def gc(self, keep=(), keep_last: Optional[int] = None) -> int:
        """Delete every snapshot but the live episodes' last ``keep_last`` (default
        ``store_limits.keep_last``) ones, those of the last ``store_limits.keep_last`` checkpoints, the
        pinned ones and ``keep`` (and objects only they used); returns bytes freed. Only for a store
        no other pool writes to at the same time."""
        k = keep_last or self.store_limits.keep_last
        live = {s for ids in self.recent.values() for s in ids[-k:]} | set(self.last_snap.values())
        live.update(*self.checkpointed)
        freed = self.store.gc(sorted(live | self.pinned | set(keep)))
        self.store_bytes = self.store.disk_bytes()
        self.written_since_gc = 0
        self.store_full = self.store_bytes > self.store_limits.pool_bytes
        return freed

    def _collect(self):
        """The pool's own gc: after ``gc_bytes`` new bytes, or at every batch while the store is full
        (then keeping only each episode's last snapshot if that is what it takes)."""
        lim = self.store_limits
        if self.written_since_gc >= lim.gc_bytes or self.store_full or self.store_bytes > lim.pool_bytes:
            self.gc()
            if self.store_full and lim.keep_last > 1:
                self.gc(keep_last=1)

    def shutdown(self):
        for w in self.workers:
            try:
                w.close()
            except Exception:  # noqa: BLE001
                pass
        self.workers = []
        self.store.close()
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
