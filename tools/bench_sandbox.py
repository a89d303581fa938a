"""Snapshot/restore cost of an episode directory against a full copy and against the previous
snapshot code, tool-call latency, and the store's size under the pool's gc, one run.

    python tools/bench_sandbox.py [--files 1000] [--mbytes 10] [--changed 10] [--calls 20] [--dir DIR]
                                  [--baseline REV] [--repeat 3] [--turns 100]

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
* restore of the first snapshot into an empty directory (a new worker resuming the episode; a tmpfs
  too when root). Restores give the files to a sandbox uid, as a worker does.

The same sequence also runs with the snapshot code of git revision ``--baseline`` (default: the
last commit before snapshots went through directory fds; its ``megak3/envs/snapshot.py`` is loaded
from git into this process, nothing is checked out), alternating with the current code for
``--repeat`` rounds on the same tree: the table shows the median of each and ``new/old`` (below 1.5
is the acceptance bound of issue 34).

Then ``--calls`` sandboxed ``true`` commands (namespaces, cgroup, chroot, rlimits) against the same
number of plain ``sh -c true`` subprocesses: ms per call and the ratio.

Last (``--turns``, 0 skips it): an ``EnvPool`` episode whose every turn rewrites a 1 MB file, with
the pool's own gc (default ``StoreLimits``) against no gc (``gc_bytes`` beyond reach, as before the
pool collected): the store's bytes after the last turn, and the ratio.
"""
from __future__ import annotations

import importlib.util
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
from megak3.envs import snapshot as current  # noqa: E402
from megak3.envs.snapshot import SnapshotStore, TreeCache, tree_digest  # noqa: E402

BENCH_UID = 99999
BASELINE = "5302528"          # the last commit whose snapshot.py acted on paths (issue 34)
ROOT = Path(__file__).resolve().parents[1]


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


def load_baseline(rev: str):
    """megak3/envs/snapshot.py as of git revision ``rev``, as a module of its own."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:megak3/envs/snapshot.py"], capture_output=True,
                         text=True)
    if src.returncode != 0:
        raise ValueError(f"--baseline {rev}: git show failed: {src.stderr.strip()}")
    spec = importlib.util.spec_from_loader(f"snapshot_at_{rev}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                        # dataclasses look their module up there
    exec(compile(src.stdout, f"{rev}:megak3/envs/snapshot.py", "exec"), mod.__dict__)
    return mod


def sequence(impl, work: str, base: str, changed: int, rng: random.Random, tag: str, limits: SandboxLimits):
    """first / repeat / changed snapshot, restore onto the changed tree, restore into an empty
    directory (a tmpfs like ``work`` when root); returns [(name, seconds, bytes)]; leaves ``work`` as it
    was. Restores give files to ``BENCH_UID`` as a worker does, where this process may."""
    uid = BENCH_UID if os.geteuid() == 0 else None
    store, cache, rows = impl.SnapshotStore(os.path.join(base, f"store-{tag}")), impl.TreeCache(), []
    digest = tree_digest(work)
    os.sync()                                           # the other run's dirty pages are not flushed in this one
    s1, st = store.snapshot(work, cache, {"turn": 1})
    rows.append(("first snapshot", st.seconds, st.bytes_written))
    _, st = store.snapshot(work, cache, {"turn": 1})
    rows.append(("repeat snapshot, unchanged", st.seconds, st.bytes_written))
    change_files(work, changed, rng)
    _, st = store.snapshot(work, cache, {"turn": 2})
    rows.append((f"snapshot after {changed} changed files", st.seconds, st.bytes_written))
    _, st = store.restore(s1, work, cache, uid)
    rows.append(("restore onto the changed tree", st.seconds, st.bytes_written))
    assert tree_digest(work) == digest, f"{tag}: restore is not bit-identical"
    fresh = ProcessSandbox(os.path.join(base, f"fresh-{tag}"), BENCH_UID + 1, limits, os.path.join(base, "scratch"))
    _, st = store.restore(s1, fresh.workdir, impl.TreeCache(), uid)
    rows.append(("restore into an empty directory", st.seconds, st.bytes_written))
    assert tree_digest(fresh.workdir) == digest, f"{tag}: restore is not bit-identical"
    fresh.destroy()
    shutil.rmtree(os.path.join(base, f"store-{tag}"))
    return rows


def store_after_turns(turns: int, base: str, gc: bool) -> int:
    from megak3.envs import EnvPool, ToolCall
    lim = {} if gc else {"gc_bytes": 1 << 62}
    with EnvPool(1, base_dir=os.path.join(base, f"pool-{gc}"), store_limits=lim) as pool:
        pool.reset("e", {"family": "ledger", "seed": 0, "max_turns": turns + 1})
        for i in range(turns):
            r = pool.step("e", ToolCall("write_file", {"path": "blob", "content": f"{i:08d}" * (1 << 17)}))
            assert r.observation.startswith("wrote 1048576 bytes"), r.observation
        return pool.store.disk_bytes()


def main(argv=None):
    ap = Parser(prog="bench_sandbox.py", description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--mbytes", type=float, default=10.0)
    ap.add_argument("--changed", type=int, default=10)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--dir", default=None, help="where to put the tree, the store and the copy")
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the snapshot code to compare with")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of old/new (medians are printed)")
    ap.add_argument("--turns", type=int, default=100, help="turns of the store-size measurement (0: skip)")
    args = ap.parse_args(argv)
    if args.files < 1 or args.mbytes <= 0 or args.calls < 0 or not 0 <= args.changed <= args.files \
            or args.repeat < 1 or args.turns < 0:
        ap.error(f"need --files >= 1, --mbytes > 0, --calls >= 0, 0 <= --changed <= --files, --repeat >= 1, "
                 f"--turns >= 0 (got {args.files}, {args.mbytes}, {args.calls}, {args.changed}, {args.repeat}, "
                 f"{args.turns})")
    try:
        old = load_baseline(args.baseline)
    except ValueError as e:
        ap.error(str(e))
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
              f"store: {os.path.join(base, 'store-*')} on disk")
        build_tree(work, args.files, int(args.mbytes * (1 << 20)), rng)
        nbytes = du(work)
        print(f"tree: {args.files} files, {nbytes / 1e6:.1f} MB")

        t0 = time.perf_counter()
        shutil.copytree(work, os.path.join(base, "copy"), symlinks=True)
        t_copy = time.perf_counter() - t0
        runs = {"old": [], "new": []}
        for r in range(args.repeat):                    # alternating: other load falls on both alike
            for tag, impl in ((("old", old), ("new", current)) if r % 2 == 0 else (("new", current), ("old", old))):
                runs[tag].append(sequence(impl, work, base, args.changed, rng, tag, limits))
        print(f"{'operation (median of ' + str(args.repeat) + ')':<40} {'new ms':>8} {'old ms':>8} {'new/old':>8} "
              f"{'MB written':>11} {'copy/new':>9}")
        print(f"{'full copy (baseline of the vs-copy column)':<40} {t_copy * 1e3:8.1f}")
        worst = 0.0
        for i, (name, _, nb) in enumerate(runs["new"][0]):
            t_new = statistics.median(rows[i][1] for rows in runs["new"])
            t_old = statistics.median(rows[i][1] for rows in runs["old"])
            worst = max(worst, t_new / t_old)
            print(f"{name:<40} {t_new * 1e3:8.1f} {t_old * 1e3:8.1f} {t_new / t_old:7.2f}x {nb / 1e6:11.3f} "
                  f"{t_copy / t_new:8.1f}x")
        print(f"restores checked bit-identical (paths, kinds, modes, mtimes, bytes); old = snapshot.py at "
              f"{args.baseline}; worst new/old {worst:.2f}x")

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
        if args.turns:
            with_gc, without = store_after_turns(args.turns, base, True), store_after_turns(args.turns, base, False)
            print(f"store after {args.turns} turns that each rewrite a 1 MB file: {with_gc / 1e6:.1f} MB with the "
                  f"pool's gc (default store_limits), {without / 1e6:.1f} MB without gc (baseline), ratio "
                  f"{without / with_gc:.1f}x smaller")
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    if not private:
        print("note: not root or no mount namespace: the workdir was a plain directory")


if __name__ == "__main__":
    main()
