"""Benchmark chunked vs token-by-token KDA on CPU (megak3/ops/kda/), ratios measured in one run.

    python tools/bench_kda.py                      # T=1024,4096, forward; fwd+bwd at T=1024
    python tools/bench_kda.py --T 4096 --chunk-size 64 32 --threads 1

Time: median (and min) of --repeats calls after one warm-up call, the two implementations
interleaved so both see the same machine load. Memory: peak resident-set growth (VmHWM - VmRSS
before the call) of ONE call, each measured in a fresh subprocess (after a short warm-up call that
absorbs library set-up) so allocator caches of earlier calls cannot hide it; this counts every
temporary the call touches (inputs excluded) as the OS sees it, including glibc heap fragmentation.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megak3.ops.kda import chunk_kda, kda_gate, recurrent_kda  # noqa: E402


def make_inputs(T, H, D, requires_grad=False, seed=0):
    """B=1 fp32 inputs: L2-normalised q, k; g from the K3 lower-bound gate; beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1)
    v = torch.randn(1, T, H, D, generator=gen)
    g = kda_gate(torch.randn(1, T, H * D, generator=gen), torch.empty(H).uniform_(1, 16, generator=gen).log(),
                 torch.zeros(H * D))
    beta = torch.rand(1, T, H, generator=gen)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]


def make_call(impl, T, H, D, chunk_size, backward):
    inputs = make_inputs(T, H, D, requires_grad=backward)
    fn = recurrent_kda if impl == "recurrent" else lambda *a: chunk_kda(*a, chunk_size=chunk_size)

    def call():
        o, _ = fn(*inputs)
        if backward:
            o.square().sum().backward()
    return call


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _measure_memory_child(spec):
    """Runs in a fresh process: peak RSS growth (MiB) of one call."""
    torch.set_num_threads(spec["threads"])
    call = make_call(spec["impl"], spec["T"], spec["H"], spec["D"], spec["chunk_size"], spec["backward"])
    # a short call first, so one-off library set-up (MKL/OpenMP buffers, autograd engine) is not counted
    make_call(spec["impl"], 2 * spec["chunk_size"], spec["H"], spec["D"], spec["chunk_size"], spec["backward"])()
    try:  # reset the high-water mark to the current RSS (Linux >= 4.0) so setup peaks do not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    before = _status_kb("VmRSS:")
    call()
    print(json.dumps({"peak_mib": (_status_kb("VmHWM:") - before) / 1024}))


def measure_memory(spec):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--_memory-child", json.dumps(spec)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def time_pair(calls, repeats):
    """(median, min) seconds per call for each entry of `calls`, interleaved, after one warm-up each."""
    for call in calls.values():
        call()
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(s), min(s)) for name, s in samples.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096], help="sequence lengths (forward)")
    p.add_argument("--backward-T", type=int, nargs="*", default=[1024],
                   help="sequence lengths for the forward+backward rows (none to skip)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per implementation (median)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--chunk-size", type=int, nargs="+", default=[64], help="chunk sizes for chunk_kda")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64, help="K = V head dim")
    p.add_argument("--no-memory", action="store_true", help="skip the subprocess memory measurement")
    p.add_argument("--_memory-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._memory_child:
        return _measure_memory_child(json.loads(args._memory_child))
    torch.set_num_threads(args.threads)
    rows = [(T, C, False) for T in args.T for C in args.chunk_size]
    rows += [(T, C, True) for T in args.backward_T for C in args.chunk_size]
    print(f"KDA CPU benchmark: B=1 H={args.heads} K=V={args.dim} fp32, g from kda_gate(lower_bound=-5), "
          f"threads={args.threads}, median of {args.repeats}")
    print(f"{'mode':>8} {'T':>6} {'C':>4} | {'recurrent ms':>12} {'chunked ms':>10} {'speedup':>8} "
          f"{'(min ms: rec / chunk = ratio)':>30} | {'rec MiB':>8} {'chunk MiB':>9} {'mem ratio':>9}")
    for T, C, backward in rows:
        calls = {impl: make_call(impl, T, args.heads, args.dim, C, backward) for impl in ("recurrent", "chunk")}
        t = time_pair(calls, args.repeats)
        mem = "           (skipped)"
        if not args.no_memory:
            spec = dict(T=T, H=args.heads, D=args.dim, chunk_size=C, backward=backward, threads=args.threads)
            m_r, m_c = (measure_memory(dict(spec, impl=impl)) for impl in ("recurrent", "chunk"))
            mem = f"{m_r:8.1f} {m_c:9.1f} {m_c / max(m_r, 1e-9):8.2f}x"
        mode = "fwd+bwd" if backward else "fwd"
        (rec, rec_min), (chunk, chunk_min) = t["recurrent"], t["chunk"]
        print(f"{mode:>8} {T:6d} {C:4d} | {rec * 1e3:12.1f} {chunk * 1e3:10.1f} {rec / chunk:7.1f}x "
              f"{rec_min * 1e3:12.1f} / {chunk_min * 1e3:6.1f} = {rec_min / chunk_min:5.1f}x | {mem}")
    print("speedup = median recurrent time / median chunked time (the min-time ratio beside it is less "
          "sensitive to a shared machine); mem ratio = chunked / recurrent peak RSS growth")


if __name__ == "__main__":
    main()
