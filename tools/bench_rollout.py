#!/usr/bin/env python
"""Partial vs synchronous rollouts on a long-tailed response-length distribution, same work, one run.

    python tools/bench_rollout.py                       # ~1 min on 2 CPU cores (N=4, K=4, 32 samples)
    python tools/bench_rollout.py --samples 128 --long-fraction 0.05 --long 96 --lam 0.5

Measured (defaults, 2 shared CPU cores): partial / synchronous wall time per update x0.35, learner idle
fraction x0.69 (65% -> 45%), wall time per trained sample x1.40 (the partial mode makes 4x as many, smaller
updates, each paying the fixed cost of an update and a refit).

Both modes run the real loop (megak3/posttrain/rl.py: engine rollouts, RankStep update, refit) on the
same tiny random K3 (parallel.testing's PARITY_MODEL widths) with the same prompts and per-sample budgets;
every sample runs to its budget (ignore_eos), so the lengths are exactly the drawn distribution: most
samples ``--short`` tokens, a ``--long-fraction`` of them ``--long`` tokens. Each mode trains until
``--samples`` samples have been trained on. The synchronous mode (lambda = 1) waits for every sample of
the iteration; the partial mode updates once lambda N K samples are finished and resumes the rest first
in the next iteration. Printed: wall time per update and per trained sample, and the learner's idle
fraction (the share of the run's wall time spent generating, when the colocated learner waits), each as
partial / synchronous ratios.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_mode(lam: float, args, tok) -> dict:
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.optim.config import OptimConfig
    from megak3.posttrain.rl import RLConfig, RLRunner
    from megak3.job.config import JobConfig, TrainConfig
    from parallel.testing import PARITY_MODEL

    job = JobConfig(model=load_model_config("k3_tiny", **PARITY_MODEL), data=DataConfig(vocab_size=512),
                    optim=OptimConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0),
                    train=TrainConfig(max_steps=10 ** 6, global_batch_size=1, micro_batch_size=1, seed=1)).validate()
    rl = RLConfig(prompts=args.prompts, group_size=args.group_size, max_tokens=args.long, temperature=1.0,
                  partial_fraction=lam, ignore_eos=True, micro_batch_size=64, iterations=10 ** 6, seed=1)
    rng = np.random.default_rng(args.seed)
    budgets = lambda: [int(args.long if rng.random() < args.long_fraction else args.short)  # noqa: E731
                       for _ in range(args.group_size)]
    runner = RLRunner(job, rl, tok, budgets=budgets,
                      engine_options={"page_size": 16, "num_pages": 4096, "max_batch": 256})
    trained, updates, gen_s, train_s = 0, 0, 0.0, 0.0
    t0 = time.perf_counter()
    while trained < args.samples:
        rec = runner.iteration()
        gen_s += rec["gen_s"]
        if rec.get("trained"):
            trained += rec["trained"]
            updates += 1
            train_s += rec["train_s"] + rec["refit_s"]
    wall = time.perf_counter() - t0
    return {"wall": wall, "updates": updates, "trained": trained, "gen": gen_s, "train": train_s,
            "per_update": wall / updates, "per_sample": wall / trained, "idle": gen_s / wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="N prompts per iteration")
    ap.add_argument("--group-size", type=int, default=4, help="K rollouts per prompt")
    ap.add_argument("--samples", type=int, default=32, help="trained samples per mode (the same work)")
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=24)
    ap.add_argument("--long-fraction", type=float, default=0.1)
    ap.add_argument("--lam", type=float, default=0.5, help="lambda of the partial mode")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("prompts", "group_size", "samples", "short", "long"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')}={getattr(args, name)} must be >= 1", file=sys.stderr)
            return 2
    if not 0 < args.lam < 1 or not 0 <= args.long_fraction <= 1:
        print("error: --lam must lie in (0, 1) and --long-fraction in [0, 1]", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    from megak3.data.tokenizer import load_tokenizer
    from megak3.data.demo_sft import build_demo_sft_dataset

    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(build_demo_sft_dataset(d, 512, num_conversations=300, progress=False)[1])
    sync = run_mode(1.0, args, tok)
    part = run_mode(args.lam, args, tok)
    for name, r in (("synchronous", sync), (f"partial (lambda={args.lam})", part)):
        print(f"{name:>22}: {r['trained']} samples in {r['updates']} updates, {r['wall']:.1f} s; "
              f"{r['per_update']:.2f} s/update, {1000 * r['per_sample']:.0f} ms/sample, learner idle {r['idle']:.1%}")
    print(f"partial / synchronous: wall time per update x{part['per_update'] / sync['per_update']:.2f}, "
          f"per trained sample x{part['per_sample'] / sync['per_sample']:.2f}, "
          f"learner idle fraction x{part['idle'] / sync['idle']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
