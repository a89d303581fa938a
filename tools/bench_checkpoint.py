#!/usr/bin/env python
"""Step-time cost of a checkpoint, synchronous vs asynchronous (megak3/checkpoint/writer.py).

    python tools/bench_checkpoint.py [--state-mib 256] [--step-ms 400] [--steps 12] [--save-every 4]

A training step is stood in for by matrix products that take about --step-ms; the saved state is
--state-mib of fp32 tensors (a model shard plus optimizer state). Three runs of --steps steps in the
same process: no checkpoint (baseline), a checkpoint every --save-every steps with
train.async_save=false, and with train.async_save=true (the run ends with the last save
committed in every mode). Prints each run's time and the cost of one save in step time
(run time minus the baseline's, per save), with ratios to the baseline and sync measured in the
same run. The async save pays the host snapshot in the step; the write overlaps the next steps
(on a CPU-only machine it competes with them for the cores).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mib", type=int, default=256, help="checkpointed state per save (MiB)")
    ap.add_argument("--step-ms", type=float, default=400.0, help="approximate compute per step (ms)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run")
    ap.add_argument("--save-every", type=int, default=4, help="steps between checkpoints")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)
    import torch

    from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry

    torch.set_num_threads(args.threads)
    n = args.state_mib * 2 ** 20 // 4 // 16
    state = {f"model/t{i}": torch.randn(n) for i in range(16)}
    a = torch.randn(512, 512)
    t0 = time.perf_counter()
    for _ in range(10):
        a = (a @ a).tanh_()
    reps = max(1, int(args.step_ms / 1000 / ((time.perf_counter() - t0) / 10)))

    def step():
        nonlocal a
        for _ in range(reps):
            a = (a @ a).tanh_()
        for t in state.values():  # the optimizer updates the state in place
            t.mul_(0.999)

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_"))
    out = {}
    try:
        for mode in ("none", "sync", "async"):
            ck = ShardedCheckpointer(root / mode, 0, 1, keep_last=1, async_save=mode == "async")
            t0 = time.perf_counter()
            saves = 0
            for s in range(1, args.steps + 1):
                step()
                if mode != "none" and s % args.save_every == 0:
                    ck.save(s, {k: ShardEntry(v, tuple(v.shape), (0,)) for k, v in state.items()},
                            common={"step": s})
                    saves += 1
            ck.wait()
            out[mode] = (time.perf_counter() - t0, saves, ck.last_save_stats)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    base = out["none"][0]
    print(f"state {args.state_mib} MiB per save, {args.steps} steps of ~{base / args.steps * 1e3:.0f} ms, "
          f"a save every {args.save_every} steps, {args.threads} thread(s)")
    cost = {m: (t - base) / max(n, 1) for m, (t, n, _) in out.items()}
    for mode, (total, n, stats) in out.items():
        line = f"  {mode:>5}: run {total:6.2f} s = {total / base:.2f} x no checkpoint"
        if mode != "none":
            line += (f"; cost per save {cost[mode] * 1e3:7.1f} ms = {cost[mode] / (base / args.steps):.2f} steps"
                     + (f" = {cost[mode] / max(cost['sync'], 1e-9):.2f} x sync" if mode == "async" else "")
                     + f" (last save: snapshot {stats['snapshot_s'] * 1e3:.0f} ms, write {stats['write_s'] * 1e3:.0f} ms)")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
