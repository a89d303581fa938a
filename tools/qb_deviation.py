"""Histogram vs exact Quantile Balancing on k3_tiny's real router scores: bias and balance deviation.

    PYTHONPATH=. python tools/qb_deviation.py [--steps 8] [--batch 8] [--seq-len 512] [--train-steps 0]

Scores: k3_tiny (vision off) runs forward on demo-corpus batches (megak3.data "demo", built once
and cached); every MoE layer's sigmoid router scores of a step's batch feed the QB accumulators.
With ``--train-steps N`` the model is first trained N AdamW steps on the same stream (routers
trained by the LM loss, QB in the loop), else the routers are at initialisation. The forward
runs with the EXACT method's biases (both methods see the same scores each step; the histogram
trajectories follow their own biases through the margins).

Per step, over all MoE layers (max over layers):
* one-step |dB|: max |b_hist - b_exact| when both solve from the same (exact) bias, i.e. the
  method's own error on that batch;
* trajectory |dB|: max |b_hist - b_exact| of the two bias trajectories since step 0;
* maxvio: in-sample max-violation (max load / mean load - 1) of the batch routed with the new bias
  (the balance each method reaches on the tokens it measured), exact and per histogram variant;
* |b|max of the exact bias, and the share of margins a fixed [-1, 1) range would clamp.
Histogram variants: bins 4096 and 1024, range following the bias (the default) and fixed [-1, 1).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megak3.config import load_model_config  # noqa: E402
from megak3.data.config import DataConfig, resolve_dataset  # noqa: E402
from megak3.data.indexed import IndexedDataset  # noqa: E402
from megak3.data.packing import Batcher, PackedDataset  # noqa: E402
from megak3.data.tokenizer import load_tokenizer  # noqa: E402
from megak3.model.balancing import QBAccumulator, max_violation, token_margins  # noqa: E402
from megak3.model.k3 import build_model  # noqa: E402


def loads(s_TE, b_E, k):
    return torch.bincount((s_TE + b_E).topk(k, dim=1).indices.reshape(-1), minlength=s_TE.shape[1])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="QB steps (one batch each)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--train-steps", type=int, default=0, help="AdamW steps on the LM loss before measuring")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    prefix, tok = resolve_dataset(DataConfig())
    pad = load_tokenizer(tok).pad_id
    data = iter(Batcher(PackedDataset(IndexedDataset(prefix), args.seq_len, "train", 0.01, args.seed, pad),
                        args.batch, 0, 1))
    cfg = load_model_config("k3_tiny", **{"vision.enabled": False})
    model = build_model(cfg, seed=args.seed)
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    moe = model.moe_layers()
    biases = [m.gate.e_score_correction_bias for m in moe]
    t0 = time.perf_counter()

    if args.train_steps:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        model.train()
        for _ in range(args.train_steps):
            b = next(data)
            out = model(b["input_ids"], labels=b["labels"], cu_seqlens=b["cu_seqlens"])
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for st, bias in zip(out.moe_stats, biases):
                    acc = QBAccumulator(E, k, "exact")
                    acc.add(st.scores_TE, bias)
                    bias.copy_(acc.solve(bias))
        print(f"trained {args.train_steps} steps: last loss {out.loss.item():.3f} ({time.perf_counter() - t0:.1f} s)")

    variants = {f"h{bins}{'' if follow else 'fix'}": (bins, follow)
                for bins in (4096, 1024) for follow in (True, False)}
    traj = {v: [b.detach().clone() for b in biases] for v in variants}
    model.eval()
    print(f"k3_tiny: E={E} top_k={k}, {len(moe)} MoE layers, {args.batch}x{args.seq_len} tokens/step, "
          f"routers {'trained' if args.train_steps else 'at init'}")
    head = f"{'step':>4} {'|b|max':>7} {'clamp%':>7} {'maxvio exact':>12}"
    for v in variants:
        head += f" | {v}: {'1step|dB|':>9} {'traj|dB|':>9} {'maxvio':>7}"
    print(head)
    worst = {v: [0.0, 0.0, 0.0] for v in variants}
    mv_exact_all = []
    for step in range(args.steps):
        b = next(data)
        with torch.no_grad():
            out = model(b["input_ids"], cu_seqlens=b["cu_seqlens"])
        row = {v: [0.0, 0.0, 0.0] for v in variants}
        mv_exact, bmax, clamp = 0.0, 0.0, 0.0
        new_exact = []
        for li, (st, bias) in enumerate(zip(out.moe_stats, biases)):
            s = st.scores_TE
            ex = QBAccumulator(E, k, "exact")
            ex.add(s, bias)
            be = ex.solve(bias)
            new_exact.append(be)
            mv_exact = max(mv_exact, float(max_violation(loads(s, be, k))))
            bmax = max(bmax, float(bias.abs().max()))
            m = token_margins(s, bias, k)
            clamp = max(clamp, float(((m < -1) | (m >= 1)).float().mean()) * 100)
            for v, (bins, follow) in variants.items():
                rng = {} if follow else {"lo": -1.0, "hi": 1.0}
                one = QBAccumulator(E, k, "histogram", bins=bins, **rng)   # same input bias as exact
                one.add(s, bias)
                bh1 = one.solve(bias)
                tr = QBAccumulator(E, k, "histogram", bins=bins, **rng)    # its own trajectory
                tr.add(s, traj[v][li])
                bh = tr.solve(traj[v][li])
                traj[v][li] = bh
                r = row[v]
                r[0] = max(r[0], float((bh1 - be).abs().max()))
                r[1] = max(r[1], float((bh - be).abs().max()))
                r[2] = max(r[2], float(max_violation(loads(s, bh1, k))))
        for bias, be in zip(biases, new_exact):
            bias.copy_(be)
        mv_exact_all.append(mv_exact)
        line = f"{step:>4} {bmax:>7.4f} {clamp:>7.3f} {mv_exact:>12.4f}"
        for v in variants:
            r = row[v]
            line += f" | {v}: {r[0]:>9.2e} {r[1]:>9.2e} {r[2]:>7.4f}"
            worst[v] = [max(a, c) for a, c in zip(worst[v], r)]
        print(line, flush=True)
    summary = "; ".join(f"{v}: one-step |dB| <= {w[0]:.1e}, trajectory |dB| <= {w[1]:.1e}, maxvio <= {w[2]:.3f}"
                        for v, w in worst.items())
    print(f"summary ({args.steps} steps, {time.perf_counter() - t0:.0f} s): exact maxvio <= {max(mv_exact_all):.3f}; "
          + summary)
    return {"worst": worst, "exact_maxvio": max(mv_exact_all)}


if __name__ == "__main__":
    main()
