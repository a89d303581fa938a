"""Replica-weight fetch hidden behind the shared experts (issue 19), measured on gloo in one run.

    PYTHONPATH=. python tools/bench_overlap.py [--ranks 2] [--experts 4] [--reps 5]

[1] the collective alone: t_fetch = blocking all_to_all_single of the replica weights (k3_mini
    expert size, fp32), t_shared = the shared-expert MLP alone, t_seq = fetch then MLP, t_ovl = the
    fetch issued with async_op, MLP, wait (what MoonEPDispatcher does). Hidden fraction =
    (t_seq - t_ovl) / t_fetch (1 = the fetch is free, 0 = no overlap).
[2] a skewed LatentMoE layer (k3_mini widths) under MoonEP: forward+backward step time with
    ``overlap_shared`` on vs off, same run, same outputs (the ratio is printed).
On a 2-core box shared with other jobs gloo's background thread competes with the compute for a
core, so the CPU figure is a floor for what NCCL's separate engine gets.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def _bench(rank, world, n_exp, reps):
    torch.set_num_threads(1)
    from megak3.config import load_model_config
    from megak3.model.ffn import SiTUGLUMLP
    from megak3.model.moe import LatentMoE
    from moonep.buffers import BufferPool
    from moonep.config import MoonEPConfig
    from parallel.expert_parallel import parallelize_ep

    cfg = load_model_config("k3_mini")
    L, m, D = cfg.moe.latent_size, cfg.moe.expert_intermediate_size, cfg.hidden_size
    P = 3 * L * m
    send = torch.randn(world * n_exp, P)
    recv = torch.empty_like(send)
    shared = SiTUGLUMLP(D, cfg.moe.num_shared_experts * m, 4.0, 25.0)
    x = torch.randn(2048, D)

    def med(fn):
        ts = []
        for _ in range(reps):
            dist.barrier()
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return sorted(ts)[len(ts) // 2]

    def fetch():
        dist.all_to_all_single(recv, send)

    def comp():
        with torch.no_grad():
            shared(x)

    def seq():
        fetch()
        comp()

    def ovl():
        w = dist.all_to_all_single(recv, send, async_op=True)
        comp()
        w.wait()

    fetch(), comp()
    t = {k: med(f) for k, f in (("fetch", fetch), ("shared", comp), ("seq", seq), ("ovl", ovl))}

    torch.manual_seed(0)
    moe = LatentMoE(cfg)
    moe.gate.e_score_correction_bias.copy_(torch.linspace(0.3, 0, cfg.moe.num_experts))
    plan = parallelize_ep(moe, dist.group.WORLD, MoonEPConfig(), pool=BufferPool())
    d = plan.dispatchers[0]
    xs = torch.randn(512, D, generator=torch.Generator().manual_seed(rank))
    out = {}

    def layer():
        moe.zero_grad(set_to_none=True)
        y, _ = moe(xs)
        y.square().sum().backward()
        out["y"] = y.detach()

    layer_t = {}
    for flag in (False, True, False, True):
        d.overlap_shared = flag
        layer_t.setdefault(flag, []).append(med(layer))
        out[flag] = out["y"]
    same = torch.equal(out[True], out[False])
    return t, {k: min(v) for k, v in layer_t.items()}, same, d.last["num_replicas"]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4, help="replica experts sent to each peer")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from parallel.testing import run_distributed

    t, lt, same, nrep = run_distributed(_bench, args.ranks, args.experts, args.reps, timeout_s=600)[0]
    hidden = (t["seq"] - t["ovl"]) / t["fetch"]
    print(f"[1] gloo x{args.ranks}, {args.experts} k3_mini experts per peer (fp32): fetch {t['fetch'] * 1e3:.1f} ms, "
          f"shared MLP {t['shared'] * 1e3:.1f} ms, sequential {t['seq'] * 1e3:.1f} ms, overlapped "
          f"{t['ovl'] * 1e3:.1f} ms -> hidden fraction of the fetch {hidden:.2f}")
    print(f"[2] MoonEP layer fwd+bwd ({nrep} replicas): overlap on {lt[True] * 1e3:.1f} ms / off "
          f"{lt[False] * 1e3:.1f} ms = {lt[True] / lt[False]:.3f}; outputs identical: {same}")


if __name__ == "__main__":
    main()
