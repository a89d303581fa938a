#!/usr/bin/env python
"""Per-rank memory and step time of parallel layouts, against one process measured in the same run.

    python tools/bench_layouts.py [--layouts 1x1,2x1,4x1,1x2,1x4,2x2] [--sp] [--steps 3] [--seqlen 64]

Each layout is tp x dp on tp*dp gloo ranks (CPU), every rank running the production step
(megak3.train.step.RankStep through megak3.train.parity: ZeRO-1 Muon/AdamW, clip, Quantile
Balancing; process groups from parallel.state.init_parallel). For every layout it prints, per rank: model
parameter bytes (what the rank holds of the weights), optimizer bytes (fp32 main params + Muon /
AdamW state owned under ZeRO-1), the analytic expectation for both, and the median step time as a
ratio to the single-process run. Analytic model bytes: replicated params + sharded params / tp.
Analytic optimizer bytes: (4 + state bytes per element) x local params / dp (whole-parameter
ownership makes the per-rank figure vary around it by at most the largest parameter).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def model_overrides():
    """The parity-test model (parallel.testing.PARITY_MODEL) at twice its widths."""
    from parallel.testing import PARITY_MODEL

    return {**PARITY_MODEL, "hidden_size": 128, "dense_intermediate_size": 256, "kda.head_dim": 32,
            "kda.gate_rank": 16, "kda.chunk_size": 32, "mla.q_lora_rank": 64, "mla.kv_lora_rank": 32,
            "mla.qk_nope_head_dim": 16, "moe.num_experts": 16, "moe.expert_intermediate_size": 64,
            "moe.latent_size": 64, "vocab_size": 2048}


def measure(rank, world, tp, dp, sp, steps, seqlen, batch):
    """One rank: the production RankStep (megak3.train.parity) at tp x dp; its bytes and step time."""
    import torch
    import torch.distributed as dist

    from megak3.train.parity import parity_job, parity_state, parity_step
    from megak3.train.step import RankStep
    from parallel.plan import canonical_name

    torch.set_num_threads(1)  # as every run_distributed rank: the one-process baseline on one thread too
    job = parity_job(tp, dp, sp, model_overrides(), batch, seqlen, seed=0, lr=1e-3, steps=steps + 1)
    rs = RankStep(job, parity_state(job, world), "cpu", grad_accum=1)
    times = []
    for step in range(steps + 1):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        parity_step(rs, step, steps + 1, batch, seqlen)
        if world > 1:
            dist.barrier()
        if step:  # the first step pays one-time costs
            times.append(time.perf_counter() - t0)
    dims = rs.plan.tp_shard_dim
    params = [(canonical_name(n), p.numel()) for n, p in rs.model.named_parameters()]
    sharded = sum(k for n, k in params if dims.get(n) is not None)
    replicated = sum(k for n, k in params if dims.get(n) is None)
    rep = rs.optimizer.memory_report()
    return {"rank": rank, "param_bytes": 4 * (sharded + replicated), "sharded_local": sharded,
            "replicated": replicated, "optimizer_bytes": rep["main_param_bytes"] + rep["optimizer_state_bytes"],
            "state_expected_total": rep.get("expected_state_bytes"), "step_s": statistics.median(times)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="1x1,2x1,4x1,1x2,1x4,2x2", help="comma list of TPxDP")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism for tp > 1")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="global sequences per step")
    args = ap.parse_args(argv)
    from parallel.testing import run_distributed

    layouts = [tuple(int(v) for v in s.split("x")) for s in args.layouts.split(",")]
    if (1, 1) not in layouts:
        layouts.insert(0, (1, 1))
    results = {}
    for tp, dp in layouts:
        if tp * dp == 1:
            results[(1, 1)] = [measure(0, 1, 1, 1, False, args.steps, args.seqlen, args.batch)]
        else:
            results[(tp, dp)] = run_distributed(measure, tp * dp, tp, dp, args.sp and tp > 1, args.steps,
                                                args.seqlen, args.batch, timeout_s=900)
    base = results[(1, 1)][0]
    full_params = base["param_bytes"]
    full_opt = base["optimizer_bytes"]
    print(f"model {full_params / 2**20:.2f} MiB fp32; optimizer (main + state) {full_opt / 2**20:.2f} MiB "
          f"on one process; step {base['step_s'] * 1e3:.0f} ms")
    print(f"{'layout':>9} {'ranks':>5} | {'params/rank MiB':>15} {'expected':>8} | "
          f"{'optim/rank MiB (min..max)':>26} {'expected':>8} | {'step vs 1 proc':>14}")
    for (tp, dp), rs in results.items():
        p = max(r["param_bytes"] for r in rs)
        # analytic: what tp=1 shards, divided by tp, plus what stays replicated
        sharded_full = rs[0]["sharded_local"] * tp
        exp_p = 4 * (rs[0]["replicated"] + sharded_full / tp)
        o = [r["optimizer_bytes"] for r in rs]
        exp_o = full_opt * (p / full_params) / dp
        step = statistics.median(r["step_s"] for r in rs)
        print(f"{f'tp{tp}xdp{dp}':>9} {tp * dp:>5} | {p / 2**20:>15.3f} {exp_p / 2**20:>8.3f} | "
              f"{min(o) / 2**20:>12.3f} .. {max(o) / 2**20:<11.3f} {exp_o / 2**20:>8.3f} | "
              f"{step / base['step_s']:>13.2f}x")


if __name__ == "__main__":
    main()
