"""Expert-load report of a run: ``python tools/expert_load.py RUN_DIR [--out DIR]``.

Reads ``RUN_DIR/expert_load.jsonl`` (written by ``moonep.stats.LoadRecorder.write_jsonl``) and writes
``expert_load_heatmap.png`` (layer x expert tokens, last logged step), ``expert_load_ranks.png``
(per-rank rows before/after MoonEP over steps: max/mean per step, one line per layer) and
``expert_load_replicas.png`` (replicas per layer over steps) into ``--out`` (default RUN_DIR), then
prints a per-layer summary table of the last step.
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


def main(argv=None) -> list[Path]:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    recs = load(args.run_dir)
    out = Path(args.out or args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    layers = sorted(recs[-1]["layers"], key=int)
    steps = [r["step"] for r in recs]
    files = []

    heat = np.array([recs[-1]["layers"][i]["tokens_per_expert"] for i in layers], dtype=float)
    fig, ax = plt.subplots(figsize=(10, 0.3 * len(layers) + 2))
    im = ax.imshow(heat, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("expert"), ax.set_ylabel("MoE layer"), ax.set_yticks(range(len(layers)), layers)
    ax.set_title(f"tokens per expert, step {steps[-1]}")
    fig.colorbar(im, ax=ax)
    files.append(out / "expert_load_heatmap.png")
    fig.savefig(files[-1], dpi=80, bbox_inches="tight"), plt.close(fig)

    def ratio(rows):
        a = np.asarray(rows, dtype=float)
        return float(a.max() / max(a.mean(), 1e-12))

    fig, ax = plt.subplots(figsize=(8, 4))
    for i in layers:
        pts = [(r["step"], r["layers"][i]) for r in recs if i in r["layers"]]
        ax.plot([s for s, _ in pts], [ratio(d["rows_before"]) for _, d in pts], "--", label=f"L{i} before")
        ax.plot([s for s, _ in pts], [ratio(d["rows_after"]) for _, d in pts], "-", label=f"L{i} after")
    ax.set_xlabel("step"), ax.set_ylabel("max / mean rows per rank"), ax.legend(fontsize=6, ncol=2)
    ax.set_title("per-rank load before / after MoonEP")
    files.append(out / "expert_load_ranks.png")
    fig.savefig(files[-1], dpi=80, bbox_inches="tight"), plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    for i in layers:
        pts = [(r["step"], r["layers"][i]["replicas"]) for r in recs if i in r["layers"]]
        ax.plot([s for s, _ in pts], [v for _, v in pts], label=f"L{i}")
    ax.set_xlabel("step"), ax.set_ylabel("replicas per call"), ax.legend(fontsize=6, ncol=2)
    files.append(out / "expert_load_replicas.png")
    fig.savefig(files[-1], dpi=80, bbox_inches="tight"), plt.close(fig)

    print(f"step {steps[-1]} ({len(recs)} logged steps)")
    print(f"{'layer':>5} {'calls':>5} {'maxvio_before':>13} {'maxvio_after':>12} {'replicas':>8} "
          f"{'token_MB':>9} {'weight_MB':>9} {'hot_expert':>10} {'hot_share':>9}")
    for i in layers:
        d = recs[-1]["layers"][i]
        tok = np.asarray(d["tokens_per_expert"], dtype=float)
        print(f"{i:>5} {d['calls']:>5} {d['maxvio_before']:>13.3f} {d['maxvio_after']:>12.3f} {d['replicas']:>8.1f} "
              f"{d['token_bytes'] / 2**20:>9.2f} {d['weight_bytes'] / 2**20:>9.2f} {int(tok.argmax()):>10} "
              f"{tok.max() / max(tok.sum(), 1):>9.3f}")
    for f in files:
        print(f"wrote {f}")
    return files


if __name__ == "__main__":
    main()
