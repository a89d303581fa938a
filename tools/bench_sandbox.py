"""Snapshot/restore cost of an episode directory against a full copy, and tool-call latency, one run.

    python tools/bench_sandbox.py [--files 1000] [--mbytes 10] [--changed 10] [--calls 20] [--dir DIR]

Builds a working directory of ``--files`` files (``--mbytes`` MB of random bytes in all, 20 files per
sub-directory) and a snapshot store beside it (``--dir``, default a temporary directory on this
machine's disk). Run as root, the working directory is a tmpfs in a private mount namespace, as in a
worker (``megak3.envs.host.enter_private_mounts``); the line ``workdir:`` says which. Printed, each
with time, bytes written and its ratio to the full copy of the same tree measured in the same run
(``shutil.copytree``, the baseline; ratio = copy time / its time, above 1 is faster):

* first snapshot (every file hashed and stored);
* repeated snapshot of the unchanged tree (a stat per file);
* snapshot after changing ``--changed`` files;
* restore of the first snapshot onto the changed tree (rewrites only the changed files);
* restore of the first snapshot into an empty directory (a new worker resuming the episode).

Then ``--calls`` sandboxed ``true`` commands (namespaces, cgroup, chroot, rlimits) against the same
number of plain ``sh -c true`` subprocesses: ms per call and the ratio.
"""
from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megak3.cli import Parser  # noqa: E402
from megak3.envs.host import enter_private_mounts, host_isolation  # noqa: E402
from megak3.envs.sandbox import ProcessSandbox, SandboxLimits  # noqa: E402
from megak3.envs.snapshot import SnapshotStore, TreeCache, tree_digest  # noqa: E402

BENCH_UID = 99999


def build_tree(root: str, files: int, total_bytes: int, rng: random.Random):
    sizes = [total_bytes // files] * files
    for i in range(files):
        d = os.path.join(root, f"d{i // 20:03d}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"f{i:05d}.bin"), "wb") as f:
            f.write(rng.randbytes(sizes[i]))


def change_files(root: str, n: int, rng: random.Random):
    paths = sorted(str(p) for p in Path(root).rglob("*.bin"))
    for p in rng.sample(paths, n):
        with open(p, "r+b") as f:
            f.write(rng.randbytes(64))


def du(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def main(argv=None):
    ap = Parser(prog="bench_sandbox.py", description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--mbytes", type=float, default=10.0)
    ap.add_argument("--changed", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--dir", default=None, help="where to put the tree, the store and the copy")
    args = ap.parse_args(argv)
    if args.files < 1 or args.mbytes <= 0 or args.calls < 0 or not 0 <= args.changed <= args.files:
        ap.error(f"need --files >= 1, --mbytes > 0, --calls >= 0, 0 <= --changed <= --files "
                 f"(got {args.files}, {args.mbytes}, {args.calls}, {args.changed})")
    base = args.dir or tempfile.mkdtemp(prefix="bench-sandbox-")
    os.makedirs(base, exist_ok=True)
    rng = random.Random(0)
    private = enter_private_mounts()
    print(host_isolation().describe())
    try:
        limits = SandboxLimits(disk_bytes=int(args.mbytes * 4 * (1 << 20)) + (8 << 20), max_files=4 * args.files + 100)
        sb = ProcessSandbox(os.path.join(base, "work"), BENCH_UID, limits, os.path.join(base, "scratch"))
        work = sb.workdir
        print(f"workdir: {'tmpfs (private mount namespace)' if sb.quota_mount else 'directory on disk'}; "
              f"store: {os.path.join(base, 'store')} on disk")
        build_tree(work, args.files, int(args.mbytes * (1 << 20)), rng)
        nbytes = du(work)
        print(f"tree: {args.files} files, {nbytes / 1e6:.1f} MB")

        t0 = time.perf_counter()
        shutil.copytree(work, os.path.join(base, "copy"), symlinks=True)
        t_copy = time.perf_counter() - t0
        rows = [("full copy (baseline)", t_copy, nbytes)]
        store, cache = SnapshotStore(os.path.join(base, "store")), TreeCache()
        s1, st = store.snapshot(work, cache, {"turn": 1})
        rows.append(("first snapshot", st.seconds, st.bytes_written))
        digest1 = tree_digest(work)
        _, st = store.snapshot(work, cache, {"turn": 1})
        rows.append(("repeat snapshot, unchanged", st.seconds, st.bytes_written))
        change_files(work, args.changed, rng)
        _, st = store.snapshot(work, cache, {"turn": 2})
        rows.append((f"snapshot after {args.changed} changed files", st.seconds, st.bytes_written))
        _, st = store.restore(s1, work, cache)
        rows.append((f"restore onto the changed tree", st.seconds, st.bytes_written))
        assert tree_digest(work) == digest1, "restore is not bit-identical"
        fresh = os.path.join(base, "fresh")
        os.mkdir(fresh)
        _, st = store.restore(s1, fresh, TreeCache())
        rows.append(("restore into an empty directory", st.seconds, st.bytes_written))
        assert tree_digest(fresh) == digest1, "restore is not bit-identical"
        print(f"{'operation':<40} {'ms':>9} {'MB written':>11} {'vs copy':>8}")
        for name, sec, nb in rows:
            print(f"{name:<40} {sec * 1e3:9.1f} {nb / 1e6:11.3f} {t_copy / sec:7.1f}x")
        print("restores checked bit-identical (paths, kinds, modes, mtimes, bytes)")

        if args.calls:
            plain, boxed = [], []
            for _ in range(args.calls):                 # interleaved: other load falls on both alike
                t0 = time.perf_counter()
                subprocess.run(["sh", "-c", "true"], check=True)
                plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                out = sb.shell("true")
                boxed.append(time.perf_counter() - t0)
                assert out == "[exit 0]", out
            p, b = statistics.median(plain), statistics.median(boxed)
            print(f"tool call latency (median of {args.calls}): sandboxed {b * 1e3:.1f} ms, plain subprocess "
                  f"{p * 1e3:.1f} ms (baseline), ratio {b / p:.1f}x slower")
        sb.destroy()
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    if not private:
        print("note: not root or no mount namespace: the workdir was a plain directory")


if __name__ == "__main__":
    main()
