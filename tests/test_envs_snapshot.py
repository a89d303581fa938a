"""Snapshots: restore gives back the exact tree and state; repeated snapshots are incremental."""
import hashlib
import inspect
import os
import random
import shutil
import stat
import sys

import pytest

from megak3.envs.snapshot import SnapshotRefused, SnapshotStore, StoreLimits, TreeCache, tree_digest


def listing(root):
    """Independent reference: {rel path: (kind, mode, mtime_ns, bytes or link target)} via os.listdir."""
    out, todo = {}, [root]
    while todo:                                   # iterative: os.walk recurses (and the tree is deep)
        dirpath = todo.pop()
        for name in os.listdir(dirpath):
            p = os.path.join(dirpath, name)
            if os.path.isdir(p) and not os.path.islink(p):
                todo.append(p)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", st.st_mtime_ns, os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_mtime_ns, f.read())
    return out


def make_tree(root):
    os.makedirs(os.path.join(root, "a/b"))
    for i in range(20):
        with open(os.path.join(root, f"a/f{i}.txt"), "wb") as f:
            f.write(os.urandom(100 + i))
    with open(os.path.join(root, "a/b/exe.sh"), "w") as f:
        f.write("#!/bin/sh\necho hi\n")
    os.chmod(os.path.join(root, "a/b/exe.sh"), 0o755)
    os.symlink("a/f1.txt", os.path.join(root, "link"))
    os.symlink("/nowhere", os.path.join(root, "dangling"))
    open(os.path.join(root, "empty"), "w").close()
    with open(os.path.join(root, os.fsdecode(b"bin\xff\xfename")), "wb") as f:    # not UTF-8
        f.write(b"\x00\x01")


def mutate(root):
    with open(os.path.join(root, "a/f0.txt"), "ab") as f:          # append
        f.write(b"more")
    with open(os.path.join(root, "a/f2.txt"), "r+b") as f:         # same size, different bytes
        f.write(b"XXXX")
    st = os.stat(os.path.join(root, "a/f3.txt"))                    # content change with mtime put back
    with open(os.path.join(root, "a/f3.txt"), "r+b") as f:
        f.write(b"YY")
    os.utime(os.path.join(root, "a/f3.txt"), ns=(st.st_atime_ns, st.st_mtime_ns))
    os.unlink(os.path.join(root, "a/f4.txt"))
    os.chmod(os.path.join(root, "a/b/exe.sh"), 0o600)
    os.unlink(os.path.join(root, "link"))
    os.symlink("a/f9.txt", os.path.join(root, "link"))
    os.rename(os.path.join(root, "a/b"), os.path.join(root, "moved"))
    os.mkdir(os.path.join(root, "a/b"))                              # same name, now empty
    os.unlink(os.path.join(root, "empty"))
    os.mkdir(os.path.join(root, "empty"))                           # file -> dir
    os.link(os.path.join(root, "a/f5.txt"), os.path.join(root, "hard"))
    with open(os.path.join(root, "new.bin"), "wb") as f:
        f.write(os.urandom(5000))


def test_snapshot_change_restore_is_identical(tmp_path):
    root, store = str(tmp_path / "work"), SnapshotStore(str(tmp_path / "store"))
    make_tree(root)
    cache, state = TreeCache(), {"turn": 3, "task": {"family": "ledger", "seed": 1}}
    before = listing(root)
    snap, stats = store.snapshot(root, cache, state)
    assert stats.files_hashed == 23 and stats.entries == len(before)
    mutate(root)
    assert listing(root) != before
    got_state, rstats = store.restore(snap, root, cache)
    assert got_state == state
    assert listing(root) == before
    assert tree_digest(root) == store_digest_again(store, root)
    # a fresh cache (another worker) restores the same tree into an empty directory
    other = str(tmp_path / "other")
    os.mkdir(other)
    store.restore(snap, other, TreeCache())
    assert listing(other) == before


def store_digest_again(store, root):
    snap, _ = store.snapshot(root, TreeCache(), {})
    other = root + "-copy"
    os.mkdir(other)
    store.restore(snap, other, TreeCache())
    return tree_digest(other)


def test_snapshots_are_incremental(tmp_path):
    root, store = str(tmp_path / "work"), SnapshotStore(str(tmp_path / "store"))
    make_tree(root)
    cache = TreeCache()
    s1, st1 = store.snapshot(root, cache, {"turn": 1})
    s2, st2 = store.snapshot(root, cache, {"turn": 1})
    assert s1 == s2 and st2.files_hashed == 0 and st2.bytes_written == 0
    with open(os.path.join(root, "a/f7.txt"), "ab") as f:
        f.write(b"!")
    s3, st3 = store.snapshot(root, cache, {"turn": 2})
    assert s3 != s1 and st3.files_hashed == 1
    manifest_bytes = os.path.getsize(os.path.join(store.root, "snapshots", s3 + ".json"))
    assert st3.bytes_written == 108 + manifest_bytes      # the one changed file's object + the manifest
    # restoring the earlier snapshot rewrites only the changed file
    _, rst = store.restore(s1, root, cache)
    assert rst.bytes_written == 100 + 7
    assert store.state(s3) == {"turn": 2}
    freed = store.gc([s1])
    assert freed > 0 and store.restore(s1, root, cache)[0] == {"turn": 1}
    with pytest.raises(KeyError):
        store.manifest(s3)


def test_deep_tree_needs_no_recursion(tmp_path):
    """A model can make directories deeper than Python's recursion limit; snapshot/restore walk iteratively."""
    root, store = str(tmp_path / "work"), SnapshotStore(str(tmp_path / "store"))
    deep = root
    os.mkdir(root)
    for _ in range(300):
        deep = os.path.join(deep, "d")
        os.mkdir(deep)
    with open(os.path.join(deep, "leaf"), "w") as f:
        f.write("leaf")
    before = listing(root)
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 100)   # far below the tree's depth
    try:
        snap, _ = store.snapshot(root, TreeCache(), {})
        other = str(tmp_path / "other")
        os.mkdir(other)
        store.restore(snap, other, TreeCache())
    finally:
        sys.setrecursionlimit(old)
    assert listing(other) == before


def listing_by_chdir(root):
    """Independent reference for trees deeper than PATH_MAX: walks by chdir, one name at a time."""
    out, cwd = {}, os.open(".", os.O_RDONLY)
    try:
        os.chdir(root)
        stack = [("", sorted(os.listdir(".")))]
        while stack:
            rel, names = stack[-1]
            if not names:
                stack.pop()
                if stack:
                    os.chdir("..")
                continue
            name = names.pop(0)
            r = f"{rel}/{name}" if rel else name
            st = os.lstat(name)
            if stat.S_ISLNK(st.st_mode):
                out[r] = ("l", st.st_mtime_ns, os.readlink(name))
            elif stat.S_ISDIR(st.st_mode):
                out[r] = ("d", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
                os.chdir(name)
                stack.append((r, sorted(os.listdir("."))))
            elif stat.S_ISREG(st.st_mode):
                with open(name, "rb") as f:
                    out[r] = ("f", stat.S_IMODE(st.st_mode), st.st_mtime_ns, f.read())
            else:
                out[r] = ("?",)
    finally:
        os.fchdir(cwd)
        os.close(cwd)
    return out


def make_deep(root, levels=20, name="d" * 250):
    """The issue's wedge: ``for i in range(20): os.mkdir('d'*250); os.chdir('d'*250)`` (paths > PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            new = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = new
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o640, dir_fd=fd), "w") as f:
            f.write("deep")
        os.symlink("../" * levels + "top", "up", dir_fd=fd)
        os.mkfifo("fifo", dir_fd=fd)
    finally:
        os.close(fd)


def test_paths_beyond_path_max_and_any_byte_names_round_trip(tmp_path):
    root, store = str(tmp_path / "work"), SnapshotStore(str(tmp_path / "store"))
    os.mkdir(root)
    make_deep(root)
    for raw in (b"\xff\xfe", b"caf\xc3\xa9", b"\xed\xa0\x80surrogate-in-utf8", b"nl\nname", b"sp ace\t"):
        with open(os.path.join(root, os.fsdecode(raw)), "wb") as f:
            f.write(raw)
    os.symlink(os.fsdecode(b"/target/\xff"), os.path.join(root, "badlink"))
    before = listing_by_chdir(root)
    assert sum(1 for v in before.values() if v == ("?",)) == 1           # the fifo
    snap, st = store.snapshot(root, TreeCache(), {})
    assert len(st.skipped) == 1 and st.skipped[0].endswith("/fifo")
    want = {k: v for k, v in before.items() if v != ("?",)}
    other = str(tmp_path / "other")
    os.mkdir(other)
    store.restore(snap, other, TreeCache())
    assert listing_by_chdir(other) == want
    # restoring an empty snapshot removes the whole deep tree (by fd, deeper than FD_WINDOW)
    empty = str(tmp_path / "empty")
    os.mkdir(empty)
    snap0, _ = store.snapshot(empty, TreeCache(), {})
    make_deep(root, levels=150, name="e")
    store.restore(snap0, root, TreeCache())
    assert os.listdir(root) == []


CANARY = b"canary: the host side must never write here\n"


def canaries(tmp_path):
    """Root-owned files outside the episode (one in the store's own directory), and their fingerprints."""
    paths = [str(tmp_path / "canary"), str(tmp_path / "store" / "canary")]
    for p in paths:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(CANARY)
        os.chmod(p, 0o600)
    return paths, fingerprint(paths)


def fingerprint(paths):
    out = []
    for p in paths:
        st = os.lstat(p)
        with open(p, "rb") as f:
            out.append((p, hashlib.sha256(f.read()).hexdigest(), st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns))
    return out


def plant(root, targets, pids):
    """What an agent can do: symlinks at every name the host side ever used, pointing at host files."""
    for d in ("", "sub"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
        for pid in pids:
            for i, name in enumerate((f".megak3-restore-{pid}", f".megak3-write-{pid}")):
                os.symlink(targets[(pid + i) % len(targets)], os.path.join(root, d, name))
        with open(os.path.join(root, d, "x"), "w") as f:
            f.write("PWNED")
    os.symlink(targets[0], os.path.join(root, "dirlink"))


def unharmed(paths, before, fn, *args, **kw):
    """Run ``fn``; the canaries are checked first (the old restore raised, but only after writing)."""
    try:
        out, err = fn(*args, **kw), None
    except OSError as e:
        out, err = None, e
    assert fingerprint(paths) == before, "a host file outside the episode changed"
    if err is not None:
        raise err
    return out


def test_restore_and_fork_never_follow_planted_links(tmp_path):
    paths, before = canaries(tmp_path)
    root, store = str(tmp_path / "work"), SnapshotStore(str(tmp_path / "store"))
    plant(root, paths, [os.getpid()] + list(range(2, 40)))
    cache = TreeCache()
    snap, _ = store.snapshot(root, cache, {})
    ref = listing(root)
    for d in ("", "sub"):                                   # the restore must rewrite these files
        with open(os.path.join(root, d, "x"), "w") as f:
            f.write("changed")
    os.unlink(os.path.join(root, "dirlink"))
    os.mkdir(os.path.join(root, "dirlink"))                 # a dir where the snapshot has a link, and back
    unharmed(paths, before, store.restore, snap, root, cache, uid=12345)
    assert listing(root) == ref
    fresh = str(tmp_path / "fresh")                         # a fork / a new worker: into an empty directory
    os.mkdir(fresh)
    unharmed(paths, before, store.restore, snap, fresh, TreeCache(), uid=12345)
    assert listing(fresh) == ref
    assert os.lstat(os.path.join(fresh, "sub", "x")).st_uid == 12345
    assert not [n for n in os.listdir(fresh) if n.startswith(".megak3-restore-") and
                not os.path.islink(os.path.join(fresh, n))]          # no temp file left behind
    # a file replaced by a link to a host file between snapshot and restore: replaced, not followed
    os.unlink(os.path.join(root, "x"))
    os.symlink(paths[0], os.path.join(root, "x"))
    unharmed(paths, before, store.restore, snap, root, cache)
    assert listing(root) == ref


def test_quotas_refuse_before_reading(tmp_path):
    root = str(tmp_path / "work")
    os.mkdir(root)
    store = SnapshotStore(str(tmp_path / "store"), StoreLimits(episode_bytes=1 << 20, episode_entries=50))
    with open(os.path.join(root, "small"), "wb") as f:
        f.write(b"s" * 1000)
    ok, _ = store.snapshot(root, TreeCache(), {})
    with open(os.path.join(root, "sparse"), "wb") as f:
        f.truncate(1 << 40)                                 # 1 TiB, no blocks: never read
    with pytest.raises(SnapshotRefused, match=r"more than 1048576 bytes"):
        store.snapshot(root, TreeCache(), {})
    os.unlink(os.path.join(root, "sparse"))
    for i in range(60):
        os.mkdir(os.path.join(root, f"d{i}"))
    with pytest.raises(SnapshotRefused, match=r"more than 50 entries"):
        store.snapshot(root, TreeCache(), {})
    assert store.state(ok) == {}                            # the last good snapshot is intact
    with pytest.raises(ValueError, match=r"^store_limits.keep_last=0 must be a positive integer$"):
        StoreLimits(keep_last=0).validate()
    with pytest.raises(ValueError, match=r"^store_limits.pool: no such field"):
        StoreLimits.from_dict({"pool": 1})


def test_gc_keeps_only_named_snapshots(tmp_path):
    root, store = str(tmp_path / "work"), SnapshotStore(str(tmp_path / "store"))
    os.mkdir(root)
    cache, snaps = TreeCache(), []
    for i in range(5):
        with open(os.path.join(root, "f"), "wb") as f:
            f.write(bytes([i]) * 10000)
        snaps.append(store.snapshot(root, cache, {"i": i})[0])
    before = store.disk_bytes()
    freed = store.gc(snaps[-2:])
    assert freed == before - store.disk_bytes() and store.disk_bytes() < before / 2
    assert store.restore(snaps[-2], root, cache)[0] == {"i": 3}
    with pytest.raises(KeyError):
        store.manifest(snaps[0])


NAMES = (f".megak3-restore-{os.getpid()}", f".megak3-write-{os.getpid()}", "a", "b", "d" * 254,
         os.fsdecode(b"\xff\xfe"), "x.json.tmp-0")                  # host-side names of this process, odd ones


def random_tree(root, rng, targets, n=30):
    """A seeded tree as an agent could make it: nested dirs, files, links to host files, hard links,
    fifos, odd modes; returns the directories (rel) it made."""
    dirs = [""]
    for _ in range(n):
        parent = rng.choice(dirs)
        name = rng.choice(NAMES) + (str(rng.randrange(3)) if rng.random() < 0.3 else "")
        p = os.path.join(root, parent, name)
        if os.path.lexists(p):
            continue
        kind = rng.random()
        if kind < 0.3 and parent.count("/") < 8:
            os.mkdir(p)
            dirs.append(os.path.join(parent, name) if parent else name)
        elif kind < 0.6:
            with open(p, "wb") as f:
                f.write(rng.randbytes(rng.randrange(200)))
            os.chmod(p, rng.choice((0o644, 0o000, 0o4755, 0o600)))
        elif kind < 0.85:
            os.symlink(rng.choice(targets + ["rel/../x", "/work/a"]), p)
        elif kind < 0.95:
            files = [os.path.join(root, d, f) for d in dirs for f in os.listdir(os.path.join(root, d))
                     if os.path.isfile(os.path.join(root, d, f)) and not os.path.islink(os.path.join(root, d, f))]
            if files:
                os.link(rng.choice(files), p)
        else:
            os.mkfifo(p)
    for d in dirs[1:]:
        if rng.random() < 0.2:
            os.chmod(os.path.join(root, d), rng.choice((0o500, 0o1777, 0o000)))
    return dirs


def mutate_randomly(root, rng, targets, dirs):
    for d in dirs:
        os.chmod(os.path.join(root, d), 0o755) if d else None
    for _ in range(10):
        d = rng.choice(dirs)
        if not os.path.isdir(os.path.join(root, d)) or os.path.islink(os.path.join(root, d)):
            continue
        names = os.listdir(os.path.join(root, d))
        if not names:
            continue
        p = os.path.join(root, d, rng.choice(names))
        op = rng.random()
        if op < 0.4:                                         # replace anything by a link to a host file
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
            os.symlink(rng.choice(targets), p)
        elif op < 0.7 and os.path.isfile(p) and not os.path.islink(p):
            with open(p, "ab") as f:
                f.write(b"+")
        elif op < 0.85 and not os.path.islink(p):
            os.chmod(p, 0o777)
        elif not os.path.lexists(os.path.join(root, d, "new")):
            open(os.path.join(root, d, "new"), "w").close()


def test_seeded_trees_restore_exactly_and_touch_no_host_file(tmp_path):
    """A store-level generator (the jail-level one drives the agent's own tools): 40 seeded trees,
    each snapshot, mutated (links to host files put in place of entries), restored in place and
    into an empty directory: the tree equals the snapshot and no canary changed."""
    paths, before = canaries(tmp_path)
    store = SnapshotStore(str(tmp_path / "store"))
    for seed in range(40):
        rng = random.Random(seed)
        root = str(tmp_path / f"t{seed}")
        os.mkdir(root)
        dirs = random_tree(root, rng, paths)
        cache = TreeCache()
        snap, st = store.snapshot(root, cache, {"seed": seed})
        want = {k: v for k, v in listing_by_chdir(root).items() if v != ("?",)}
        assert len(st.skipped) == len(listing_by_chdir(root)) - len(want)
        mutate_randomly(root, rng, paths, dirs)
        unharmed(paths, before, store.restore, snap, root, cache, uid=54321)
        assert {k: v for k, v in listing_by_chdir(root).items() if v != ("?",)} == want, seed
        fresh = root + "-fresh"
        os.mkdir(fresh)
        unharmed(paths, before, store.restore, snap, fresh, TreeCache(), uid=54321)
        assert listing_by_chdir(fresh) == want, seed
