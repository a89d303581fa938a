"""Snapshots: restore gives back the exact tree and state; repeated snapshots are incremental."""
import inspect
import os
import stat
import sys

import pytest

from megak3.envs.snapshot import SnapshotStore, TreeCache, tree_digest


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
