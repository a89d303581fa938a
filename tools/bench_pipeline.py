"""Pipeline memory and communication benchmark (gloo ranks, k3_tiny at parity widths).

    python tools/bench_pipeline.py                       # pp 2 and 4, m = 2 pp, all schedules
    python tools/bench_pipeline.py --pp 4 --micro-batches 8 --seqlen 128

For every schedule it prints, per pipeline rank, the peak activation memory of one training step
(autograd-saved tensors plus deferred weight-gradient inputs, measured by saved-tensor hooks in the
engine) in MiB and in micro-batches (the rank's AFAB peak / m = one micro-batch's activations),
and the ratio to AFAB measured in the same run. 1F1B should hold at most p - r micro-batches on rank r
(first stage: p), AFAB all m. Then the bytes each rank sends forward per micro-batch with the Block
AttnRes payload (partial + committed blocks) against a plain residual stream (one [B, T, D] tensor)
of the same model and partition.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.pipeline_trace import traced_step  # noqa: E402

MiB = 2 ** 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro-batches", type=int, default=None, help="default 2 * pp")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--schedules", nargs="+", default=["afab", "1f1b", "interleaved_1f1b", "zb_h1"])
    a = ap.parse_args(argv)
    from parallel.testing import run_distributed

    out = {}
    for p in a.pp:
        m = a.micro_batches or 2 * p
        res = {}
        for sched in a.schedules:
            vp = 2 if sched == "interleaved_1f1b" else 1
            res[sched] = run_distributed(traced_step, p, m, sched, a.layers, a.seqlen, 1, None, vp, None, True,
                                         timeout_s=600)
        base = res.get("afab")
        print(f"\npp={p} m={m} layers={a.layers} seqlen={a.seqlen}: peak activation memory per rank")
        print(f"{'schedule':18s}" + "".join(f"  rank {r}: MiB  (mbs, x afab)" for r in range(p)))
        for sched, ranks in res.items():
            cells = []
            for r, x in enumerate(ranks):
                peak = x["peak_bytes"]
                if base is not None:
                    unit = base[r]["peak_bytes"] / m
                    cells.append(f"  {peak / MiB:11.2f} ({peak / unit:4.1f}, {peak / base[r]['peak_bytes']:4.2f})")
                else:
                    cells.append(f"  {peak / MiB:11.2f}")
            print(f"{sched:18s}" + "".join(cells))
            out[(p, sched)] = [x["peak_bytes"] for x in ranks]
        ranks = res[a.schedules[0]]
        print(f"pp={p}: forward p2p bytes per micro-batch, AttnRes payload vs plain residual")
        for r, x in enumerate(ranks[:-1]):
            sent = x["p2p_bytes"]["F"]
            nxt = ranks[r + 1]["blocks_in"][0]
            plain = sent / (1 + nxt)
            print(f"  rank {r} -> {r + 1}: {sent / 1024:8.1f} KiB = (1 partial + {nxt} blocks) x "
                  f"{plain / 1024:.1f} KiB; plain residual {plain / 1024:.1f} KiB; ratio {sent / plain:.1f}x")
    return out


if __name__ == "__main__":
    main()
