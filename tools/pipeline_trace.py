"""Per-rank pipeline timeline: run training steps under a pipeline schedule on gloo ranks, draw
the last step's F / B / W / communication ops as a Gantt chart (PNG) and print the measured bubble
fraction next to the schedule's theory.

    python tools/pipeline_trace.py --pp 4 --micro-batches 8 --schedule zb_h1 --synthetic --out zb.png
    python tools/pipeline_trace.py --pp 2 --vp 2 --schedule interleaved_1f1b --layers 8 --out il.png

Measured bubble per rank = 1 - (time in F, B and W) / (step span from the first op of any rank to
the last op of any rank); the printed figure is the mean over ranks. Two theories are printed: the
closed form ((p-1)/(m+p-1) for 1F1B, (p-1)/(vp*m+p-1) interleaved, (p-1)/(3m+p-1) for ZB-H1 with
equal F/B/W) and the event simulation of the same action lists with each rank's measured mean op
times and free communication (schedules.simulate), which also covers unequal op times and stages. ``--synthetic`` runs
balanced sleeping layers (parallel/pipeline_trace.py) instead of k3_tiny, whose stages are not
exactly balanced (the last one also runs lm_head + loss) and whose ranks share this machine's cores.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.pipeline.schedules import SCHEDULES, closed_form_bubble, theoretical_bubble  # noqa: E402
from parallel.pipeline_trace import bubble, mean_op_times, traced_step  # noqa: E402


def draw(traces, t0, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "tab:blue", "B": "tab:green", "W": "tab:orange"}
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.6 * len(traces)))
    for r, tr in enumerate(traces):
        for op, chunk, mb, s, e in tr:
            c = colors.get(op, "lightgray")
            ax.barh(r, (e - s) * 1e3, left=(s - t0) * 1e3, color=c, edgecolor="black", linewidth=0.3,
                    alpha=1.0 if chunk == 0 else 0.6, hatch=None if chunk == 0 else "//")
            if op in colors:
                ax.text((s - t0 + (e - s) / 2) * 1e3, r, str(mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(traces)), [f"rank {r}" for r in range(len(traces))])
    ax.invert_yaxis()
    ax.set_xlabel("ms  (blue F, green B, orange W, gray p2p; hatched = model chunk >= 1)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--vp", type=int, default=1, help="model chunks per rank (interleaved_1f1b needs >= 2)")
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the model")
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layout", default=None, help="layers per model chunk, e.g. 4,4 (default: the cost model)")
    ap.add_argument("--synthetic", action="store_true", help="balanced sleeping layers instead of k3_tiny")
    ap.add_argument("--op-ms", type=float, nargs=3, default=(20.0, 20.0, 20.0), metavar=("F", "B", "W"),
                    help="synthetic layer times in ms (default 20 20 20)")
    ap.add_argument("--out", default="pipeline_trace.png")
    a = ap.parse_args(argv)
    from parallel.testing import run_distributed

    layout = [int(x) for x in a.layout.split(",")] if a.layout else None
    synthetic = tuple(t / 1e3 for t in a.op_ms) if a.synthetic else None
    res = run_distributed(traced_step, a.pp, a.micro_batches, a.schedule, a.layers, a.seqlen, a.steps, layout,
                          a.vp, synthetic, timeout_s=600)
    traces = [r["trace"] for r in res]
    mean, per, t0 = bubble(traces)
    p, m, vp = a.pp, a.micro_batches, a.vp
    closed = closed_form_bubble(a.schedule, p, m, vp)
    ops = mean_op_times(traces)
    sim = theoretical_bubble(a.schedule, p, m, vp, mean_op_times(traces, per_rank=True))
    closed_s = "n/a" if closed is None else f"{closed:.3f}"
    title = (f"{a.schedule} pp={p} vp={vp} m={m}: bubble measured {mean:.3f}, closed form {closed_s}, "
             f"simulated {sim:.3f}")
    draw(traces, t0, a.out, title)
    for r, (x, f) in enumerate(zip(res, per)):
        print(f"rank {r}: layers {', '.join(f'{s}..{e - 1}' for s, e in x['layers'])}  bubble {f:.3f}")
    print("mean op ms: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in ops.items()))
    print(f"{a.schedule} pp={p} vp={vp} m={m}: measured bubble {mean:.3f} (mean over ranks), closed form "
          f"{closed_s}, simulated with each rank's measured op times {sim:.3f}; chart: {a.out}")
    return mean, closed, sim


if __name__ == "__main__":
    main()
