"""The reader of per-shard checkpoints (format: :mod:`.shard_format`): any layout reads only what it needs.

Reading (:class:`CheckpointReader`): a box of a key is assembled from the saved chunks that overlap
it. The part of a chunk inside the box is a set of runs contiguous in the chunk's bytes (maximal
runs: the trailing dims the box spans fully are merged). A part that is one run, or whose runs are
at least ``_MAPPED_RUN_BYTES`` (64 KiB) long, is read with one ``os.preadv`` per run into the
destination (or a bounded temporary when the destination region is not contiguous). A part of
many shorter runs (a box cutting a chunk's inner dimension: one run per row) is copied in one
strided numpy copy from a read-only ``mmap`` of the chunk's rows into the destination, instead of
one system call per row (measured: 4096 rows of 256 B in 0.06 ms instead of 4.5 ms). Only bytes
inside the box are copied out of a file (``bytes_read``); the kernel pages in whole pages on both
paths. A payload file is checked against its recorded size when first opened; one truncated after
that raises CheckpointError on both paths (a short read; ``mmap`` checks the file's size), except a
truncation during a mapped copy itself, which kills the process with SIGBUS (a committed
checkpoint's files are never rewritten in place). The crc32 of a chunk is verified whenever the box
covers the whole chunk (such a part is one run: always read with ``preadv``); partial reads of a
chunk are not verified (their sizes are, via the index parts, when a file is first opened).
``state.pt`` and ``index.json`` are verified against their manifest sha256 when the reader opens
the checkpoint, an index part against the sha256 in ``index.json`` when a key of its group is first
asked for: a rank reads the metadata of its own keys, not every key's. A checkpoint whose
``index.json`` holds every key's chunks (the format before parts) is read whole.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import mmap
import os
import zlib
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from . import atomic, key_index
from .atomic import CheckpointError
from .safe import safe_load
from .shard_format import INDEX_NAME, SHARDS_FORMAT, byte_view, dtype_of

_SLAB_BYTES = 64 << 20  # largest temporary buffer of a read whose destination is not contiguous
# runs shorter than this, when a chunk's part holds several, are copied from a mapping instead of one
# preadv each: a preadv costs ~1 us of system call and Python, the time to copy ~10 KiB
_MAPPED_RUN_BYTES = 64 << 10


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _split_dim(c_off, c_shape, lo, hi) -> int:
    """The last dim that the region [lo, hi) of a chunk does not span fully (0 if it spans every dim
    after the first): the dims after it are full, so the region is ``prod(hi - lo over dims < k)``
    runs contiguous in the chunk's bytes, each ``[lo_k, hi_k)`` x everything after ``k``."""
    k = len(c_shape) - 1
    while k > 0 and lo[k] == c_off[k] and hi[k] == c_off[k] + c_shape[k]:
        k -= 1
    return k


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
    ``step`` its step. ``bytes_read`` counts the tensor payload bytes :meth:`read` copied out of the
    payload files (the bytes of the boxes asked for), ``meta_bytes_read`` the bytes of the manifest,
    index, index parts, state and objects files read.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.bytes_read = 0
        self.meta_bytes_read = 0
        self._fds: dict = {}
        manifest = atomic.read_manifest(self.path)
        if manifest.get("format") != SHARDS_FORMAT:
            raise CheckpointError(f"checkpoint {path} is in the old per-rank part format; convert it with: "
                                  f"python tools/convert_checkpoint.py {path} <out_root>")
        ok, why = atomic.validate_checkpoint(self.path, verify_checksums=False)
        if not ok:
            raise CheckpointError(f"cannot read checkpoint {self.path}: {why}")
        self.meta_bytes_read += (self.path / atomic.MANIFEST_NAME).stat().st_size
        self._files = manifest["files"]
        self.step: int = manifest["step"]
        self.meta: dict = manifest.get("meta") or {}
        index = json.loads(self._read_verified(INDEX_NAME))
        self.common: dict = self._load_verified(atomic.STATE_FILE)
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
        if index.get("index_version") != key_index.INDEX_VERSION:
            raise CheckpointError(f"checkpoint {self.path}: index.json has index_version="
                                  f"{index.get('index_version')!r}; this code reads {key_index.INDEX_VERSION}")
        self._key_set = set(key_index.front_decode(index["keys"]))
        self._parts = key_index.PartLookup("index", index["parts"])
        self._object_key_set = set(key_index.front_decode(index["object_keys"]))
        self._object_parts = key_index.PartLookup("objects", index["object_parts"])
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
        """``name`` verified (see :meth:`_read_verified`), then loaded with :func:`.safe.safe_load`."""
        return safe_load(self._read_verified(name, entry), self.path / name)

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
            self._keys[key] = _KeyInfo(tuple(info["global_shape"]), dtype_of(info["dtype"]), chunks)

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
        chunks that overlap it, copying only the bytes inside the box out of the files (one
        ``os.preadv`` per contiguous run of a chunk inside the box, or one strided copy from a mapping
        of the chunk when its part is many runs shorter than 64 KiB: see the module docstring). A
        chunk lying wholly inside the box has its crc32 verified. With ``out`` (of shape ``shape``)
        the box is written into it (in place when ``out`` is a contiguous CPU tensor of the saved
        dtype; else through a temporary, cast to its dtype, copied to its device) and ``out`` is
        returned; otherwise a new CPU tensor of the saved dtype.

        Raises CheckpointError naming the key if it is unknown, if the saved chunks do not cover
        the box, on a crc mismatch, a short read or a file that cannot be mapped.
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
            dst = byte_view(buf)
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
            k = _split_dim(c_off, c_shape, lo, hi)
            run_bytes = (hi[k] - lo[k]) * math.prod(c_shape[k + 1:]) * isz
            if math.prod(h - l for l, h in zip(lo[:k], hi[:k])) > 1 and run_bytes < _MAPPED_RUN_BYTES:
                assert not whole  # a whole chunk is one run
                self._copy_mapped(key, fd, ch, lo, hi, box_off, box_shape, isz, dst)
                return
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
        k = _split_dim(c_off, c_shape, lo, hi)
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

    def _copy_mapped(self, key, fd, ch, lo, hi, box_off, box_shape, isz, dst: np.ndarray) -> None:
        """Copy the region [lo, hi) (inside one chunk and the box) to its place in ``dst`` with one
        strided copy from a read-only mapping of the chunk's rows ``[lo_0, hi_0)`` (only the region's
        bytes are copied)."""
        c_off, c_shape, fname, byte_offset = ch[:4]
        nd = len(c_shape)
        row = math.prod(c_shape[1:]) * isz
        start = byte_offset + (lo[0] - c_off[0]) * row
        end = byte_offset + (hi[0] - c_off[0]) * row
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            mm = mmap.mmap(fd, end - base, access=mmap.ACCESS_READ, offset=base)
        except (OSError, ValueError) as e:  # ValueError: the file is shorter than the mapping (truncated?)
            raise CheckpointError(f"checkpoint {self.path}: cannot map {fname} to read {key!r}: {e}") from None
        src = box = None
        try:
            src = np.frombuffer(mm, np.uint8, count=end - start, offset=start - base).reshape(
                hi[0] - lo[0], *c_shape[1:-1], c_shape[-1] * isz)
            src = src[(slice(None),) + tuple(slice(lo[j] - c_off[j], hi[j] - c_off[j]) for j in range(1, nd - 1))
                      + (slice((lo[-1] - c_off[-1]) * isz, (hi[-1] - c_off[-1]) * isz),)]
            box = dst.reshape(*box_shape[:-1], box_shape[-1] * isz)
            box = box[tuple(slice(lo[j] - box_off[j], hi[j] - box_off[j]) for j in range(nd - 1))
                      + (slice((lo[-1] - box_off[-1]) * isz, (hi[-1] - box_off[-1]) * isz),)]
            np.copyto(box, src)
        finally:
            src = box = None  # release the views of the mapping before closing it
            mm.close()
        self.bytes_read += math.prod(h - l for l, h in zip(lo, hi)) * isz

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
