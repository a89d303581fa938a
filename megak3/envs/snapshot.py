"""Content-addressed snapshots of episode directories (incremental, restored bit-identically).

Store layout under ``root``: ``objects/ab/<sha256>`` (file contents, written once, atomically) and
``snapshots/<id>.json`` (a manifest: every entry's path, kind, mode, mtime and object or symlink
target, plus the episode state; ``id`` is the first 20 hex digits of the manifest's sha256). Taking
a snapshot walks the tree but reads and hashes only files whose (size, mtime, ctime, inode) changed
since this ``TreeCache`` last saw them, and copies only contents the store does not hold yet; so a
repeated snapshot of a mostly unchanged directory costs a ``stat`` per file plus the changed bytes.
``restore`` removes what the manifest lacks, rewrites only files whose contents differ (by rename, so
a hard link elsewhere is never written through) and sets modes and mtimes: afterwards the tree has the
same paths, kinds, bytes, modes, mtimes and symlink targets as when the snapshot was taken. Hard links
inside the tree come back as separate files; sockets, fifos and devices are not stored (``skipped``).
Every store write is tmp + rename: a worker killed mid-snapshot leaves no partial object or manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

HASH_CHUNK = 1 << 20


@dataclass
class SnapshotStats:
    entries: int = 0
    files_hashed: int = 0        # files read because their stat changed (0 for an unchanged tree)
    bytes_hashed: int = 0
    bytes_written: int = 0       # new object bytes (snapshot) or file bytes rewritten (restore)
    seconds: float = 0.0
    skipped: List[str] = field(default_factory=list)


class TreeCache:
    """What a worker knows about one episode directory: rel path -> (stat key, sha256)."""

    def __init__(self):
        self.files: Dict[str, Tuple[Tuple[int, int, int, int], str]] = {}


def _key(st: os.stat_result) -> Tuple[int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _walk(root: str):
    """(rel path, lstat) in sorted pre-order, directories before their contents (no recursion limit)."""
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for e in entries:
            path = f"{rel}/{e.name}" if rel else e.name
            st = e.stat(follow_symlinks=False)
            yield path, st
            if stat.S_ISDIR(st.st_mode):
                subdirs.append(path)
        stack.extend(reversed(subdirs))


class SnapshotStore:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(os.path.join(self.root, "objects"), exist_ok=True)
        os.makedirs(os.path.join(self.root, "snapshots"), exist_ok=True)

    def _obj(self, digest: str) -> str:
        return os.path.join(self.root, "objects", digest[:2], digest)

    def _manifest_path(self, snap_id: str) -> str:
        if not (isinstance(snap_id, str) and len(snap_id) == 20 and all(c in "0123456789abcdef" for c in snap_id)):
            raise KeyError(f"bad snapshot id {snap_id!r}")
        return os.path.join(self.root, "snapshots", snap_id + ".json")

    def _write_atomic(self, path: str, write):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)

    def _hash_and_store(self, path: str, st_size: int, stats: SnapshotStats) -> str:
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            data = f.read(st_size + 1) if st_size <= HASH_CHUNK else None
            if data is not None:
                h.update(data)
            else:
                for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
                    h.update(chunk)
        digest = h.hexdigest()
        stats.files_hashed += 1
        stats.bytes_hashed += st_size
        obj = self._obj(digest)
        if not os.path.exists(obj):
            if data is not None:
                self._write_atomic(obj, lambda f: f.write(data))
            else:
                self._write_atomic(obj, lambda f: shutil.copyfileobj(open(path, "rb"), f, HASH_CHUNK))
            stats.bytes_written += st_size
        return digest

    def snapshot(self, workdir: str, cache: TreeCache, state: Dict) -> Tuple[str, SnapshotStats]:
        """Store ``workdir`` and ``state`` (JSON-serialisable); return (snapshot id, stats)."""
        t0 = time.perf_counter()
        stats, entries, seen = SnapshotStats(), [], {}
        for rel, st in _walk(workdir):
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                k = _key(st)
                hit = cache.files.get(rel)
                digest = hit[1] if hit and hit[0] == k and os.path.exists(self._obj(hit[1])) else \
                    self._hash_and_store(os.path.join(workdir, rel), st.st_size, stats)
                seen[rel] = (k, digest)
                entries.append([rel, "f", mode, st.st_mtime_ns, digest])
            elif stat.S_ISDIR(st.st_mode):
                entries.append([rel, "d", mode, st.st_mtime_ns, ""])
            elif stat.S_ISLNK(st.st_mode):
                entries.append([rel, "l", 0, st.st_mtime_ns, os.readlink(os.path.join(workdir, rel))])
            else:
                stats.skipped.append(rel)
        root_st = os.lstat(workdir)
        cache.files = seen
        manifest = json.dumps({"entries": entries, "root": [stat.S_IMODE(root_st.st_mode), root_st.st_mtime_ns],
                               "state": state}, sort_keys=True).encode()
        snap_id = hashlib.sha256(manifest).hexdigest()[:20]
        path = self._manifest_path(snap_id)
        if not os.path.exists(path):
            self._write_atomic(path, lambda f: f.write(manifest))
            stats.bytes_written += len(manifest)
        stats.entries = len(entries)
        stats.seconds = time.perf_counter() - t0
        return snap_id, stats

    def manifest(self, snap_id: str) -> Dict:
        try:
            with open(self._manifest_path(snap_id), "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            raise KeyError(f"no snapshot {snap_id} in {self.root}") from None

    def state(self, snap_id: str) -> Dict:
        return self.manifest(snap_id)["state"]

    def restore(self, snap_id: str, workdir: str, cache: TreeCache, uid: Optional[int] = None
                ) -> Tuple[Dict, SnapshotStats]:
        """Make ``workdir`` exactly the snapshot's tree; return (its episode state, stats)."""
        t0 = time.perf_counter()
        man = self.manifest(snap_id)
        stats = SnapshotStats(entries=len(man["entries"]))
        want = {e[0]: e for e in man["entries"]}
        have = {rel: st for rel, st in _walk(workdir)}
        # 1. remove what the snapshot lacks or holds as another kind (deepest first)
        for rel in sorted(have, key=lambda r: -r.count("/")):
            w, st = want.get(rel), have[rel]
            kind = "d" if stat.S_ISDIR(st.st_mode) else "l" if stat.S_ISLNK(st.st_mode) else \
                "f" if stat.S_ISREG(st.st_mode) else "?"
            if w is None or w[1] != kind:
                p = os.path.join(workdir, rel)
                os.rmdir(p) if kind == "d" else os.unlink(p)   # deepest first: a directory is empty by now
                have.pop(rel)
        # 2. create directories, files, symlinks in manifest order (parents first)
        new_cache = {}
        for rel, kind, mode, mtime, ref in man["entries"]:
            p = os.path.join(workdir, rel)
            if kind == "d":
                if rel not in have:
                    os.mkdir(p)
                    if uid is not None:
                        os.chown(p, uid, uid)
                os.chmod(p, mode)
            elif kind == "l":
                if rel in have and os.readlink(p) == ref:
                    continue
                if rel in have:
                    os.unlink(p)
                os.symlink(ref, p)
                if uid is not None:
                    os.lchown(p, uid, uid)
            else:
                hit = cache.files.get(rel)
                same = rel in have and hit is not None and hit[0] == _key(have[rel]) and hit[1] == ref \
                    and have[rel].st_nlink == 1
                if not same:
                    tmp = os.path.join(os.path.dirname(p), f".megak3-restore-{os.getpid()}")
                    shutil.copyfile(self._obj(ref), tmp)
                    stats.bytes_written += os.path.getsize(tmp)
                    if uid is not None:
                        os.chown(tmp, uid, uid)
                    os.replace(tmp, p)
                os.chmod(p, mode)
                os.utime(p, ns=(mtime, mtime))
                new_cache[rel] = (_key(os.lstat(p)), ref)
        # 3. mtimes of symlinks and directories last (creating children changed their parents')
        for rel, kind, mode, mtime, ref in reversed(man["entries"]):
            if kind in "dl":
                os.utime(os.path.join(workdir, rel), ns=(mtime, mtime), follow_symlinks=False)
        root_mode, root_mtime = man["root"]
        os.chmod(workdir, root_mode)
        os.utime(workdir, ns=(root_mtime, root_mtime))
        cache.files = new_cache
        stats.seconds = time.perf_counter() - t0
        return man["state"], stats

    def gc(self, keep: List[str]) -> int:
        """Delete manifests not in ``keep`` and objects no kept manifest names; return bytes freed."""
        live, freed = set(), 0
        for snap_id in keep:
            live.update(e[4] for e in self.manifest(snap_id)["entries"] if e[1] == "f")
        keep_files = {s + ".json" for s in keep}
        sdir = os.path.join(self.root, "snapshots")
        for name in os.listdir(sdir):
            if name not in keep_files:
                freed += os.path.getsize(os.path.join(sdir, name))
                os.unlink(os.path.join(sdir, name))
        odir = os.path.join(self.root, "objects")
        for sub in os.listdir(odir):
            for name in os.listdir(os.path.join(odir, sub)):
                if name not in live:
                    freed += os.path.getsize(os.path.join(odir, sub, name))
                    os.unlink(os.path.join(odir, sub, name))
        return freed


def tree_digest(workdir: str, mtimes: bool = True) -> str:
    """sha256 over every entry's path, kind, mode, mtime (unless ``mtimes=False``) and bytes/target."""
    h = hashlib.sha256()
    for rel, st in _walk(workdir):
        p = os.path.join(workdir, rel)
        mtime = st.st_mtime_ns if mtimes else 0
        h.update(os.fsencode(rel) + f"\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode)}\0{mtime}\0".encode())
        if stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        elif stat.S_ISLNK(st.st_mode):
            h.update(os.fsencode(os.readlink(p)))
    return h.hexdigest()
