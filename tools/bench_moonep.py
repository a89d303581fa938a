"""MoonEP benchmarks (issue 6 part 8); every figure is a ratio against a baseline measured here.

    PYTHONPATH=. python tools/bench_moonep.py [--reps 20] [--ranks 8 64 128]

1. planner time per layer, E=896, K=16, S=4096 tokens per rank, R in --ranks: torch vs C++;
2. max/mean rows per rank, MoonEP vs home placement (baseline EP), under Zipf skews;
3. bytes dispatched per token, latent (d/2) vs full-width rows, K3 dims (conf/model/k3_full.yaml);
4. replica weight bytes vs token bytes per layer at K3 scale (bf16), from the Zipf plans;
   replicas planned vs replica_lower_bound, and with moonep.tolerance=0.02.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import yaml

from moonep import _ext
from moonep.planner import plan_moonep, replica_lower_bound


def zipf_counts(R, E, T, a, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** a
    p = (p / p.sum())[torch.randperm(E, generator=g)]
    idx = torch.multinomial(p.expand(R, E).contiguous(), T, replacement=True, generator=g)
    return torch.zeros(R, E, dtype=torch.int64).scatter_add_(1, idx, torch.ones_like(idx))


def timed(fn, reps):
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 128])
    ap.add_argument("--zipf", type=float, nargs="+", default=[0.0, 0.6, 1.0, 1.2])
    args = ap.parse_args(argv)
    cfg = yaml.safe_load((Path(__file__).resolve().parent.parent / "conf/model/k3_full.yaml").read_text())
    D, moe = cfg["hidden_size"], cfg["moe"]
    E, K, L, m = moe["num_experts"], moe["top_k"], moe["latent_size"], moe["expert_intermediate_size"]
    S = 4096
    T = S * K
    mod = _ext.get()
    print(f"K3 dims: d={D} latent={L} E={E} K={K} expert width={m}; S={S} tokens/rank, T=S*K={T} rows/rank;"
          f" C++ planner: {'built' if mod is not None else 'absent (' + str(_ext.load_error) + ')'}")

    print("\n[1] planner time per layer (Zipf 1.0 counts)")
    for R in args.ranks:
        c = zipf_counts(R, E, T, 1.0, seed=R)
        t_torch = timed(lambda: plan_moonep(c, T, backend="torch"), args.reps)
        if mod is not None:
            t_cpp = timed(lambda: plan_moonep(c, T, backend="cpp"), args.reps)
            print(f"  R={R:4d}: torch {t_torch:8.3f} ms   C++ {t_cpp:7.3f} ms   torch/C++ = {t_torch / t_cpp:6.1f}x")
        else:
            print(f"  R={R:4d}: torch {t_torch:8.3f} ms   C++ n/a")

    print("\n[2] max/mean rows per rank: baseline (home placement) vs MoonEP; [4] replica weight vs token bytes")
    w_bytes = 3 * L * m * 2                      # SiTU-GLU gate+up [2m, L] + down [L, m], bf16
    tok_bytes = T * L * 2                        # one rank's dispatched latent rows per layer, bf16
    for R in args.ranks:
        for a in args.zipf:
            c = zipf_counts(R, E, T, a, seed=int(a * 100) + R)
            home = c.sum(0).view(R, -1).sum(1).double()
            p = plan_moonep(c, T)
            after = p.rows_SRJ.sum((0, 2)).double()
            nrep = int(p.num_replicas)
            print(f"  R={R:4d} zipf={a:3.1f}: baseline max/mean {float(home.max() / home.mean()):6.3f}  MoonEP "
                  f"{float(after.max() / after.mean()):6.3f}  feasible={bool(p.feasible)}  replicas={nrep:4d} "
                  f"(lower bound {replica_lower_bound(c, T):4d}; tolerance 0.02: "
                  f"{int(plan_moonep(c, T, tolerance=0.02).num_replicas):4d}) "
                  f"(max/rank {int((p.slot_expert_RJ[:, E // R:] >= 0).sum(1).max())})  replica weight bytes / "
                  f"token bytes (all ranks, per layer) = {nrep * w_bytes / (R * tok_bytes):.3f}")

    print("\n[3] bytes dispatched per token (K rows, bf16, one direction)")
    lat, full = K * L * 2, K * D * 2
    print(f"  latent {lat} B  full-width {full} B  latent/full = {lat / full:.3f}")
    print(f"\n  one expert's weights = {w_bytes / 2**20:.1f} MiB bf16; one rank's token rows per layer = "
          f"{tok_bytes / 2**20:.1f} MiB; 1 replica costs {w_bytes / tok_bytes:.3f} of a rank's dispatch")


if __name__ == "__main__":
    main()
