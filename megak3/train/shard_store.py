"""Per-shard checkpoints: every rank writes only its own shards; any layout reads only what it needs.

Data model. A checkpoint holds named global tensors (``"model/layers.0.mlp.experts.w1"``,
``"optim/layers.0.mlp.experts.w1/momentum_buffer"``, ...). A rank saves, per key, one box of the
global tensor: a :class:`ShardEntry` with the local tensor, the global shape and the offsets of the
box (``[offsets, offsets + local.shape)``; any dim may be sliced; the whole tensor is a replicated
one). The caller passes each distinct box from one rank only (e.g. the data-parallel rank 0 of its
replicas); identical duplicate boxes from several ranks are tolerated (the lowest rank's is kept),
partially overlapping boxes are refused at commit.

On disk (one directory per step, next to the old-format checkpoints of
:mod:`megak3.train.checkpoint`, whose ``latest`` / ``find_latest`` / ``validate_checkpoint`` and
pruning it shares)::

    root/
      .tmp-step_00000100/          staging dir, same name on every rank (created with exist_ok)
      step_00000100/               after the commit (the staging dir renamed)
        shard_00000.bin            rank 0's tensor bytes: each entry's C-contiguous bytes back to back
                                   in sorted key order, no padding (absent when the rank has no entries)
        shard_00000.obj.pt         torch.save of rank 0's ``objects`` (absent when it has none)
        shard_00000.json           rank 0's marker, written LAST by that rank (temp file + os.replace),
                                   folded into the index parts and removed at the commit:
                                   {"format", "rank", "world_size", "step", "seq",
                                    "bin": {"file", "bytes"} | null,
                                    "objects": {"file", "keys", "bytes", "sha256"} | null,
                                    "entries": {key: {"global_shape", "offsets", "shape", "dtype",
                                                      "byte_offset", "nbytes", "crc32"}}}
        shard_00001.* ...          the same for every rank
        state.pt                   torch.save of ``common`` (rank 0)
        index_00000.json ...       tensor index parts (:mod:`.shard_index`), one per key group (a decoder
                                   layer's ``model/layers.N`` keys, ``optim/layers.N``, a top-level
                                   module): {"format", "entries": {key: {"global_shape", "dtype",
                                   "chunks": [{"file", "byte_offset", "nbytes", "offsets", "shape",
                                   "crc32"}]}}, "files": {payload file: {"bytes"}}}
        objects_00000.json ...     object index parts: {"format", "entries": {object key: the lowest
                                   rank's file holding it}, "files": {file: {"bytes", "sha256"}}}
        index.json                 {"format", "index_version": 2, "step", "world_size",
                                    "keys" / "object_keys": every key, natural order, front-coded,
                                    "parts" / "object_parts": [[group, sha256]] (part i: file
                                    index_0000i.json / objects_0000i.json)}
        manifest.json              checkpoint.py's manifest: "format_version": 2,
                                   "format": "megak3.shards.v1", "step", "meta", "created_unix",
                                   "files": {name: {"bytes"[, "sha256"]}} for state.pt, index.json
                                   (with sha256) and the parts (bytes; their sha256 is in index.json).
                                   The per-rank files are listed in the parts that name them, not
                                   here: no file a reader must read grows with the world size
      latest                       "step_00000100", replaced LAST

``dtype`` is the torch dtype's name (``"float32"``, ``"bfloat16"``, ...); the bytes are the tensor's
own, so every dtype round-trips bit for bit. ``crc32`` is zlib's over the chunk's bytes. ``seq``
counts the ``save()`` calls of the writing :class:`ShardedCheckpointer`; rank 0 accepts only markers
whose ``step``, ``world_size`` and ``seq`` equal its own, so the marker of an earlier failed attempt
at the same step (same staging dir) is not mistaken for the current one.

Commit protocol (no torch.distributed collective anywhere): each rank writes its ``.bin`` and
``.obj.pt``, fsyncs them, then atomically publishes its marker. Rank 0 also writes ``state.pt``,
polls the staging dir until every rank's marker is there (up to ``commit_timeout_s``), builds the
index parts and ``index.json`` from the markers (checking that every key has one dtype and global
shape and that its boxes are disjoint or identical, and that each ``.bin`` has the size its marker
states), removes the markers, writes the manifest, fsyncs, renames the staging dir to
``step_XXXXXXXX`` and replaces ``latest`` (both via :mod:`megak3.train.checkpoint`), then prunes to
``keep_last``. A crash or timeout at any point leaves ``latest`` naming the previous checkpoint.

Stale staging dirs: rank 0 removes every leftover ``.tmp-*`` / ``.old-*`` entry under ``root`` when
the checkpointer is constructed (construct it on every rank before the ranks' first collective so no
save is under way yet), and at each save every leftover except the staging dir of the step being
saved (other ranks may already be writing into it).

Reading (:class:`CheckpointReader`): a box of a key is assembled from the saved chunks that overlap
it with ``os.preadv`` into the destination (or a bounded temporary when the destination region is not
contiguous), one read per contiguous run of the chunk inside the box (maximal runs: the trailing
dims the box spans fully are merged). Only bytes inside the box are read. The crc32 of a chunk is
verified whenever the box covers the whole chunk; partial reads of a chunk are not verified (their
sizes are, via the index parts, when a file is first opened). ``state.pt`` and ``index.json`` are
verified against their manifest sha256 when the reader opens the checkpoint, an index part against
the sha256 in ``index.json`` when a key of its group is first asked for: a rank reads the metadata
of its own keys, not every key's. A checkpoint whose ``index.json`` holds every key's chunks (the
format before parts) is read whole.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import math
import os
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import numpy as np
import torch

from . import checkpoint as ckpt
from . import shard_index
from .checkpoint import CheckpointError

SHARDS_FORMAT = "megak3.shards.v1"
INDEX_NAME = "index.json"
_SLAB_BYTES = 64 << 20  # largest temporary buffer of a read whose destination is not contiguous
_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.2


def _bin_name(rank: int) -> str:
    return f"shard_{rank:05d}.bin"


def _obj_name(rank: int) -> str:
    return f"shard_{rank:05d}.obj.pt"


def _marker_name(rank: int) -> str:
    return f"shard_{rank:05d}.json"


def _staging_name(step: int) -> str:
    return f".tmp-{ckpt.step_dirname(step)}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in a checkpoint index")
    return dt


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array sharing its memory."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _write_bytes_durably(path: Path, data) -> dict:
    """Write ``data`` to ``path``, fsync; returns its manifest entry (bytes + sha256)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _fsync_dir_if_present(path: Path) -> None:
    """fsync a directory; a missing one was already renamed (and fsynced) by rank 0's commit."""
    try:
        ckpt._fsync_dir(path)
    except FileNotFoundError:
        pass


def _check_step(step) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint step={step!r} must be a non-negative int")
    return step


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
    prunes older complete checkpoints after each commit (as :func:`checkpoint.save_checkpoint`).
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
            ckpt._remove_stale(self.root)

    # ------------------------------------------------------------------------------------ save
    def save(self, step: int, entries: dict, objects: Optional[dict] = None,
             common: Optional[dict] = None, meta: Optional[dict] = None) -> None:
        """Save this rank's ``entries`` (key -> :class:`ShardEntry`) as part of checkpoint ``step``.

        Every rank calls it for the same step. ``objects``: a small per-rank dict saved with this
        rank's marker. ``common`` (saved as ``state.pt``) and ``meta`` (JSON-serialisable, stored in the
        manifest) are used on rank 0 and ignored on the other ranks. ``objects`` and ``common`` may
        hold only tensors, plain containers and primitives (checked by :func:`checkpoint.safe_dumps`).

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
        step = _check_step(step)
        layout = self._check_entries(step, entries)
        if not self.async_save:  # async: the writer thread checks the host copies before writing
            self._check_finite(step, {k: e.tensor for k, e in entries.items()})
        objects_bytes = None
        if objects:
            objects_bytes = ckpt.safe_dumps(dict(objects), "objects")
        common_bytes, meta_d = None, {}
        if self.rank == 0:
            meta_d = dict(meta or {})
            try:
                json.dumps(meta_d)
            except (TypeError, ValueError) as e:
                raise ValueError(f"checkpoint meta must be JSON-serialisable ({e})") from e
            common_bytes = ckpt.safe_dumps(common if common is not None else {}, "common")
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
            layout[key] = (gshape, offs, shape, _dtype_name(e.tensor.dtype))
        return layout

    @staticmethod
    def _check_finite(step: int, tensors: dict) -> None:
        """CheckpointError naming the first floating tensor that holds a NaN/inf (key -> tensor)."""
        for key in sorted(tensors):
            t = tensors[key].detach()
            if (t.is_floating_point() or t.is_complex()) and t.numel():
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
        staging = self.root / _staging_name(snap.step)
        if self.rank == 0:
            ckpt._remove_stale(self.root, keep=(staging.name,))
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
        for name in (_marker_name(r), _bin_name(r), _obj_name(r)):  # an earlier attempt's files
            (staging / name).unlink(missing_ok=True)
        entries, bin_entry, obj_entry, written = {}, None, None, 0
        if snap.tensors:
            pos = 0
            with open(staging / _bin_name(r), "wb") as f:
                for key, t in snap.tensors.items():
                    data = _byte_view(t)
                    f.write(memoryview(data))
                    gshape, offs, shape, dtype = snap.layout[key]
                    entries[key] = {"global_shape": list(gshape), "offsets": list(offs), "shape": list(shape),
                                    "dtype": dtype, "byte_offset": pos, "nbytes": int(data.nbytes),
                                    "crc32": zlib.crc32(memoryview(data))}
                    pos += int(data.nbytes)
                f.flush()
                os.fsync(f.fileno())
            bin_entry = {"file": _bin_name(r), "bytes": pos}
            written += pos
        if snap.objects_bytes is not None:
            obj_entry = {"file": _obj_name(r), "keys": snap.object_keys,
                         **_write_bytes_durably(staging / _obj_name(r), snap.objects_bytes)}
            written += obj_entry["bytes"]
        marker = {"format": SHARDS_FORMAT, "rank": r, "world_size": self.world_size, "step": snap.step,
                  "seq": snap.seq, "bin": bin_entry, "objects": obj_entry, "entries": entries}
        text = json.dumps(marker, sort_keys=True).encode()
        tmp = staging / f".{_marker_name(r)}.tmp"
        _write_bytes_durably(tmp, text)
        os.replace(tmp, staging / _marker_name(r))  # this rank is done
        _fsync_dir_if_present(staging)
        return written + len(text)

    def _commit(self, staging: Path, snap: _Snapshot) -> int:
        files = {ckpt.STATE_FILE: _write_bytes_durably(staging / ckpt.STATE_FILE, snap.common_bytes)}
        markers = self._wait_for_markers(staging, snap)
        keys: dict = {}
        boxes: dict = {}  # key -> {(offsets, shape)} already indexed
        obj_files = []
        for r in range(self.world_size):
            raw, m = markers[r]
            files[_marker_name(r)] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
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
        rank_files = {n: files.pop(n) for n in list(files) if n != ckpt.STATE_FILE}
        object_map: dict = {}  # object key -> the lowest rank's file holding it (the one a reader takes)
        for o in obj_files:
            for k in o["keys"]:
                object_map.setdefault(k, o["file"])
        blobs, tensor_refs = shard_index.build("index", keys, rank_files, lambda e: {c["file"] for c in e["chunks"]})
        oblobs, object_refs = shard_index.build("objects", object_map, rank_files, lambda f: (f,))
        blobs.update(oblobs)
        for name, data in blobs.items():  # sha256 in the top-level index; size in the manifest
            files[name] = {"bytes": _write_bytes_durably(staging / name, data)["bytes"]}
        index = {"format": SHARDS_FORMAT, "index_version": shard_index.INDEX_VERSION, "step": snap.step,
                 "world_size": self.world_size,
                 "keys": shard_index.front_code(shard_index.natural_sorted(keys)), "parts": tensor_refs,
                 "object_keys": shard_index.front_code(shard_index.natural_sorted(object_map)),
                 "object_parts": object_refs}
        files[INDEX_NAME] = _write_bytes_durably(staging / INDEX_NAME, json.dumps(index, sort_keys=True).encode())
        for r in range(self.world_size):  # folded into the index parts
            (staging / _marker_name(r)).unlink()
        manifest = {"format_version": ckpt.SHARDS_FORMAT_VERSION, "format": SHARDS_FORMAT, "step": snap.step,
                    "files": files, "meta": snap.meta, "created_unix": time.time()}
        mtext = json.dumps(manifest, indent=1, sort_keys=True)
        ckpt._write_text_durably(staging / ckpt.MANIFEST_NAME, mtext)
        ckpt._fsync_dir(staging)
        ckpt._publish(self.root, staging, ckpt.step_dirname(snap.step), self.keep_last)
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
                if r in found or _marker_name(r) not in present:
                    continue
                try:
                    raw = (staging / _marker_name(r)).read_bytes()
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


class _KeyInfo:
    __slots__ = ("global_shape", "dtype", "itemsize", "chunks")

    def __init__(self, global_shape, dtype, chunks):
        self.global_shape, self.dtype, self.chunks = global_shape, dtype, chunks
        self.itemsize = _itemsize(dtype)


class CheckpointReader:
    """Reads boxes of the tensors of a committed per-shard checkpoint directory (``step_XXXXXXXX``).

    Opening checks the manifest (format, every file it lists present with its recorded size),
    verifies ``state.pt`` and the top-level ``index.json`` against their sha256 and decodes the key
    lists. An index part is read the first time a key in its range is asked for (:meth:`read`,
    :meth:`global_shape`, :meth:`dtype`, :meth:`chunks`, :meth:`objects`), verified against the sha256
    the top-level index records, and every chunk's byte range checked against its file's recorded
    size; a payload file is checked against that size when first opened. An index in the format
    before parts (one ``index.json`` holding every key) is read whole at opening. ``common`` is the
    unpickled ``state.pt`` (loaded with ``weights_only=True``), ``meta`` the manifest's meta,
    ``step`` its step. ``bytes_read`` counts tensor payload bytes read by :meth:`read`,
    ``meta_bytes_read`` the bytes of the manifest, index, index parts, state and objects files read.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.bytes_read = 0
        self.meta_bytes_read = 0
        self._fds: dict = {}
        manifest = ckpt.read_manifest(self.path)
        if manifest.get("format") != SHARDS_FORMAT:
            raise CheckpointError(f"checkpoint {path} is in the old per-rank part format; convert it with: "
                                  f"python tools/convert_checkpoint.py {path} <out_root>")
        ok, why = ckpt.validate_checkpoint(self.path, verify_checksums=False)
        if not ok:
            raise CheckpointError(f"cannot read checkpoint {self.path}: {why}")
        self.meta_bytes_read += (self.path / ckpt.MANIFEST_NAME).stat().st_size
        self._files = manifest["files"]
        self.step: int = manifest["step"]
        self.meta: dict = manifest.get("meta") or {}
        index = json.loads(self._read_verified(INDEX_NAME))
        self.common: dict = self._load_verified(ckpt.STATE_FILE)
        self._keys: dict = {}         # key -> _KeyInfo, for the parts read so far
        self._sizes: dict = {}        # payload / objects file -> {"bytes"[, "sha256"]}, from the parts read
        self._loaded: set = set()     # part files read
        if isinstance(index.get("keys"), dict):  # one index.json with every key (before index parts)
            self._parts = None
            self._sizes = self._files
            self._key_set = set(index["keys"])
            self._add_keys(index["keys"], INDEX_NAME)
            # [{"file", "keys"}] by rank; a plain file name (an index written before key lists): keys unknown
            self._object_files = [o if isinstance(o, dict) else {"file": o, "keys": None}
                                  for o in index.get("objects", [])]
            return
        if index.get("index_version") != shard_index.INDEX_VERSION:
            raise CheckpointError(f"checkpoint {self.path}: index.json has index_version="
                                  f"{index.get('index_version')!r}; this code reads {shard_index.INDEX_VERSION}")
        self._key_set = set(shard_index.front_decode(index["keys"]))
        self._parts = shard_index.PartLookup("index", index["parts"])
        self._object_key_set = set(shard_index.front_decode(index["object_keys"]))
        self._object_parts = shard_index.PartLookup("objects", index["object_parts"])
        self._object_map: dict = {}   # object key -> the lowest rank's file holding it, parts read so far

    def _read_verified(self, name: str, entry: Optional[dict] = None) -> bytes:
        """The bytes of ``name``, checked against ``entry`` (default: its manifest entry)."""
        entry = self._files.get(name) if entry is None else entry
        if entry is None:
            raise CheckpointError(f"checkpoint {self.path}: manifest does not list {name}")
        data = (self.path / name).read_bytes()
        self.meta_bytes_read += len(data)
        if "sha256" in entry and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CheckpointError(f"checkpoint {self.path}: {name} fails its sha256 check (corrupt)")
        return data

    def _load_verified(self, name: str, entry: Optional[dict] = None):
        """``name`` verified (see :meth:`_read_verified`), then loaded with :func:`checkpoint.safe_load`."""
        return ckpt.safe_load(self._read_verified(name, entry), self.path / name)

    def _read_part(self, ref) -> dict:
        """The entries of an index part ``ref = (file, {"sha256"})`` not read yet (else {}), verified
        against the top-level index; records the files it lists."""
        name, entry = ref
        if name in self._loaded:
            return {}
        if name not in self._files:
            raise CheckpointError(f"checkpoint {self.path}: manifest does not list {name}")
        body = json.loads(self._read_verified(name, entry))
        self._loaded.add(name)
        self._sizes.update(body["files"])
        return body["entries"]

    def _add_keys(self, entries: dict, where: str) -> None:
        for key, info in entries.items():
            chunks = []
            for c in info["chunks"]:
                size = self._sizes.get(c["file"], {}).get("bytes")
                if size is None or c["byte_offset"] + c["nbytes"] > size:
                    raise CheckpointError(f"checkpoint {self.path}: {key!r} has a chunk outside {c['file']} "
                                          f"(in {where})")
                chunks.append((tuple(c["offsets"]), tuple(c["shape"]), c["file"], int(c["byte_offset"]),
                               int(c["nbytes"]), int(c["crc32"])))
            self._keys[key] = _KeyInfo(tuple(info["global_shape"]), _dtype_of(info["dtype"]), chunks)

    # ---------------------------------------------------------------------------------- lookup
    def keys(self) -> list:
        """Every saved key, sorted (from the top-level index: no part is read)."""
        return sorted(self._key_set)

    def _info(self, key: str) -> _KeyInfo:
        info = self._keys.get(key)
        if info is not None:
            return info
        if key not in self._key_set:
            raise CheckpointError(f"checkpoint {self.path} holds no tensor {key!r}")
        ref = self._parts.part_of(key)
        if ref is not None:
            self._add_keys(self._read_part(ref), ref[0])
        try:
            return self._keys[key]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.path}: {key!r} is listed in index.json but in no index part "
                                  "(corrupt index)") from None

    def global_shape(self, key) -> tuple:
        return self._info(key).global_shape

    def dtype(self, key) -> torch.dtype:
        return self._info(key).dtype

    def chunks(self, key) -> list:
        """The saved chunks of ``key``: ``[{"file", "byte_offset", "nbytes", "offsets", "shape",
        "crc32"}]`` as the index records them."""
        return [{"offsets": list(c[0]), "shape": list(c[1]), "file": c[2], "byte_offset": c[3], "nbytes": c[4],
                 "crc32": c[5]} for c in self._info(key).chunks]

    def objects(self, keys: Optional[Iterable[str]] = None) -> dict:
        """The union of the saved ``objects`` dicts, ranks in ascending order; a key already taken by
        a lower rank is kept (loaded with ``weights_only=True``). With ``keys``, only the index parts
        and files that hold one of them are read, and only those keys are returned: a rank resuming
        reads the objects it needs, not every rank's."""
        if self._parts is None:
            return self._objects_single_index(keys)
        want = set(self._object_key_set if keys is None else keys) & self._object_key_set
        for k in want:
            ref = self._object_parts.part_of(k)
            if ref is not None:
                self._object_map.update(self._read_part(ref))
        by_file: dict = {}  # the lowest rank's file per key
        for k in want:
            name = self._object_map.get(k)
            if name is None:
                raise CheckpointError(f"checkpoint {self.path}: object key {k!r} is listed in index.json but in "
                                      "no index part (corrupt index)")
            by_file.setdefault(name, []).append(k)
        out: dict = {}
        for name in sorted(by_file):
            entry = self._sizes.get(name)
            if entry is None:
                raise CheckpointError(f"checkpoint {self.path}: no index part lists {name}")
            d = self._load_verified(name, entry)
            for k in by_file[name]:
                if k not in d:
                    raise CheckpointError(f"checkpoint {self.path}: {name} lacks object {k!r} its index lists")
                out[k] = d[k]
        return out

    def _objects_single_index(self, keys) -> dict:
        want = None if keys is None else set(keys)
        files = self._object_files
        if want is not None:  # per key the lowest rank's file that lists it (unlisted: must be read)
            first: dict = {}
            for i, o in enumerate(files):
                for k in (want if o["keys"] is None else want.intersection(o["keys"])):
                    first.setdefault(k, i)
            files = [files[i] for i in sorted(set(first.values()))]
        out: dict = {}
        for o in files:
            for k, v in self._load_verified(o["file"]).items():
                if want is None or k in want:
                    out.setdefault(k, v)
        return out

    def object_keys(self) -> Optional[set]:
        """Every saved object key, from the index alone (no object file or part is read); None for an
        index written before key lists."""
        if self._parts is not None:
            return set(self._object_key_set)
        if any(o["keys"] is None for o in self._object_files):
            return None
        return {k for o in self._object_files for k in o["keys"]}

    def verify(self) -> None:
        """Check the whole checkpoint: read every index part, then every payload and objects file's size
        and every objects file's sha256 (every rank's files: O(world) work, for tools, not resuming).
        Raises CheckpointError naming the first problem."""
        if self._parts is not None:
            for ref in self._parts.all():
                self._add_keys(self._read_part(ref), ref[0])
            for ref in self._object_parts.all():
                self._object_map.update(self._read_part(ref))
        for name, entry in sorted(self._sizes.items()):
            fpath = self.path / name
            size = fpath.stat().st_size if fpath.is_file() else None
            if size != entry.get("bytes"):
                raise CheckpointError(f"checkpoint {self.path}: {name} has {size} bytes, the index says "
                                      f"{entry.get('bytes')} (truncated?)")
            if "sha256" in entry and not name.endswith(".json"):
                self._read_verified(name, entry)

    # ------------------------------------------------------------------------------------ read
    def read(self, key, offsets, shape, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The box ``[offsets, offsets + shape)`` of the global tensor ``key``, assembled from the saved
        chunks that overlap it, reading only the bytes inside the box (one ``os.preadv`` per
        contiguous run of a chunk inside the box). A chunk lying wholly inside the box has its crc32
        verified. With ``out`` (of shape ``shape``) the box is written into it (cast to its dtype,
        copied to its device) and ``out`` is returned; otherwise a new CPU tensor of the saved dtype.

        Raises CheckpointError naming the key if it is unknown, if the saved chunks do not cover
        the box, on a crc mismatch or a short read.
        """
        info = self._info(key)
        gshape, nd, isz = info.global_shape, len(info.global_shape), info.itemsize
        offsets = tuple(int(o) for o in offsets)
        shape = tuple(int(s) for s in shape)
        if len(offsets) != nd or len(shape) != nd or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, shape, gshape)):
            raise ValueError(f"checkpoint read of {key!r}: box offsets={offsets} shape={shape} does not lie "
                             f"inside global_shape={gshape}")
        if out is not None and tuple(out.shape) != shape:
            raise ValueError(f"checkpoint read of {key!r}: out has shape {tuple(out.shape)}, the box {shape}")
        direct = out is not None and out.device.type == "cpu" and out.dtype == info.dtype and out.is_contiguous()
        buf = out if direct else torch.empty(shape, dtype=info.dtype)
        volume = math.prod(shape)
        if volume:
            parts, covered = [], 0
            for ch in info.chunks:
                c_off, c_shape = ch[0], ch[1]
                lo = tuple(max(o, co) for o, co in zip(offsets, c_off))
                hi = tuple(min(o + s, co + cs) for o, s, co, cs in zip(offsets, shape, c_off, c_shape))
                if all(h > l for l, h in zip(lo, hi)):
                    parts.append((ch, lo, hi))
                    covered += math.prod(h - l for l, h in zip(lo, hi))
            if covered != volume:  # chunks are disjoint (checked at commit), so volumes add up
                raise CheckpointError(f"checkpoint {self.path}: the saved chunks of {key!r} cover {covered} of the "
                                      f"{volume} elements of box offsets={offsets} shape={shape}")
            dst = _byte_view(buf)
            for ch, lo, hi in parts:
                self._copy_chunk_region(key, ch, lo, hi, offsets, shape, isz, dst)
        if out is not None and not direct:
            out.copy_(buf)
            return out
        return buf

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            try:
                fd = os.open(self.path / name, os.O_RDONLY)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {self.path}: {name} is missing") from None
            size, want = os.fstat(fd).st_size, self._sizes[name]["bytes"]
            if size != want:
                os.close(fd)
                raise CheckpointError(f"checkpoint {self.path}: {name} has {size} bytes, the index says {want} "
                                      "(truncated?)")
            self._fds[name] = fd
        return fd

    def _pread_into(self, key: str, fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(f"checkpoint {self.path}: short read of {key!r} (file truncated?)")
            done += n
        self.bytes_read += done

    def _copy_chunk_region(self, key, ch, lo, hi, box_off, box_shape, isz, dst: np.ndarray) -> None:
        c_off, c_shape, fname, byte_offset, nbytes, crc_expected = ch
        fd = self._fd(fname)
        nd = len(c_shape)
        whole = lo == c_off and hi == tuple(o + s for o, s in zip(c_off, c_shape))
        crc = 0
        if nd == 0:
            view = memoryview(dst)[:isz]
            self._pread_into(key, fd, view, byte_offset)
            crc = zlib.crc32(view)
        else:
            row_bytes = math.prod(h - l for l, h in zip(lo[1:], hi[1:])) * isz
            step0 = max(1, _SLAB_BYTES // max(row_bytes, 1))
            for a in range(lo[0], hi[0], step0):
                s_lo, s_hi = (a,) + lo[1:], (min(a + step0, hi[0]),) + hi[1:]
                crc = self._copy_slab(key, fd, c_off, c_shape, byte_offset, s_lo, s_hi, box_off, box_shape, isz,
                                      dst, crc if whole else None)
        if whole and crc != crc_expected:
            raise CheckpointError(f"checkpoint {self.path}: chunk offsets={list(c_off)} shape={list(c_shape)} of "
                                  f"{key!r} in {fname} fails its crc32 check (corrupt)")

    def _copy_slab(self, key, fd, c_off, c_shape, byte_offset, lo, hi, box_off, box_shape, isz, dst, crc):
        """Copy the region [lo, hi) (inside one chunk and the box) to its place in ``dst``."""
        nd = len(c_shape)
        ext = [h - l for l, h in zip(lo, hi)]
        # k: the last dim the region does not span fully; dims after k are full, so each run covers
        # [lo_k, hi_k) x everything after k and is contiguous in the chunk's bytes
        k = nd - 1
        while k > 0 and lo[k] == c_off[k] and hi[k] == c_off[k] + c_shape[k]:
            k -= 1
        c_stride = [math.prod(c_shape[j + 1:]) for j in range(nd)]
        run_bytes = ext[k] * c_stride[k] * isz
        total = math.prod(ext) * isz
        # the region is contiguous in the box iff leading dims have extent 1 up to some p and the
        # dims after p span the box fully
        p = next((j for j in range(nd) if ext[j] != 1), nd - 1)
        contiguous = all(ext[j] == box_shape[j] for j in range(p + 1, nd))
        b_stride = [math.prod(box_shape[j + 1:]) for j in range(nd)]
        if contiguous:
            start = sum((lo[j] - box_off[j]) * b_stride[j] for j in range(nd)) * isz
            target = memoryview(dst)[start:start + total]
        else:
            tmp = np.empty(total, dtype=np.uint8)
            target = memoryview(tmp)
        base = byte_offset + (lo[k] - c_off[k]) * c_stride[k] * isz
        pos = 0
        for idx in itertools.product(*(range(lo[j], hi[j]) for j in range(k))):
            off = base + sum((i - c_off[j]) * c_stride[j] for j, i in enumerate(idx)) * isz
            view = target[pos:pos + run_bytes]
            self._pread_into(key, fd, view, off)
            if crc is not None:
                crc = zlib.crc32(view, crc)
            pos += run_bytes
        if not contiguous:
            box_u8 = dst.reshape(*box_shape[:-1], box_shape[-1] * isz)
            sl = tuple(slice(lo[j] - box_off[j], hi[j] - box_off[j]) for j in range(nd - 1)) + (
                slice((lo[-1] - box_off[-1]) * isz, (hi[-1] - box_off[-1]) * isz),)
            box_u8[sl] = tmp.reshape(*ext[:-1], ext[-1] * isz)
        return crc

    def close(self) -> None:
        """Close the payload files opened by :meth:`read`."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
