"""The writer of per-shard checkpoints (format: :mod:`.shard_format`): every rank writes only its own shards.

Commit protocol (no torch.distributed collective anywhere): each rank writes its ``.bin`` and
``.obj.pt``, fsyncs them, then atomically publishes its marker. Rank 0 also writes ``state.pt``,
polls the staging dir until every rank's marker is there (up to ``commit_timeout_s``), builds the
index parts and ``index.json`` from the markers (checking that every key has one dtype and global
shape and that its boxes are disjoint or identical, and that each ``.bin`` has the size its marker
states), removes the markers, writes the manifest, fsyncs the files it wrote (all at once:
:func:`.atomic.fsync_files`) and the staging dir, renames it to
``step_XXXXXXXX`` and replaces ``latest`` (both via :mod:`.atomic`), then prunes to
``keep_last``. A crash or timeout at any point leaves ``latest`` naming the previous checkpoint.

Stale staging dirs: rank 0 removes every leftover ``.tmp-*`` / ``.old-*`` entry under ``root`` when
the checkpointer is constructed (construct it on every rank before the ranks' first collective so no
save is under way yet), and at each save every leftover except the staging dir of the step being
saved (other ranks may already be writing into it).
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from . import atomic, key_index
from .atomic import CheckpointError
from .safe import safe_dumps
from .shard_format import (INDEX_NAME, SHARDS_FORMAT, bin_name, byte_view, dtype_name, marker_name, obj_name,
                           staging_name)

_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.2


def _fsync_dir_if_present(path: Path) -> None:
    """fsync a directory; a missing one was already renamed (and fsynced) by rank 0's commit."""
    try:
        atomic.fsync_dir(path)
    except FileNotFoundError:
        pass


def _boxes_overlap(a_off, a_shape, b_off, b_shape) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape))


def _check_disjoint(key: str, chunks: list) -> None:
    """Raise unless the boxes of ``chunks`` are pairwise disjoint (sweep along the dim with the most
    distinct offsets, so a grid layout compares only neighbours)."""
    chunks = [c for c in chunks if all(s > 0 for s in c["shape"])]  # empty boxes overlap nothing
    if len(chunks) < 2:  # (0-dim tensors: identical boxes were merged, so one chunk)
        return
    nd = len(chunks[0]["shape"])
    d = max(range(nd), key=lambda j: len({c["offsets"][j] for c in chunks}))
    order = sorted(chunks, key=lambda c: c["offsets"][d])
    active: list = []
    for c in order:
        start = c["offsets"][d]
        active = [a for a in active if a["offsets"][d] + a["shape"][d] > start]
        for a in active:
            if _boxes_overlap(a["offsets"], a["shape"], c["offsets"], c["shape"]):
                raise CheckpointError(
                    f"checkpoint: {key!r} boxes offsets={a['offsets']} shape={a['shape']} and "
                    f"offsets={c['offsets']} shape={c['shape']} overlap without being identical; pass each "
                    f"box from one rank")
        active.append(c)


@dataclass
class ShardEntry:
    """What a rank saves for one key: ``tensor`` is the box ``[offsets, offsets + tensor.shape)`` of
    a global tensor of shape ``global_shape``. ``tensor`` may live on any device; its bytes are saved
    as its dtype in C-contiguous order."""

    tensor: torch.Tensor
    global_shape: tuple
    offsets: tuple


class _Snapshot:
    """One rank's save, frozen: host tensors, pickled objects/common, JSON meta."""

    def __init__(self, step, seq, tensors, layout, objects_bytes, common_bytes, meta, snapshot_s,
                 object_keys=()):
        self.step, self.seq = step, seq
        self.object_keys = sorted(object_keys)  # the keys of ``objects`` (the index maps them to files)
        self.tensors = tensors          # key -> contiguous CPU tensor (sorted keys)
        self.layout = layout            # key -> (global_shape, offsets, shape, dtype name)
        self.objects_bytes = objects_bytes
        self.common_bytes = common_bytes
        self.meta = meta
        self.snapshot_s = snapshot_s


class ShardedCheckpointer:
    """One rank's writer of per-shard checkpoints under ``root`` (see the module docstring).

    Rank 0 commits; it removes leftover staging dirs of crashed saves when constructed. ``keep_last``
    prunes older complete checkpoints after each commit (:func:`.atomic.publish`).
    ``async_save`` writes in a background thread; ``commit_timeout_s`` bounds rank 0's wait for the
    other ranks' markers.
    """

    def __init__(self, root, rank: int, world_size: int, keep_last: Optional[int] = None,
                 async_save: bool = False, commit_timeout_s: float = 600.0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ShardedCheckpointer world_size={world_size!r} must be an int >= 1")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"ShardedCheckpointer rank={rank!r} must be an int in [0, {world_size})")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"checkpoint keep_last={keep_last!r} must be an int >= 1 or None (keep all)")
        if not commit_timeout_s > 0:
            raise ValueError(f"checkpoint commit_timeout_s={commit_timeout_s!r} must be > 0")
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self.keep_last = keep_last
        self.async_save = bool(async_save)
        self.commit_timeout_s = float(commit_timeout_s)
        self.last_save_stats: dict = {}
        self._seq = 0
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._before_write: Optional[Callable[[], None]] = None  # test hook: runs before any file is written
        self.root.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            atomic.remove_stale(self.root)

    # ------------------------------------------------------------------------------------ save
    def save(self, step: int, entries: dict, objects: Optional[dict] = None,
             common: Optional[dict] = None, meta: Optional[dict] = None) -> None:
        """Save this rank's ``entries`` (key -> :class:`ShardEntry`) as part of checkpoint ``step``.

        Every rank calls it for the same step. ``objects``: a small per-rank dict saved with this
        rank's marker. ``common`` (saved as ``state.pt``) and ``meta`` (JSON-serialisable, stored in the
        manifest) are used on rank 0 and ignored on the other ranks. ``objects`` and ``common`` may
        hold only tensors, plain containers and primitives (checked by :func:`.safe.safe_dumps`).

        Before anything is written it waits for the previous save (re-raising its error), checks the
        entries (shapes inside the global shape, no NaN/inf in floating tensors: CheckpointError
        ``"checkpoint step N: KEY holds non-finite values; not saved"`` -- raised here in sync mode,
        by :meth:`wait` in async mode, where the writer checks the host copies before writing),
        pickles ``objects`` and ``common`` and validates ``meta``.

        Sync mode: returns after this rank's files are durable and, on rank 0, after the commit
        (rank 0 polls for every rank's marker; no collective is used, so a caller that needs every
        rank to see the committed checkpoint adds a barrier). Async mode: copies every tensor to host
        memory (device->host, a clone on CPU), returns, and writes in a background thread; rank 0's
        thread commits once all ranks' markers exist. :meth:`wait` blocks until then.
        """
        self._seq += 1  # every call counts, so the ranks' counters agree even after a failed save
        self.wait()
        t0 = time.perf_counter()
        step = atomic.check_step(step)
        layout = self._check_entries(step, entries)
        if not self.async_save:  # async: the writer thread checks the host copies before writing
            self._check_finite(step, {k: e.tensor for k, e in entries.items()})
        objects_bytes = None
        if objects:
            objects_bytes = safe_dumps(dict(objects), "objects")
        common_bytes, meta_d = None, {}
        if self.rank == 0:
            meta_d = dict(meta or {})
            try:
                json.dumps(meta_d)
            except (TypeError, ValueError) as e:
                raise ValueError(f"checkpoint meta must be JSON-serialisable ({e})") from e
            common_bytes = safe_dumps(common if common is not None else {}, "common")
        tensors = self._host_copies(entries, copy=self.async_save)
        snap = _Snapshot(step, self._seq, tensors, layout, objects_bytes, common_bytes, meta_d,
                         time.perf_counter() - t0, object_keys=map(str, objects or {}))
        if not self.async_save:
            self._run(snap)
            return
        self._error = None
        self._thread = threading.Thread(target=self._run_captured, args=(snap,),
                                         name=f"ckpt-save-rank{self.rank}-step{step}")
        self._thread.start()

    def wait(self) -> None:
        """Block until the pending save (incl. rank 0's commit) finished; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _check_entries(self, step: int, entries: dict) -> dict:
        layout = {}
        for key in sorted(entries):
            e = entries[key]
            if not isinstance(key, str) or not key:
                raise ValueError(f"checkpoint entry key {key!r} must be a non-empty str")
            if not isinstance(e, ShardEntry) or not torch.is_tensor(e.tensor):
                raise ValueError(f"checkpoint entry {key!r} must be a ShardEntry holding a tensor")
            shape = tuple(e.tensor.shape)
            gshape = tuple(int(s) for s in e.global_shape)
            offs = tuple(int(o) for o in e.offsets)
            if len(gshape) != len(shape) or len(offs) != len(shape) or any(
                    o < 0 or o + s > g for o, s, g in zip(offs, shape, gshape)):
                raise ValueError(f"checkpoint entry {key!r}: box offsets={offs} shape={shape} does not lie "
                                 f"inside global_shape={gshape}")
            layout[key] = (gshape, offs, shape, dtype_name(e.tensor.dtype))
        return layout

    @staticmethod
    def _check_finite(step: int, tensors: dict) -> None:
        """CheckpointError naming the first floating tensor that holds a NaN/inf (key -> tensor).

        A NaN or inf anywhere makes the sum NaN or inf, so a finite sum proves every value finite
        (one read, no mask: ~40x cheaper than isfinite(t).all() on CPU); a sum that is not finite (a
        non-finite value, or finite values whose sum overflows) is checked element by element."""
        for key in sorted(tensors):
            t = tensors[key].detach()
            if (t.is_floating_point() or t.is_complex()) and t.numel():
                if bool(torch.isfinite(t.sum())):
                    continue
                for block in t.reshape(-1).split(1 << 24):
                    if not bool(torch.isfinite(block).all()):
                        raise CheckpointError(f"checkpoint step {step}: {key} holds non-finite values; "
                                              "not saved")

    @staticmethod
    def _host_copies(entries: dict, copy: bool) -> dict:
        """key -> contiguous CPU tensor; ``copy`` forces a private copy of CPU tensors too."""
        out, devices = {}, set()
        for key in sorted(entries):
            t = entries[key].tensor.detach()
            if t.device.type == "cpu":
                out[key] = t.clone(memory_format=torch.contiguous_format) if copy else t.contiguous()
            elif t.device.type == "cuda":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                devices.add(t.device)
                out[key] = host
            else:
                out[key] = t.to("cpu").contiguous()
        for d in devices:
            torch.cuda.current_stream(d).synchronize()
        return out

    def _run_captured(self, snap: _Snapshot) -> None:
        try:
            self._run(snap)
        except BaseException as e:  # re-raised by wait()
            self._error = e

    def _run(self, snap: _Snapshot) -> None:
        if self._before_write is not None:
            self._before_write()
        t0 = time.perf_counter()
        if self.async_save:
            self._check_finite(snap.step, snap.tensors)
        staging = self.root / staging_name(snap.step)
        if self.rank == 0:
            atomic.remove_stale(self.root, keep=(staging.name,))
        staging.mkdir(parents=True, exist_ok=True)
        nbytes = self._write_rank_files(staging, snap)
        t1 = time.perf_counter()
        commit_s = 0.0
        if self.rank == 0:
            nbytes += self._commit(staging, snap)
            commit_s = time.perf_counter() - t1
        self.last_save_stats = {"step": snap.step, "bytes": nbytes, "snapshot_s": snap.snapshot_s,
                                "write_s": t1 - t0, "commit_s": commit_s}

    def _write_rank_files(self, staging: Path, snap: _Snapshot) -> int:
        r = self.rank
        for name in (marker_name(r), bin_name(r), obj_name(r)):  # an earlier attempt's files
            (staging / name).unlink(missing_ok=True)
        entries, bin_entry, obj_entry, written = {}, None, None, 0
        if snap.tensors:
            pos = 0
            with open(staging / bin_name(r), "wb") as f:
                for key, t in snap.tensors.items():
                    data = byte_view(t)
                    f.write(memoryview(data))
                    gshape, offs, shape, dtype = snap.layout[key]
                    entries[key] = {"global_shape": list(gshape), "offsets": list(offs), "shape": list(shape),
                                    "dtype": dtype, "byte_offset": pos, "nbytes": int(data.nbytes),
                                    "crc32": zlib.crc32(memoryview(data))}
                    pos += int(data.nbytes)
            bin_entry = {"file": bin_name(r), "bytes": pos}
            written += pos
        if snap.objects_bytes is not None:
            obj_entry = {"file": obj_name(r), "keys": snap.object_keys,
                         **atomic.write_bytes(staging / obj_name(r), snap.objects_bytes)}
            written += obj_entry["bytes"]
        # the payload and objects files are durable before the marker that names them is published
        atomic.fsync_files(staging / e["file"] for e in (bin_entry, obj_entry) if e is not None)
        marker = {"format": SHARDS_FORMAT, "rank": r, "world_size": self.world_size, "step": snap.step,
                  "seq": snap.seq, "bin": bin_entry, "objects": obj_entry, "entries": entries}
        text = json.dumps(marker, sort_keys=True).encode()
        tmp = staging / f".{marker_name(r)}.tmp"
        atomic.write_bytes_durably(tmp, text)
        os.replace(tmp, staging / marker_name(r))  # this rank is done
        _fsync_dir_if_present(staging)
        return written + len(text)

    def _commit(self, staging: Path, snap: _Snapshot) -> int:
        # every file of the commit is written first and fsynced at once, before the rename (fsync_files)
        files = {atomic.STATE_FILE: atomic.write_bytes(staging / atomic.STATE_FILE, snap.common_bytes)}
        markers = self._wait_for_markers(staging, snap)
        keys: dict = {}
        boxes: dict = {}  # key -> {(offsets, shape)} already indexed
        obj_files = []
        for r in range(self.world_size):
            raw, m = markers[r]
            files[marker_name(r)] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
            if m["objects"] is not None:
                o = m["objects"]
                files[o["file"]] = {"bytes": o["bytes"], "sha256": o["sha256"]}
                obj_files.append({"file": o["file"], "keys": o["keys"]})
            if m["bin"] is not None:
                b = m["bin"]
                size = (staging / b["file"]).stat().st_size
                if size != b["bytes"]:
                    raise CheckpointError(f"checkpoint step {snap.step}: {staging / b['file']} has {size} bytes, "
                                          f"rank {r}'s marker says {b['bytes']}; not committed")
                files[b["file"]] = {"bytes": b["bytes"]}  # integrity: per-chunk crc32 in the index
            for key, e in sorted(m["entries"].items()):
                info = keys.setdefault(key, {"global_shape": e["global_shape"], "dtype": e["dtype"], "chunks": []})
                if info["global_shape"] != e["global_shape"] or info["dtype"] != e["dtype"]:
                    raise CheckpointError(
                        f"checkpoint step {snap.step}: {key!r} is saved as {e['dtype']} {e['global_shape']} by rank "
                        f"{r} but as {info['dtype']} {info['global_shape']} by another rank; not committed")
                box = (tuple(e["offsets"]), tuple(e["shape"]))
                if box in boxes.setdefault(key, set()):
                    continue  # an identical replica box: keep the lowest rank's
                boxes[key].add(box)
                info["chunks"].append({"file": m["bin"]["file"], "byte_offset": e["byte_offset"],
                                       "nbytes": e["nbytes"], "offsets": e["offsets"], "shape": e["shape"],
                                       "crc32": e["crc32"]})
        for key, info in keys.items():
            _check_disjoint(key, info["chunks"])
        # the per-rank files go into the parts that name them, not into the manifest (O(world) entries)
        rank_files = {n: files.pop(n) for n in list(files) if n != atomic.STATE_FILE}
        object_map: dict = {}  # object key -> the lowest rank's file holding it (the one a reader takes)
        for o in obj_files:
            for k in o["keys"]:
                object_map.setdefault(k, o["file"])
        blobs, tensor_refs = key_index.build("index", keys, rank_files, lambda e: {c["file"] for c in e["chunks"]})
        oblobs, object_refs = key_index.build("objects", object_map, rank_files, lambda f: (f,))
        blobs.update(oblobs)
        for name, data in blobs.items():  # sha256 in the top-level index; size in the manifest
            files[name] = {"bytes": atomic.write_bytes(staging / name, data)["bytes"]}
        index = {"format": SHARDS_FORMAT, "index_version": key_index.INDEX_VERSION, "step": snap.step,
                 "world_size": self.world_size,
                 "keys": key_index.front_code(key_index.natural_sorted(keys)), "parts": tensor_refs,
                 "object_keys": key_index.front_code(key_index.natural_sorted(object_map)),
                 "object_parts": object_refs}
        files[INDEX_NAME] = atomic.write_bytes(staging / INDEX_NAME, json.dumps(index, sort_keys=True).encode())
        for r in range(self.world_size):  # folded into the index parts
            (staging / marker_name(r)).unlink()
        manifest = {"format_version": atomic.SHARDS_FORMAT_VERSION, "format": SHARDS_FORMAT, "step": snap.step,
                    "files": files, "meta": snap.meta, "created_unix": time.time()}
        mtext = json.dumps(manifest, indent=1, sort_keys=True)
        atomic.write_bytes(staging / atomic.MANIFEST_NAME, mtext.encode())
        atomic.fsync_files(staging / n for n in [*files, atomic.MANIFEST_NAME])
        atomic.fsync_dir(staging)
        atomic.publish(self.root, staging, atomic.step_dirname(snap.step), self.keep_last)
        return sum(f["bytes"] for f in files.values()) + len(mtext)  # state, index and parts: rank 0's

    def _wait_for_markers(self, staging: Path, snap: _Snapshot) -> dict:
        """rank -> (raw bytes, parsed marker) of the current attempt, for every rank."""
        found: dict = {}
        stale: set = set()
        deadline = time.monotonic() + self.commit_timeout_s
        pause = _POLL_MIN_S
        while True:
            present = set(os.listdir(staging))
            for r in range(self.world_size):
                if r in found or marker_name(r) not in present:
                    continue
                try:
                    raw = (staging / marker_name(r)).read_bytes()
                    m = json.loads(raw)
                except (OSError, ValueError):
                    continue
                if (m.get("format"), m.get("step"), m.get("world_size"), m.get("seq")) == \
                        (SHARDS_FORMAT, snap.step, self.world_size, snap.seq):
                    found[r] = (raw, m)
                    stale.discard(r)
                else:
                    stale.add(r)
            if len(found) == self.world_size:
                return found
            if time.monotonic() >= deadline:
                missing = [r for r in range(self.world_size) if r not in found]
                shown = ", ".join(map(str, missing[:32])) + (" ..." if len(missing) > 32 else "")
                why = f" ({len(stale)} of them hold a marker of another save attempt)" if stale else ""
                raise CheckpointError(
                    f"checkpoint step {snap.step}: no marker from rank(s) {shown}{why} after "
                    f"{self.commit_timeout_s:g} s in {staging}; not committed, `latest` unchanged")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
