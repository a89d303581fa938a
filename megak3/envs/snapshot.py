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
Names are kept as Python's ``os.fsdecode`` strings (undecodable bytes as surrogates, which JSON
escapes), so any byte name round-trips. Every store write is tmp + rename: a worker killed
mid-snapshot leaves no partial object or manifest.

The episode tree belongs to the agent, and the worker that snapshots and restores it may be root. So
nothing here acts on a path through that tree: every operation is relative to an open directory fd
(``openat``-style ``dir_fd=``), one name at a time, with ``O_NOFOLLOW`` (and ``O_DIRECTORY`` for
directories, ``O_NONBLOCK`` for files so a FIFO cannot block), and what was opened is checked with
``fstat`` against what the walk saw. Modes, owners and times are set on open fds (or ``*at`` without
following symlinks); restore writes a file under a new random name created with
``O_CREAT|O_EXCL|O_NOFOLLOW`` and renames it into place. A planted symlink is thus only ever
copied as a symlink, never followed. Walking by fd also stores trees whose paths are longer than
``PATH_MAX``; at most ``FD_WINDOW`` directory fds stay open, deeper ancestors are reopened through
``..`` (checked by device and inode) on the way back up.

Quotas (``StoreLimits``): a snapshot holding more than ``episode_bytes`` (file sizes plus manifest
bytes) or ``episode_entries`` entries is refused with ``SnapshotRefused`` before more is read.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import stat
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, Iterator, List, Optional, Tuple

from megak3.envs.fdpath import remove_at

HASH_CHUNK = 1 << 20
FD_WINDOW = 64                 # directory fds a walk keeps open (the rest are reopened through "..")
TMP_MAX_AGE = 3600             # gc removes store temp files older than this (a killed writer's)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_HEX = frozenset("0123456789abcdef")


class SnapshotRefused(Exception):
    """A tree this store will not hold (over its quota); the message is fit for the model to read."""


@dataclass
class StoreLimits:
    """How much the snapshot store holds (all checked by ``validate``)."""
    episode_bytes: int = 256 << 20      # one snapshot: file sizes (sparse files at full size) + manifest bytes
    episode_entries: int = 100_000      # one snapshot: files, directories and symlinks
    pool_bytes: int = 16 << 30          # the store of a pool in all; past it (after gc) snapshots are refused
    gc_bytes: int = 64 << 20            # the pool collects garbage after this many new store bytes
    keep_last: int = 2                  # snapshots per live episode the pool's gc keeps

    def validate(self) -> "StoreLimits":
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"store_limits.{f.name}={v!r} must be a positive integer")
        return self

    @classmethod
    def from_dict(cls, d: Optional[Dict]) -> "StoreLimits":
        names = {f.name for f in fields(cls)}
        bad = sorted(set(d or {}) - names)
        if bad:
            raise ValueError(f"store_limits.{bad[0]}: no such field (fields: {', '.join(sorted(names))})")
        return cls(**(d or {})).validate()

    def to_dict(self) -> Dict:
        return asdict(self)


@dataclass
class SnapshotStats:
    entries: int = 0
    files_hashed: int = 0        # files read because their stat changed (0 for an unchanged tree)
    bytes_hashed: int = 0
    bytes_written: int = 0       # new object bytes (snapshot) or file bytes rewritten (restore)
    seconds: float = 0.0
    skipped: List[str] = field(default_factory=list)     # fifos, sockets, devices (not stored)


class TreeCache:
    """What a worker knows about one episode directory: rel path -> (stat key, sha256)."""

    def __init__(self):
        self.files: Dict[str, Tuple[Tuple[int, int, int, int], str]] = {}


def _key(st: os.stat_result) -> Tuple[int, int, int, int]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _kind(st: os.stat_result) -> str:
    m = st.st_mode
    return "d" if stat.S_ISDIR(m) else "f" if stat.S_ISREG(m) else "l" if stat.S_ISLNK(m) else "?"


def _same_inode(fd: int, st: os.stat_result, test) -> os.stat_result:
    got = os.fstat(fd)
    if not test(got.st_mode) or (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
        raise OSError(errno.ESTALE, "an entry changed while the store was reading it")
    return got


def open_dir(path: str) -> int:
    """An fd of directory ``path`` (host-chosen: only its last component may not be a symlink)."""
    return os.open(path, _DIR)


def _open_checked(dir_fd: int, name: str, flags: int, st: Optional[os.stat_result], test) -> int:
    """Open ``name`` in ``dir_fd`` with ``flags``; with ``st``, fail unless it is that inode of kind ``test``."""
    fd = os.open(name, flags, dir_fd=dir_fd)
    if st is not None:
        try:
            _same_inode(fd, st, test)
        except OSError:
            os.close(fd)
            raise
    return fd


def _open_dir_at(dir_fd: int, name: str, st: Optional[os.stat_result] = None) -> int:
    return _open_checked(dir_fd, name, _DIR, st, stat.S_ISDIR)


def _open_file_at(dir_fd: int, name: str, st: os.stat_result) -> int:
    """Open regular file ``name`` for reading; fails unless it is the inode ``st`` describes."""
    return _open_checked(dir_fd, name, _FILE, st, stat.S_ISREG)


def _listing(dir_fd: int) -> List[Tuple[str, os.stat_result]]:
    with os.scandir(dir_fd) as it:
        return sorted((e.name, e.stat(follow_symlinks=False)) for e in it)


class _DirPath:
    """The open directories from a root down to the current one (owns the fds, root's included)."""

    def __init__(self, root_fd: int):
        st = os.fstat(root_fd)
        self.fds: List[Optional[int]] = [root_fd]
        self.ids = [(st.st_dev, st.st_ino)]

    @property
    def top(self) -> int:
        return self.fds[-1]

    def push(self, name: str, st: Optional[os.stat_result] = None) -> int:
        fd = _open_dir_at(self.fds[-1], name, st)
        got = os.fstat(fd)
        self.fds.append(fd)
        self.ids.append((got.st_dev, got.st_ino))
        old = len(self.fds) - 1 - FD_WINDOW
        if old >= 0 and self.fds[old] is not None:
            os.close(self.fds[old])
            self.fds[old] = None
        return fd

    def pop(self):
        fd = self.fds.pop()
        self.ids.pop()
        try:
            if self.fds[-1] is None:                   # reopen the parent: ".." is never a symlink
                up = os.open("..", _DIR, dir_fd=fd)
                got = os.fstat(up)
                if (got.st_dev, got.st_ino) != self.ids[-1]:
                    os.close(up)
                    raise OSError(errno.ESTALE, "a directory moved while the store walked the tree")
                self.fds[-1] = up
        finally:
            os.close(fd)

    def close(self):
        for fd in self.fds:
            if fd is not None:
                os.close(fd)
        self.fds = []


def _walk(root_fd: int) -> Iterator[Tuple[str, int, str, os.stat_result]]:
    """(rel path, fd of its directory, name, lstat) of every entry under ``root_fd`` (a dup is used),
    sorted, each directory's entries before the contents of its subdirectories (no recursion)."""
    path = _DirPath(os.dup(root_fd))
    rels, pending = [""], [None]
    try:
        while True:
            if pending[-1] is None:
                fd, rel, subs = path.top, rels[-1], []
                for name, st in _listing(fd):
                    r = f"{rel}/{name}" if rel else name
                    yield r, fd, name, st
                    if stat.S_ISDIR(st.st_mode):
                        subs.append((name, st, r))
                pending[-1] = iter(subs)
            nxt = next(pending[-1], None)
            if nxt is None:
                if len(rels) == 1:
                    return
                path.pop()
                rels.pop()
                pending.pop()
                continue
            path.push(nxt[0], nxt[1])
            rels.append(nxt[2])
            pending.append(None)
    finally:
        path.close()


def _check_manifest(entries) -> Dict[str, list]:
    """{parent rel: [entries]} of a manifest; refuses names that are not single path components."""
    kids: Dict[str, list] = {"": []}
    for e in entries:
        rel, kind, mode, mtime, ref = e
        parent, _, name = rel.rpartition("/")
        ok = name not in ("", ".", "..") and "\0" not in rel and parent in kids and kind in ("d", "f", "l") \
            and isinstance(mode, int) and 0 <= mode <= 0o7777 and isinstance(mtime, int) and isinstance(ref, str)
        if not ok or (kind == "f" and not (len(ref) == 64 and set(ref) <= _HEX)):
            raise ValueError(f"bad manifest entry {e!r}")
        kids[parent].append(e)
        if kind == "d":
            kids[rel] = []
    return kids


class SnapshotStore:
    def __init__(self, root: str, limits: Optional[StoreLimits] = None):
        self.root = os.path.abspath(root)
        self.limits = (limits or StoreLimits()).validate()
        os.makedirs(os.path.join(self.root, "objects"), exist_ok=True)
        os.makedirs(os.path.join(self.root, "snapshots"), exist_ok=True)
        self._objects = None
        self._objects = open_dir(os.path.join(self.root, "objects"))
        self._snapshots = open_dir(os.path.join(self.root, "snapshots"))
        self._subdirs: Dict[str, int] = {}

    def close(self):
        if self._objects is None:
            return
        for fd in [self._objects, self._snapshots, *self._subdirs.values()]:
            os.close(fd)
        self._objects = self._snapshots = None
        self._subdirs = {}

    def __del__(self):
        try:
            self.close()
        except (OSError, AttributeError, TypeError):
            pass

    # ---- objects and manifests (host-owned, but opened by fd all the same) ------------------------
    def _subdir(self, sub: str) -> int:
        """fd of ``objects/<sub>`` (made if missing), kept open."""
        fd = self._subdirs.get(sub)
        if fd is None:
            try:
                os.mkdir(sub, 0o755, dir_fd=self._objects)
            except FileExistsError:
                pass
            fd = self._subdirs[sub] = _open_dir_at(self._objects, sub)
        return fd

    def _has_object(self, digest: str) -> bool:
        try:
            return stat.S_ISREG(os.stat(digest, dir_fd=self._subdir(digest[:2]), follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    @staticmethod
    def _write_new(dir_fd: int, name: str, chunks) -> int:
        """Write ``name`` in ``dir_fd`` atomically (a fresh random temp name, then rename); bytes written."""
        tmp = f".{name}.tmp-{secrets.token_hex(8)}"
        fd, n = os.open(tmp, _NEW, 0o644, dir_fd=dir_fd), 0
        try:
            with open(fd, "wb", closefd=False) as f:
                for c in chunks:
                    f.write(c)
                    n += len(c)
            os.close(fd)
            fd = -1
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            os.unlink(tmp, dir_fd=dir_fd)
            raise
        return n

    def _hash_and_store(self, dir_fd: int, name: str, st: os.stat_result, stats: SnapshotStats,
                        new_bytes: Optional[int]) -> str:
        fd = _open_file_at(dir_fd, name, st)
        with open(fd, "rb", buffering=0) as f:
            data = f.read(st.st_size + 1) if st.st_size <= HASH_CHUNK else None
            h = hashlib.sha256()
            if data is not None:
                h.update(data)
            else:
                for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
                    h.update(chunk)
            digest = h.hexdigest()
            stats.files_hashed += 1
            stats.bytes_hashed += st.st_size
            if not self._has_object(digest):
                if new_bytes is not None and stats.bytes_written + st.st_size > new_bytes:
                    raise SnapshotRefused("the environment's snapshot store is full: only turns that add no new "
                                          "file contents are saved now")
                if data is None:
                    f.seek(0)
                    chunks = iter(lambda: f.read(HASH_CHUNK), b"")
                else:
                    chunks = [data]
                stats.bytes_written += self._write_new(self._subdir(digest[:2]), digest, chunks)
        return digest

    def _manifest_name(self, snap_id: str) -> str:
        if not (isinstance(snap_id, str) and len(snap_id) == 20 and set(snap_id) <= _HEX):
            raise KeyError(f"bad snapshot id {snap_id!r}")
        return snap_id + ".json"

    def has(self, snap_id: str) -> bool:
        try:
            os.stat(self._manifest_name(snap_id), dir_fd=self._snapshots, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    # ---- snapshot ---------------------------------------------------------------------------------
    def snapshot(self, workdir: str, cache: TreeCache, state: Dict, new_bytes: Optional[int] = None
                 ) -> Tuple[str, SnapshotStats]:
        """Store ``workdir`` and ``state`` (JSON-serialisable); return (snapshot id, stats).
        ``SnapshotRefused`` when the tree is over ``limits.episode_bytes`` / ``episode_entries``, or
        when it needs more than ``new_bytes`` bytes of new file contents (the manifest is not counted)."""
        t0 = time.perf_counter()
        lim = self.limits
        stats, entries, seen, total, n = SnapshotStats(), [], {}, 0, 0
        root_fd = open_dir(workdir)
        try:
            for rel, dir_fd, name, st in _walk(root_fd):
                n += 1
                total += len(rel) + 40                  # what the entry costs in the manifest
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
                if n > lim.episode_entries:
                    raise SnapshotRefused(f"/work holds more than {lim.episode_entries} entries (the snapshot "
                                          f"limit); delete some")
                if total > lim.episode_bytes:
                    raise SnapshotRefused(f"/work holds more than {lim.episode_bytes} bytes (file sizes, sparse "
                                          f"files counted in full, plus names; the snapshot limit); delete some")
                mode = stat.S_IMODE(st.st_mode)
                if stat.S_ISREG(st.st_mode):
                    k = _key(st)
                    hit = cache.files.get(rel)
                    digest = hit[1] if hit and hit[0] == k and self._has_object(hit[1]) else \
                        self._hash_and_store(dir_fd, name, st, stats, new_bytes)
                    seen[rel] = (k, digest)
                    entries.append([rel, "f", mode, st.st_mtime_ns, digest])
                elif stat.S_ISDIR(st.st_mode):
                    entries.append([rel, "d", mode, st.st_mtime_ns, ""])
                elif stat.S_ISLNK(st.st_mode):
                    entries.append([rel, "l", 0, st.st_mtime_ns, os.readlink(name, dir_fd=dir_fd)])
                else:
                    stats.skipped.append(rel)
            root_st = os.fstat(root_fd)
        finally:
            os.close(root_fd)
        cache.files = seen
        manifest = json.dumps({"entries": entries, "root": [stat.S_IMODE(root_st.st_mode), root_st.st_mtime_ns],
                               "state": state}, sort_keys=True).encode()
        snap_id = hashlib.sha256(manifest).hexdigest()[:20]
        if not self.has(snap_id):
            stats.bytes_written += self._write_new(self._snapshots, self._manifest_name(snap_id), [manifest])
        stats.entries = len(entries)
        stats.seconds = time.perf_counter() - t0
        return snap_id, stats

    def manifest(self, snap_id: str) -> Dict:
        try:
            fd = os.open(self._manifest_name(snap_id), _FILE, dir_fd=self._snapshots)
        except FileNotFoundError:
            raise KeyError(f"no snapshot {snap_id} in {self.root}") from None
        with open(fd, "rb") as f:
            return json.loads(f.read())

    def state(self, snap_id: str) -> Dict:
        return self.manifest(snap_id)["state"]

    # ---- restore ----------------------------------------------------------------------------------
    def restore(self, snap_id: str, workdir: str, cache: TreeCache, uid: Optional[int] = None
                ) -> Tuple[Dict, SnapshotStats]:
        """Make ``workdir`` exactly the snapshot's tree; return (its episode state, stats). New entries
        are owned by ``uid`` (when given)."""
        t0 = time.perf_counter()
        man = self.manifest(snap_id)
        kids = _check_manifest(man["entries"])
        stats = SnapshotStats(entries=len(man["entries"]))
        new_cache: Dict[str, Tuple[Tuple[int, int, int, int], str]] = {}
        root_mode, root_mtime = man["root"]
        path = _DirPath(open_dir(workdir))
        try:
            # one frame per open directory: (its manifest entry's mode and mtime, subdirectories still to do)
            frames = [(root_mode, root_mtime, iter(self._sync_dir(path.top, kids[""], cache, new_cache, uid,
                                                                  stats)))]
            while frames:
                e = next(frames[-1][2], None)
                if e is not None:
                    path.push(e[0].rpartition("/")[2])
                    frames.append((e[2], e[3], iter(self._sync_dir(path.top, kids[e[0]], cache, new_cache,
                                                                    uid, stats))))
                    continue
                mode, mtime, _ = frames.pop()          # children done: the directory's own mode and mtime
                os.fchmod(path.top, mode)
                os.utime(path.top, ns=(mtime, mtime))
                if frames:
                    path.pop()
        finally:
            path.close()
        cache.files = new_cache
        stats.seconds = time.perf_counter() - t0
        return man["state"], stats

    def _sync_dir(self, fd: int, want: list, cache: TreeCache, new_cache: Dict, uid: Optional[int],
                  stats: SnapshotStats) -> list:
        """Make directory ``fd``'s own entries those of ``want``; return its subdirectory entries."""
        by_name = {e[0].rpartition("/")[2]: e for e in want}
        have = {}
        for name, st in _listing(fd):                   # remove what the snapshot lacks or holds as another kind
            w = by_name.get(name)
            if w is None or w[1] != _kind(st):
                remove_at(fd, name)
            else:
                have[name] = st
        subdirs = []
        for rel, kind, mode, mtime, ref in want:
            name = rel.rpartition("/")[2]
            st = have.get(name)
            if kind == "d":
                if st is None:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    if uid is not None:
                        os.chown(name, uid, uid, dir_fd=fd, follow_symlinks=False)
                subdirs.append([rel, kind, mode, mtime, ref])
            elif kind == "l":
                if st is not None and os.readlink(name, dir_fd=fd) == ref:
                    if st.st_mtime_ns == mtime:
                        continue
                else:
                    if st is not None:
                        os.unlink(name, dir_fd=fd)
                    os.symlink(ref, name, dir_fd=fd)
                    if uid is not None:
                        os.chown(name, uid, uid, dir_fd=fd, follow_symlinks=False)
                os.utime(name, ns=(mtime, mtime), dir_fd=fd, follow_symlinks=False)
            else:
                hit = cache.files.get(rel)
                if st is not None and hit is not None and hit[0] == _key(st) and hit[1] == ref and st.st_nlink == 1:
                    if stat.S_IMODE(st.st_mode) != mode or st.st_mtime_ns != mtime:
                        ffd = _open_file_at(fd, name, st)
                        try:
                            os.fchmod(ffd, mode)
                            os.utime(ffd, ns=(mtime, mtime))
                            st = os.fstat(ffd)
                        finally:
                            os.close(ffd)
                    new_cache[rel] = (_key(st), ref)
                    continue
                new_cache[rel] = (self._write_file_at(fd, name, ref, mode, mtime, uid, stats), ref)
        return subdirs

    def _write_file_at(self, fd: int, name: str, digest: str, mode: int, mtime: int, uid: Optional[int],
                       stats: SnapshotStats) -> Tuple[int, int, int, int]:
        """Replace ``name`` in ``fd`` by object ``digest``: written under a fresh random name (O_EXCL,
        O_NOFOLLOW), owner/mode/mtime set on the fd, renamed into place. Returns the new file's stat key."""
        src = os.open(digest, _FILE, dir_fd=self._subdir(digest[:2]))
        tmp = f".megak3-restore-{secrets.token_hex(8)}"
        try:
            dst = os.open(tmp, _NEW, 0o600, dir_fd=fd)
            try:
                size = os.fstat(src).st_size
                _copy(src, dst, size)
                stats.bytes_written += size
                if uid is not None:
                    os.fchown(dst, uid, uid)
                os.fchmod(dst, mode)
                os.utime(dst, ns=(mtime, mtime))
            finally:
                os.close(dst)
            os.rename(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=fd)
            except OSError:
                pass
            raise
        finally:
            os.close(src)
        return _key(os.stat(name, dir_fd=fd, follow_symlinks=False))

    # ---- garbage ----------------------------------------------------------------------------------
    def gc(self, keep: List[str]) -> int:
        """Delete manifests not in ``keep`` and objects no kept manifest names; return bytes freed.
        A kept id the store does not hold is ignored."""
        live, freed = set(), 0
        keep_files = set()
        for snap_id in keep:
            try:
                live.update(e[4] for e in self.manifest(snap_id)["entries"] if e[1] == "f")
                keep_files.add(self._manifest_name(snap_id))
            except KeyError:
                continue
        now = time.time()
        for name, st in _listing(self._snapshots):
            if name not in keep_files and (".tmp-" not in name or now - st.st_mtime > TMP_MAX_AGE):
                freed += st.st_size
                os.unlink(name, dir_fd=self._snapshots)
        for sub, sst in _listing(self._objects):
            if not stat.S_ISDIR(sst.st_mode):
                continue
            sub_fd = self._subdir(sub)
            for name, st in _listing(sub_fd):
                if name not in live and (".tmp-" not in name or now - st.st_mtime > TMP_MAX_AGE):
                    freed += st.st_size
                    os.unlink(name, dir_fd=sub_fd)
        return freed

    def disk_bytes(self) -> int:
        """Bytes of every object and manifest in the store (file sizes)."""
        total = sum(st.st_size for _, st in _listing(self._snapshots))
        for sub, sst in _listing(self._objects):
            if stat.S_ISDIR(sst.st_mode):
                total += sum(st.st_size for _, st in _listing(self._subdir(sub)))
        return total


def _copy(src: int, dst: int, size: int):
    """Copy ``size`` bytes from fd ``src`` to fd ``dst`` (in-kernel where it can)."""
    off = 0
    try:
        while off < size:
            n = os.sendfile(dst, src, off, size - off)
            if n == 0:
                break
            off += n
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS) or off:
            raise
        while True:
            chunk = os.read(src, HASH_CHUNK)
            if not chunk:
                break
            os.write(dst, chunk)


def tree_digest(workdir: str, mtimes: bool = True) -> str:
    """sha256 over every entry's path, kind, mode, mtime (unless ``mtimes=False``) and bytes/target."""
    h = hashlib.sha256()
    root_fd = open_dir(workdir)
    try:
        for rel, dir_fd, name, st in _walk(root_fd):
            mtime = st.st_mtime_ns if mtimes else 0
            h.update(os.fsencode(rel) + f"\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode)}\0{mtime}\0".encode())
            if stat.S_ISREG(st.st_mode):
                fh = hashlib.sha256()
                with open(_open_file_at(dir_fd, name, st), "rb", buffering=0) as f:
                    for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
                        fh.update(chunk)
                h.update(fh.digest())
            elif stat.S_ISLNK(st.st_mode):
                h.update(os.fsencode(os.readlink(name, dir_fd=dir_fd)))
    finally:
        os.close(root_fd)
    return h.hexdigest()
