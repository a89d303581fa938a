"""Per-rank pipeline timeline: run one K3 training step under a pipeline schedule on gloo ranks,
draw the recorded F / B / communication ops as a Gantt chart (PNG) and print the measured bubble
fraction next to the schedule's theory ((p-1)/(m+p-1) for 1F1B and AFAB).

    python tools/pipeline_trace.py --pp 2 --micro-batches 8 --schedule 1f1b --out trace.png

Measured bubble per rank = 1 - (time in F and B) / (step span from the first op of any rank to the
last op of any rank); the printed figure is the mean over ranks. Stages of the real model are not
perfectly balanced (the last stage also runs lm_head + loss), so expect the measured value to sit
near, not on, the theory.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.pipeline.trace import bubble, traced_step  # noqa: E402


def draw(traces, t0, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "tab:blue", "B": "tab:green"}
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.6 * len(traces)))
    for r, tr in enumerate(traces):
        for op, mb, s, e in tr:
            c = colors.get(op, "lightgray")
            ax.barh(r, (e - s) * 1e3, left=(s - t0) * 1e3, color=c, edgecolor="black", linewidth=0.3)
            if op in colors:
                ax.text((s - t0 + (e - s) / 2) * 1e3, r, str(mb), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(traces)), [f"stage {r}" for r in range(len(traces))])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "afab"))
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the tiny model")
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layout", default=None, help="layers per stage, e.g. 4,4 (default: the cost model)")
    ap.add_argument("--out", default="pipeline_trace.png")
    a = ap.parse_args(argv)
    from parallel.testing import run_distributed

    layout = [int(x) for x in a.layout.split(",")] if a.layout else None
    res = run_distributed(traced_step, a.pp, a.micro_batches, a.schedule, a.layers, a.seqlen, a.steps, layout,
                          timeout_s=600)
    traces = [r["trace"] for r in res]
    mean, per, t0 = bubble(traces)
    p, m = a.pp, a.micro_batches
    theory = (p - 1) / (m + p - 1)
    title = f"{a.schedule} pp={p} m={m}: bubble measured {mean:.3f}, theory {theory:.3f}"
    draw(traces, t0, a.out, title)
    for r, (x, f) in enumerate(zip(res, per)):
        print(f"stage {r}: layers {x['layers'][0]}..{x['layers'][1] - 1}  bubble {f:.3f}")
    print(f"{a.schedule} pp={p} m={m}: measured bubble {mean:.3f} (mean over stages), theory (p-1)/(m+p-1) = "
          f"{theory:.3f}; chart: {a.out}")
    return mean, theory


if __name__ == "__main__":
    main()
