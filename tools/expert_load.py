"""Expert-load report of a training run: three PNGs and a per-layer table.

    python tools/expert_load.py RUN_DIR [--out DIR]

Reads ``RUN_DIR/expert_load.jsonl`` (one line per logging window, written by
``moonep.stats.LoadRecorder.write_jsonl``) and writes into ``--out`` (default RUN_DIR):

  expert_load_heatmap.png   tokens per expert of every MoE layer in the last logging window
  expert_load_ranks.png     per-EP-rank imbalance over steps, before MoonEP (home experts only)
                            and after (with its replicas): max / mean rows per rank, the mean over
                            layers as a line, the range over layers shaded
  expert_load_replicas.png  MoonEP replicas per MoE call, layer x step

and prints a table of the last window. Two different imbalance figures appear there, named apart:
  rank_imbal_before/after   max / mean rows per EP rank - 1 (what MoonEP evens out; the metrics
                            moe/rank_imbalance_before and moe/rank_imbalance_after)
  expert_maxvio             max / mean tokens per expert - 1 over the window (what Quantile Balancing
                            evens out; the train log's "maxvio", metric expert_load_max_violation, is
                            the same per step, averaged over layers)
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run_dir) -> list[dict]:
    path = Path(run_dir) / "expert_load.jsonl"
    if not path.exists():
        raise ValueError(f"{path} not found: run training with MoE load recording (moonep.stats) first")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not recs:
        raise ValueError(f"{path} is empty")
    return recs


def _ratio(rows) -> float:
    """max / mean of a list of per-rank row counts (1.0 = balanced)."""
    import numpy as np

    a = np.asarray(rows, dtype=float)
    return float(a.max() / max(a.mean(), 1e-12)) if a.size else float("nan")


def _step_ticks(ax, steps, axis="x") -> None:
    from matplotlib.ticker import MaxNLocator

    if len(steps) <= 12:  # every logged step, as it is
        getattr(ax, f"set_{axis}ticks")(steps)
        if len(steps) == 1:
            getattr(ax, f"set_{axis}lim")(steps[0] - 1, steps[0] + 1)
    else:
        getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True, nbins=10))


def plot_heatmap(recs, layers, out, plt, np) -> Path:
    heat = np.array([recs[-1]["layers"][i]["tokens_per_expert"] for i in layers], dtype=float)
    E = heat.shape[1]
    fig, ax = plt.subplots(figsize=(min(16, 6 + E / 16), 0.35 * len(layers) + 2))
    im = ax.imshow(heat, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("expert index")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(layers)), layers)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"Tokens per expert, logging window ending at step {recs[-1]['step']}")
    fig.colorbar(im, ax=ax, label="tokens routed to the expert")
    path = out / "expert_load_heatmap.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_ranks(recs, layers, out, plt, np) -> Path:
    steps = [r["step"] for r in recs]
    R = len(recs[-1]["layers"][layers[0]]["rows_before"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    series = (("rows_before", "before MoonEP (home experts only)", "tab:red"),
              ("rows_after", "after MoonEP (with its replicas)", "tab:blue"))
    top, handles, labels = 1.0, [], []
    for key, label, color in series:
        vals = np.array([[_ratio(r["layers"][i][key]) if i in r["layers"] else np.nan for i in layers]
                         for r in recs])
        mean, lo, hi = np.nanmean(vals, 1), np.nanmin(vals, 1), np.nanmax(vals, 1)
        top = max(top, float(np.nanmax(hi)))
        band = ax.fill_between(steps, lo, hi, color=color, alpha=0.18, linewidth=0)
        (line,) = ax.plot(steps, mean, "-o", color=color, markersize=3.5, linewidth=1.8)
        handles.append((band, line))
        nl = f"{len(layers)} layers" if len(layers) > 1 else "1 layer"
        labels.append(f"{label}: mean of {nl}, shaded min to max (last {mean[-1]:.2f})")
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1)
    ax.annotate("1.0 = balanced", xy=(0.995, 1.0), xycoords=("axes fraction", "data"), xytext=(0, -3),
                textcoords="offset points", ha="right", va="top", fontsize=8, color="0.35")
    ax.set_ylim(1.0 - 0.08 * (top - 1.0) - 0.03, top + 0.05 * (top - 1.0) + 0.02)
    ax.set_xlabel("training step (end of logging window)")
    ax.set_ylabel("max / mean rows per EP rank")
    ax.set_title(f"Per-rank load imbalance over {R} EP ranks, before and after MoonEP" if R > 1 else
                 "Per-rank load imbalance (one EP rank: no expert parallelism, nothing to balance)")
    _step_ticks(ax, steps)
    ax.grid(True, alpha=0.3)
    from matplotlib.legend_handler import HandlerTuple

    ax.legend(handles, labels, handler_map={tuple: HandlerTuple(ndivide=None, pad=0)}, fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    path = out / "expert_load_ranks.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_replicas(recs, layers, out, plt, np) -> Path:
    steps = [r["step"] for r in recs]
    grid = np.array([[r["layers"][i]["replicas"] if i in r["layers"] else np.nan for r in recs] for i in layers],
                    dtype=float)
    fig, ax = plt.subplots(figsize=(min(16, max(8, 4 + 0.45 * len(steps))), 0.4 * len(layers) + 2.2))
    finite = grid[np.isfinite(grid)]
    vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if vmax <= vmin:  # one value everywhere
        vmin, vmax = 0.0, max(vmax, 1.0)
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="YlGnBu", vmin=vmin, vmax=vmax)
    if grid.size <= 600:  # numbers in the cells while they stay readable
        for (y, x), v in np.ndenumerate(grid):
            if np.isfinite(v):
                ax.text(x, y, f"{v:g}", ha="center", va="center", fontsize=7,
                        color="white" if (v - vmin) > 0.6 * (vmax - vmin) else "black")
    ax.set_yticks(range(len(layers)), layers)
    every = max(1, len(steps) // 12)
    ax.set_xticks(range(0, len(steps), every), [str(s) for s in steps[::every]])
    ax.set_xlabel("training step (end of logging window)")
    ax.set_ylabel("MoE layer")
    note = "" if np.nanmax(grid) > 0 else "\n(none: no expert parallelism, or the load needed none)"
    ax.set_title(f"MoonEP replicas per MoE call, by layer and step{note}")
    fig.colorbar(im, ax=ax, label="replicas per call (mean over the window)")
    path = out / "expert_load_replicas.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="training run directory holding expert_load.jsonl")
    ap.add_argument("--out", default=None, help="directory for the three PNGs (default: RUN_DIR)")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = load(args.run_dir)
    out = Path(args.out or args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = sorted(recs[-1]["layers"], key=int)
    files = [plot_heatmap(recs, layers, out, plt, np), plot_ranks(recs, layers, out, plt, np),
             plot_replicas(recs, layers, out, plt, np)]

    print(f"step {recs[-1]['step']} ({len(recs)} logged windows)")
    print(f"{'layer':>5} {'calls':>5} {'rank_imbal_before':>17} {'rank_imbal_after':>16} {'expert_maxvio':>13} "
          f"{'replicas':>8} {'token_MB':>9} {'weight_MB':>9} {'hot_expert':>10} {'hot_share':>9}")
    for i in layers:
        d = recs[-1]["layers"][i]
        tok = np.asarray(d["tokens_per_expert"], dtype=float)
        expert_vio = tok.max() / tok.mean() - 1 if tok.mean() > 0 else 0.0
        print(f"{i:>5} {d['calls']:>5} {d['maxvio_before']:>17.3f} {d['maxvio_after']:>16.3f} {expert_vio:>13.3f} "
              f"{d['replicas']:>8.1f} {d['token_bytes'] / 2**20:>9.2f} {d['weight_bytes'] / 2**20:>9.2f} "
              f"{int(tok.argmax()):>10} {tok.max() / max(tok.sum(), 1):>9.3f}")
    print("rank_imbal: max/mean rows per EP rank - 1 (metrics moe/rank_imbalance_*); expert_maxvio: max/mean tokens per "
          "expert - 1 over the window (the train log's 'maxvio' is its per-step mean over layers)")
    for f in files:
        print(f"wrote {f}")
    return files


if __name__ == "__main__":
    import sys

    try:
        main()
    except ValueError as e:
        print(f"expert_load: error: {e}", file=sys.stderr)
        sys.exit(2)
