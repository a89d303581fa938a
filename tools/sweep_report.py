#!/usr/bin/env python
"""Table and bar chart of a layout sweep (``python -m megak3.train -m parallel=a,b,c ...``).

    python tools/sweep_report.py multirun/20260101-120000 [--png sweep.png] [--json rows.json]

One row per job directory (``status.json`` + ``metrics.jsonl``, see megak3/launch/sweep.py):
layout, ranks, tokens/s, step time, peak memory per rank (max and min over the ranks), final train
and validation loss, status. Sorted by throughput (fastest first); failed jobs come last with
their error line. The PNG (default SWEEP_DIR/sweep_report.png) is a bar chart of tokens/s.
Exit status: 0, or 2 on a missing/empty sweep directory.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megak3.launch.sweep import find_jobs, summarize_job  # noqa: E402


def rows_of(sweep_dir) -> list:
    rows = [summarize_job(d) for d in find_jobs(sweep_dir)]
    if not rows:
        raise ValueError(f"{sweep_dir}: no job directories (status.json / metrics.jsonl) found")

    def key(r):
        ok = r["status"] == "ok" and r["tokens_per_s"] is not None
        return (0 if ok else 1, -(r["tokens_per_s"] or 0.0), r["job"])

    return sorted(rows, key=key)


def _f(v, fmt):
    return "-" if v is None else fmt.format(v)


def format_table(rows: list) -> str:
    head = f"{'layout':<16} {'ranks':>5} {'tokens/s':>10} {'step ms':>9} {'peak MiB/rank (max/min)':>24} " \
           f"{'loss':>8} {'val':>8}  status"
    out = [head, "-" * len(head)]
    for r in rows:
        mem = r["peak_memory_mb_per_rank"] or []
        mem_s = f"{max(mem):,.0f} / {min(mem):,.0f}" if mem else "-"
        status = r["status"] + (f": {r['error']}" if r["status"] != "ok" and r["error"] else "")
        out.append(f"{r['layout']:<16} {_f(r['nproc'], '{:d}'):>5} {_f(r['tokens_per_s'], '{:,.0f}'):>10} "
                   f"{_f(r['step_time_ms'], '{:.1f}'):>9} {mem_s:>24} {_f(r['final_loss'], '{:.4f}'):>8} "
                   f"{_f(r['final_val_loss'], '{:.4f}'):>8}  {status}")
    return "\n".join(out)


def bar_chart(rows: list, path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["layout"] for r in rows]
    vals = [r["tokens_per_s"] or 0.0 for r in rows]
    colors = ["tab:blue" if r["status"] == "ok" else "tab:red" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.0 + 0.9 * len(rows)), 3.5))
    ax.bar(range(len(rows)), vals, color=colors)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("tokens / s")
    ax.set_title("layout sweep throughput (red: failed)")
    for i, r in enumerate(rows):
        if r["status"] != "ok":
            ax.text(i, 0, r["status"], ha="center", va="bottom", color="tab:red", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir")
    ap.add_argument("--png", default=None, help="bar chart path (default SWEEP_DIR/sweep_report.png)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        rows = rows_of(args.sweep_dir)
    except ValueError as e:
        print(f"sweep_report: error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    png = bar_chart(rows, args.png or Path(args.sweep_dir) / "sweep_report.png")
    print(f"chart: {png}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
