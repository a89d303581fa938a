"""Bytes and time of KDA under context parallelism: the state-summary scan (parallel/kda_cp.py)
against a sequence<->head all-to-all (Ulysses-style), per KDA layer and per rank.

    python tools/bench_kda_cp.py                    # tables + measured bytes + cp=4 vs cp=1 timing
    python tools/bench_kda_cp.py --no-timing

Computed bytes (what one rank sends to other ranks in a bandwidth-optimal implementation, per KDA
layer, forward + backward; fp32 = 4 bytes per value):
  * scan: forward all-gather of the [H, K, K+V] summary ((cp-1) x summary), backward reduce-scatter
    of the gathered gradient ((cp-1)/cp x cp x summary): 2 (cp-1) H K (K+V) 4, independent of T.
  * halo of the short convs (needed by both schemes, listed apart): q, k, v pre-conv tails, kernel-1
    tokens each, forward and backward: 2 x 3 (W-1) H K 4.
  * all-to-all: forward q, k, g (K each), v (V), beta (1) to head-sharded layout and o (V) back,
    backward the same gradients the other way; (cp-1)/cp of the local T/cp tokens leave the rank:
    2 (cp-1)/cp (T/cp) H (3K + 2V + 1) 4. The bf16 column counts q, k, v, o and their gradients at
    2 bytes and g, beta at 4.
Measured: for k3_tiny (H=4, K=V=64) at small T on gloo, the bytes handed to the collectives in a
real forward + backward (parallel.kda_cp.comm_log), for kda_cp (+ the halo exchange) and for an
all-to-all implementation written here; both outputs are checked against each other.
Timing: cp=4 vs cp=1 forward + backward at T=16K on k3_tiny dims, gloo ranks with one thread each,
median over --repeats iterations of the slowest rank (after a barrier); the ranks share this
machine's cores, which bounds the attainable wall-time ratio, so each rank's CPU time (process_time)
is reported too: the slowest rank's is the critical path with one core per rank, the sum the work.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megak3.config import load_model_config  # noqa: E402
from megak3.ops.kda import chunk_kda  # noqa: E402
from parallel.kda_cp import comm_log, exchange_conv_halo, kda_cp, record_comm  # noqa: E402
from parallel.testing import run_distributed  # noqa: E402


def dims(name):
    k = load_model_config(name).kda
    return k.num_heads, k.head_dim, k.head_dim, k.conv_kernel


def computed(H, K, V, W, T, cp):
    """(scan, halo, a2a fp32, a2a bf16) bytes sent per rank per KDA layer, forward + backward."""
    scan = 2 * (cp - 1) * H * K * (K + V) * 4
    halo = 2 * 3 * (W - 1) * H * K * 4
    frac, local = (cp - 1) / cp, T // cp
    a2a = 2 * frac * local * H * (3 * K + 2 * V + 1) * 4
    a2a_bf16 = 2 * frac * local * H * (2 * (2 * K + V) + 2 * V + 4 * (K + 1))
    return scan, halo, a2a, a2a_bf16


def fmt(n):
    for unit, d in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= d:
            return f"{n / d:8.2f} {unit}"
    return f"{n:8.0f} B  "


def print_tables():
    print("Bytes sent per rank per KDA layer (forward + backward):")
    print(f"{'model':8} {'H':>3} {'K':>4} {'V':>4} {'T':>8} {'cp':>3} {'scan':>12} {'halo':>12} "
          f"{'a2a fp32':>12} {'a2a bf16':>12} {'a2a/scan':>10}  note")
    for name in ("k3_tiny", "k3_full"):
        H, K, V, W = dims(name)
        for T in (4096, 65536, 1 << 20):
            for cp in (4, 8):
                scan, halo, a2a, a2ab = computed(H, K, V, W, T, cp)
                note = "" if H % cp == 0 else f"a2a needs H % cp == 0 (H={H})"
                print(f"{name:8} {H:3d} {K:4d} {V:4d} {T:8d} {cp:3d} {fmt(scan):>12} {fmt(halo):>12} "
                      f"{fmt(a2a):>12} {fmt(a2ab):>12} {a2a / scan:10.1f}  {note}")


# ------------------------------------------------------------------------- all-to-all reference
class _SeqToHead(torch.autograd.Function):
    """[B, T/cp, H, D] (sequence-sharded) <-> [B, T, H/cp, D] (head-sharded) by one all_to_all_single."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return _a2a(x, group, to_heads)

    @staticmethod
    def backward(ctx, g):
        return _a2a(g.contiguous(), ctx.group, not ctx.to_heads), None, None


def _a2a(x, group, to_heads):
    cp = dist.get_world_size(group)
    if to_heads:
        B, Tl, Hh, D = x.shape
        send = x.reshape(B, Tl, cp, Hh // cp, D).permute(2, 0, 1, 3, 4).contiguous()   # [dst, B, Tl, H/cp, D]
    else:
        B, T, Hl, D = x.shape
        send = x.reshape(B, cp, T // cp, Hl, D).permute(1, 0, 2, 3, 4).contiguous()    # [dst, B, T/cp, H/cp, D]
    recv = torch.empty_like(send)
    nbytes = send.numel() * send.element_size()
    record_comm("all_to_all", nbytes, nbytes * (cp - 1) // cp)
    dist.all_to_all_single(recv, send, group=group)
    if to_heads:   # recv [src, B, Tl, H/cp, D]: src is the sequence chunk
        return recv.permute(1, 0, 2, 3, 4).reshape(B, cp * Tl, Hh // cp, D)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, T // cp, cp * Hl, D)  # src is the head chunk


def kda_a2a(q, k, v, g, beta, group):
    """KDA of a sequence-sharded segment through head-sharded full sequences (one document per row)."""
    to = lambda x: _SeqToHead.apply(x, group, True)
    o, _ = chunk_kda(to(q), to(k), to(v), to(g), to(beta.unsqueeze(-1)).squeeze(-1))
    return _SeqToHead.apply(o, group, False)


def make_inputs(T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -0.1 * torch.rand(1, T, H, K, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def _measure_rank(rank, cp, T, H, K, V, W):
    group = dist.group.WORLD
    Tl = T // cp
    xs = [x[:, rank * Tl:(rank + 1) * Tl].clone().requires_grad_() for x in make_inputs(T, H, K, V)]
    out = {}
    with comm_log() as log:
        o, _ = kda_cp(*xs, group)
        o.square().sum().backward()
    out["scan"], o_scan = log.sent(), o.detach()
    pre = torch.randn(1, Tl, 3 * H * K, requires_grad=True)   # q, k, v pre-conv activations
    with comm_log() as log:
        halo = exchange_conv_halo(pre, W, group)
        halo.sum().backward()
    out["halo"] = log.sent()
    for x in xs:
        x.grad = None
    with comm_log() as log:
        o = kda_a2a(*xs, group)
        o.square().sum().backward()
    out["a2a"] = log.sent()
    out["max_rel_diff"] = ((o.detach() - o_scan).norm() / o_scan.norm()).item()
    return out


def print_measured(T_list, cp):
    H, K, V, W = dims("k3_tiny")
    print(f"\nMeasured on gloo, k3_tiny (H={H}, K={K}, V={V}), cp={cp}, forward + backward, "
          f"bytes sent per rank (max over ranks) vs computed:")
    print(f"{'T':>6} {'scan meas':>12} {'scan calc':>12} {'halo meas':>12} {'halo calc':>12} "
          f"{'a2a meas':>12} {'a2a calc':>12} {'a2a/scan':>9} {'|o_a2a-o_scan|/|o|':>19}")
    for T in T_list:
        res = run_distributed(_measure_rank, cp, T, H, K, V, W, timeout_s=600)
        scan, halo, a2a, _ = computed(H, K, V, W, T, cp)
        m = {key: max(r[key] for r in res) for key in ("scan", "halo", "a2a", "max_rel_diff")}
        print(f"{T:6d} {fmt(m['scan']):>12} {fmt(scan):>12} {fmt(m['halo']):>12} {fmt(halo):>12} "
              f"{fmt(m['a2a']):>12} {fmt(a2a):>12} {m['a2a'] / m['scan']:9.1f} {m['max_rel_diff']:19.2e}")


def _time_rank(rank, cp, T, H, K, V, repeats):
    group = dist.group.WORLD
    Tl = T // cp
    xs = [x[:, rank * Tl:(rank + 1) * Tl].clone().requires_grad_() for x in make_inputs(T, H, K, V)]
    times = []
    for i in range(repeats + 1):
        for x in xs:
            x.grad = None
        dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()
        o, _ = kda_cp(*xs, group)
        o.square().sum().backward()
        c1 = time.process_time()
        dist.barrier(group)  # the iteration ends when the slowest rank is done
        if i:
            times.append((time.perf_counter() - t0, c1 - c0))
    return times


def print_timing(T, repeats):
    H, K, V, _ = dims("k3_tiny")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"\nForward + backward time, k3_tiny dims (H={H}, K={K}, V={V}), T={T}, gloo, 1 thread per rank, "
          f"{cores} cores available:")
    med, crit, work = {}, {}, {}
    for cp in (1, 4):
        res = run_distributed(_time_rank, cp, T, H, K, V, repeats, timeout_s=900)
        wall = [max(r[i][0] for r in res) for i in range(repeats)]
        med[cp] = statistics.median(wall)
        crit[cp] = statistics.median(max(r[i][1] for r in res) for i in range(repeats))
        work[cp] = statistics.median(sum(r[i][1] for r in res) for i in range(repeats))
        print(f"  cp={cp}: wall median {med[cp] * 1e3:8.1f} ms (min {min(wall) * 1e3:8.1f})   CPU time: "
              f"slowest rank {crit[cp] * 1e3:8.1f} ms, all ranks {work[cp] * 1e3:8.1f} ms   "
              f"({T // cp} tokens per rank)")
    print(f"  cp=1 / cp=4 wall-time ratio: {med[1] / med[4]:.2f}x (4 ranks on {cores} shared cores)")
    print(f"  cp=1 / cp=4 slowest-rank CPU-time ratio: {crit[1] / crit[4]:.2f}x "
          f"(the speed-up with one core per rank)")
    print(f"  cp=4 / cp=1 total CPU work: {work[4] / work[1]:.2f}x (ranks > 0 also carry the K identity "
          f"columns)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measure-T", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--time-T", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print_tables()
    print_measured(args.measure_T, 4)
    if not args.no_timing:
        print_timing(args.time_T, args.repeats)


if __name__ == "__main__":
    main()
