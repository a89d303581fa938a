#!/usr/bin/env python
"""Step-time cost of a checkpoint, synchronous vs asynchronous (megak3/checkpoint/writer.py); with
--vs-dcp, the per-shard format against torch.distributed.checkpoint (DCP) on the same sharded state.

    python tools/bench_checkpoint.py [--state-mib 256] [--step-ms 400] [--steps 12] [--save-every 4]
    python tools/bench_checkpoint.py --vs-dcp [--ranks 4] [--state-mib 64] [--keys 16] [--repeats 3]

--vs-dcp: --ranks gloo processes each hold a row block (dim 0 split --ranks ways) of --keys fp32
tensors totalling --state-mib, and save them as one checkpoint in each format (megak3: ShardedCheckpointer;
DCP: dcp.save with the same boxes as chunks, megak3/checkpoint/dcp.py), then load them back at the same
layout, resharded (each rank a column block: every saved chunk overlaps every rank's box) and as one
pipeline stage (each rank the whole tensors of 1/--ranks of the keys). Prints, per format, the metadata
bytes on disk and read per rank, the payload bytes read per rank (the most over the ranks), and save /
load seconds (the slowest rank, best of --repeats), with the ratio megak3 / DCP. DCP's reader loads
each overlapping saved chunk whole and narrows it; its ``.metadata`` is read with
megak3.checkpoint.dcp's safe unpickler (DCP's own uses pickle.load). megak3's payload bytes are those
copied out of its files (``CheckpointReader.bytes_read``: the box's bytes); in the resharded load
every 1 KiB saved row is cut, so the pages the kernel brings in span the whole chunks either way.

Without --vs-dcp:
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


def _vs_dcp_rank(rank, world, root, state_mib, keys, repeats):
    """One rank of --vs-dcp: returns its measurements (seconds, bytes)."""
    import torch
    import torch.distributed as dist

    from megak3.checkpoint import dcp
    from megak3.checkpoint.reader import CheckpointReader
    from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry

    cols = 256
    rows = max(world, state_mib * 2 ** 20 // 4 // keys // cols // world * world)
    g = torch.Generator().manual_seed(rank)
    rb = rows // world
    mine = {f"model/layers.{i}.w": torch.randn(rb, cols, generator=g) for i in range(keys)}
    save_box = lambda k: ((rows, cols), (rank * rb, 0))  # noqa: E731
    cb = cols // world
    names = list(mine)
    stage = names[rank * keys // world:(rank + 1) * keys // world]  # a pipeline stage's layers, whole
    loads = {"same": (names, (rank * rb, 0), (rb, cols)), "resharded": (names, (0, rank * cb), (rows, cb)),
             "stage": (stage, (0, 0), (rows, cols))}
    root = Path(root)
    out = {"save": {}, "load": {}, "bytes": {}, "meta_read": {}}

    def timed(fn):
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            best = min(best, time.perf_counter() - t0)
        return best

    ck = ShardedCheckpointer(root / "megak3", rank, world)
    entries = {k: ShardEntry(v, *save_box(k)) for k, v in mine.items()}
    out["save"]["megak3"] = timed(lambda: ck.save(1, entries, common={"step": 1} if rank == 0 else None))
    ck_dir = root / "megak3" / "step_00000001"

    def dcp_save():
        d = root / "dcp"
        if rank == 0 and d.exists():
            shutil.rmtree(d)
        dist.barrier()
        dcp.save_boxes(d, {k: (*save_box(k), tuple(v.shape), v.dtype, (lambda v=v: v)) for k, v in mine.items()},
                       {"megak3/common": {"step": 1}} if rank == 0 else None)

    out["save"]["dcp"] = timed(dcp_save)
    for how, (wanted, offs, shape) in loads.items():
        res = {}

        def own_load():
            r = CheckpointReader(ck_dir)
            for k in wanted:
                r.read(k, offs, shape)
            r.common
            res["megak3"] = (r.bytes_read, r.meta_bytes_read - (ck_dir / "state.pt").stat().st_size)
            r.close()

        def dcp_load():
            boxes = {k: (offs, torch.empty(shape)) for k in wanted}
            _, reader = dcp.load_boxes(root / "dcp", boxes, ["megak3/common"])
            common_bytes = reader.storage_data[next(i for i in reader.storage_data if i.fqn == "megak3/common")].length
            res["dcp"] = (reader.bytes_read - common_bytes, reader.meta_bytes_read)

        out["load"][("megak3", how)] = timed(own_load)
        out["load"][("dcp", how)] = timed(dcp_load)
        for fmt in ("megak3", "dcp"):
            out["bytes"][(fmt, how)] = res[fmt][0]
            out["meta_read"][(fmt, how)] = res[fmt][1]
    if rank == 0:
        out["meta_disk"] = {
            "megak3": sum(p.stat().st_size for p in ck_dir.iterdir() if p.suffix == ".json"),
            "dcp": (root / "dcp" / ".metadata").stat().st_size}
        out["payload"] = sum(v.numel() * 4 for v in mine.values()) * world
    return out


def vs_dcp(args) -> int:
    from parallel.testing import run_distributed

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ckpt_dcp_"))
    try:
        res = run_distributed(_vs_dcp_rank, args.ranks, str(root), args.state_mib, args.keys, args.repeats,
                              timeout_s=1800, collective_timeout_s=1800)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    r0 = res[0]
    worst = lambda part, key: max(r[part][key] for r in res)  # noqa: E731
    rows = [("metadata on disk (B)", r0["meta_disk"]["megak3"], r0["meta_disk"]["dcp"]),
            ("metadata read per rank, all keys (B)", worst("meta_read", ("megak3", "same")),
             worst("meta_read", ("dcp", "same"))),
            ("metadata read per rank, one stage (B)", worst("meta_read", ("megak3", "stage")),
             worst("meta_read", ("dcp", "stage"))),
            ("payload read per rank, same layout (B)", worst("bytes", ("megak3", "same")),
             worst("bytes", ("dcp", "same"))),
            ("payload read per rank, resharded (B)", worst("bytes", ("megak3", "resharded")),
             worst("bytes", ("dcp", "resharded"))),
            ("save (s)", worst("save", "megak3"), worst("save", "dcp")),
            ("load, same layout (s)", worst("load", ("megak3", "same")), worst("load", ("dcp", "same"))),
            ("load, resharded (s)", worst("load", ("megak3", "resharded")), worst("load", ("dcp", "resharded"))),
            ("load, one stage (s)", worst("load", ("megak3", "stage")), worst("load", ("dcp", "stage")))]
    print(f"{args.ranks} gloo ranks, {args.keys} fp32 tensors, {r0['payload'] / 2 ** 20:.1f} MiB in all "
          f"({r0['payload'] / args.ranks / 2 ** 20:.1f} MiB per rank); saved as row blocks, loaded as row blocks "
          f"(same), as column blocks (resharded) and as whole tensors of 1/{args.ranks} of the keys (one stage); "
          f"best of {args.repeats}")
    print(f"  {'':40} {'megak3':>14} {'DCP':>14} {'megak3/DCP':>11}")
    for name, a, b in rows:
        fmt = (lambda v: f"{v:14.3f}") if name.endswith("(s)") else (lambda v: f"{int(v):14,d}")
        print(f"  {name:40} {fmt(a)} {fmt(b)} {a / b if b else float('nan'):11.3f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vs-dcp", action="store_true", help="compare with torch.distributed.checkpoint")
    ap.add_argument("--ranks", type=int, default=4, help="--vs-dcp: gloo ranks")
    ap.add_argument("--keys", type=int, default=16, help="--vs-dcp: tensors in the state")
    ap.add_argument("--repeats", type=int, default=3, help="--vs-dcp: timed repetitions (best taken)")
    ap.add_argument("--state-mib", type=int, default=None,
                    help="checkpointed state per save (MiB; default 256, with --vs-dcp 64)")
    ap.add_argument("--step-ms", type=float, default=400.0, help="approximate compute per step (ms)")
    ap.add_argument("--steps", type=int, default=12, help="steps per run")
    ap.add_argument("--save-every", type=int, default=4, help="steps between checkpoints")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args(argv)
    if args.vs_dcp:
        args.state_mib = args.state_mib or 64
        return vs_dcp(args)
    args.state_mib = args.state_mib or 256
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
