"""Long-context training of k3_tiny: peak memory per rank and step time at T = 4K, 16K, 64K for
cp = 1 and cp = 4, and the context-parallel bytes per layer against the all-to-all alternative.

    python tools/bench_long_context.py             # T = 4K, 16K, 64K; cp = 1, 4 (~20 min on 2 cores: each
                                                   # 64K step takes ~8 min; --T 4096 16384 for ~3 min)
    python tools/bench_long_context.py --quick     # T = 1K, 4K; cp = 1, 4 (~1 min)
    python tools/bench_long_context.py --T 4096 16384 --cp 1 2 4
    python tools/bench_long_context.py --T 65536 --cp 4 --cp-balance 4   # MLA under parallel.cp_balance
    python tools/bench_long_context.py --T 4096 16384 --cp 1 --recompute none full selective

Every (T, cp) runs in fresh processes (gloo ranks, one thread each): build the production RankStep
(megak3/train/step.py) of k3_tiny (text only, fp32, model.max_seq_len raised to T), one packed row of
T tokens whose documents cross the CP boundaries, then ONE real training step (forward, backward,
ZeRO-1 reduce, clip, Muon/AdamW, QB update), with train.recompute=full by default (--recompute
none full selective compares the policies of megak3/model/recompute.py; --no-recompute = --recompute
none). Reported per rank, max over ranks:

  peak      VmHWM after the step (megak3.metrics.telemetry.peak_rss_bytes), the high-water mark
            restarted just before the step (reset_peak_rss), so it is the step's peak with the
            model, optimizer state and the Python/torch runtime already resident;
  step      peak - RSS before the step: what the step itself needs (activations, gradients,
            optimizer state created on the first step). mem(4T)/mem(T) of this column is ~4 when
            memory is linear in T and ~16 when it is quadratic;
  held      (--recompute given) bytes malloc holds after a forward of the same batch, before its
            backward: the activations the policy keeps (glibc mallinfo2; one extra forward+backward
            before the step, which also warms the step up);
  time      wall time of the step (the slowest rank), and CPU time of the slowest rank (with cp ranks
            sharing this machine's cores the wall time over-states the critical path).

Communication, measured in the same cp > 1 runs with parallel.kda_cp.comm_log (bytes each rank
sends to other ranks in a bandwidth-optimal collective), after the step, by one forward + backward of
the rank's first KDA and first MLA attention on its segment of the same batch (no recompute, so
each collective counts once; under activation recompute the step re-issues the forward ones):
  KDA   the state-summary all-gather / reduce-scatter (cp * B * H * K * (K+V) fp32, independent of T)
        plus the conv halos (3 x (kernel-1) tokens x H*K, each way);
  MLA   the latent all-gather / reduce-scatter ((kv_lora_rank + rope) values per token).
The alternative (DeepSpeed-Ulysses sequence<->head all-to-all) is computed from its shapes:
  KDA   q, k, g (K each), v (V), beta (1) to heads and o (V) back, and their gradients
        (tools/bench_kda_cp.py measures it on gloo: measured = computed);
  MLA   q (nope+rope), k (nope+rope), v to heads and o back, and their gradients.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megak3.config import load_model_config  # noqa: E402
from megak3.metrics.telemetry import malloc_in_use_bytes, peak_rss_bytes, reset_peak_rss  # noqa: E402
from parallel.kda_cp import comm_log  # noqa: E402
from parallel.testing import run_distributed  # noqa: E402


def model_overrides(T: int) -> dict:
    return {"vision.enabled": False, "max_seq_len": max(T, 8192)}


def current_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def batch(T: int, vocab: int, cp: int):
    """One row of T tokens: documents of T/3 - 5, T/2 and the rest tokens (boundaries off the CP grid)."""
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(4, vocab, (1, T), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    cu = sorted({0, T // 3 - 5, T // 3 - 5 + T // 2, T})
    return {"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


def _layer_bytes(rs, b):
    """Bytes this rank sends (comm_log) in a forward + backward of the model's first KDA and first MLA
    attention on this rank's segment of batch ``b`` (no recompute): {kind: {collective: bytes}}."""
    model = rs.model
    ids, labels, seq = model.shard_inputs(b["input_ids"], b["labels"], b["cu_seqlens"])
    out = {}
    for kind in ("kda", "mla"):
        layer = next(l for l in model.layers if l.kind == kind)
        x = torch.randn(*ids.shape, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
        with comm_log() as log:
            layer.self_attn(x.requires_grad_(), seq).square().mean().backward()
        out[kind] = {}
        for k, _, sent in log.events:
            out[kind][k] = out[kind].get(k, 0) + sent
    model.zero_grad(set_to_none=True)
    return out


def _held_bytes(rs, b):
    """Bytes a forward of batch ``b`` leaves allocated for its backward (then runs the backward)."""
    import gc

    model = rs.model
    gc.collect()
    m0 = malloc_in_use_bytes()
    out = model(b["input_ids"], labels=b["labels"], cu_seqlens=b["cu_seqlens"])
    gc.collect()
    m1 = malloc_in_use_bytes()
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    del out
    gc.collect()
    try:  # hand the freed heap back so the step's peak / step memory below start from a clean RSS
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return None if m0 is None else m1 - m0


def _step_rank(rank, world, T, cp, recompute, measure_held=False, balance=0):
    from megak3.data.config import DataConfig
    from megak3.optim import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig
    from megak3.train.step import RankStep
    from parallel.config import ParallelConfig
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    job = JobConfig(model=load_model_config("k3_tiny", **model_overrides(T)), data=DataConfig(seq_len=T),
                    optim=OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant"),
                    train=TrainConfig(max_steps=1, global_batch_size=1, micro_batch_size=1, device="cpu",
                                      precision="fp32", recompute=recompute),
                    parallel=ParallelConfig(cp=cp, backend="gloo", timeout_s=1200, cp_balance=bool(balance),
                                            cp_balance_split=balance or 2))
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rs = RankStep(job, ps, "cpu", grad_accum=1)
    hook = getattr(rs.model, "context_parallel", None)
    if hook is not None:  # --cp-balance (set on the hook: parallelize() builds it from ps alone)
        hook.balance, hook.split = bool(balance), balance or 2
    b = batch(T, job.model.vocab_size, cp)
    held = _held_bytes(rs, b) if measure_held and world == 1 else None
    if world > 1:
        dist.barrier()
    rss0 = current_rss()
    reset_peak_rss()
    t0, c0 = time.perf_counter(), time.process_time()
    rec = rs.accumulate([b])
    out = rs.apply(0, 1)
    loss = float(rec["loss_sum"])
    c1 = time.process_time()
    if world > 1:
        dist.barrier()
    t1 = time.perf_counter()
    peak = peak_rss_bytes()
    sent = _layer_bytes(rs, b) if world > 1 else {}
    return {"peak": peak, "rss0": rss0, "wall": t1 - t0, "cpu": c1 - c0, "sent": sent, "loss_sum": loss,
            "grad_norm": float(out["grad_norm"]), "step_tokens": float(rec["step_tokens"]), "held": held}


def alt_bytes(cfg, T: int, cp: int):
    """(KDA, MLA) bytes one rank sends per layer in a sequence<->head all-to-all, fwd + bwd, fp32."""
    frac, local = (cp - 1) / cp, T // cp
    k, m = cfg.kda, cfg.mla
    kda = 2 * frac * local * k.num_heads * (3 * k.head_dim + 2 * k.head_dim + 1) * 4
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    mla = 2 * frac * local * m.num_heads * (2 * qk + 2 * m.v_head_dim) * 4
    return kda, mla


def fmt(n):
    for unit, d in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= d:
            return f"{n / d:7.2f} {unit}"
    return f"{n:7.0f} B  "


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 1K, 4K (about a minute)")
    ap.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths (default 4096 16384 65536)")
    ap.add_argument("--cp", type=int, nargs="*", default=None,
                    help="CP sizes (default 1 4; none when --recompute is given without --cp)")
    ap.add_argument("--cp-balance", type=int, default=0, metavar="SPLIT",
                    help="run the cp > 1 steps with parallel.cp_balance=true and this many query blocks per rank "
                         "(parallel.cp_balance_split; 0 = contiguous MLA, the default)")
    ap.add_argument("--no-recompute", action="store_true",
                    help="keep every activation (= --recompute none; default: train.recompute=full, which the 64K "
                         "step needs to fit in 24 GiB: without it k3_tiny keeps ~0.75 MiB per token)")
    ap.add_argument("--recompute", nargs="+", choices=("none", "full", "selective"), default=None,
                    help="train.recompute policies to compare at cp=1 (each (T, policy) a fresh process): "
                         "held activation bytes, peak and step time; the cp runs use the first policy")
    args = ap.parse_args(argv)
    modes = args.recompute or (["none"] if args.no_recompute else ["full"])
    if args.cp is None:
        args.cp = [] if args.recompute else [1, 4]
    recompute = modes[0]
    Ts = args.T or ([1024, 4096] if args.quick else [4096, 16384, 65536])
    torch.set_num_threads(1)
    cfg = load_model_config("k3_tiny", **model_overrides(max(Ts)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"k3_tiny (text), one packed row of T tokens, one training step, fp32, train.recompute={recompute}, "
          f"gloo ranks with 1 thread on {cores} cores; max over ranks")
    res = {}
    for T in Ts:
        for cp in args.cp:
            t = time.perf_counter()
            out = run_distributed(_step_rank, cp, T, cp, recompute, False, args.cp_balance, timeout_s=3000,
                                  collective_timeout_s=3600)
            res[T, cp] = out
            r = {k: max(o[k] for o in out) for k in ("peak", "rss0", "wall", "cpu")}
            loss = sum(o["loss_sum"] for o in out) / out[0]["step_tokens"]
            print(f"  T={T:6d} cp={cp}: peak {fmt(r['peak'])}  step {fmt(r['peak'] - r['rss0'])}  "
                  f"wall {r['wall']:7.1f} s  cpu {r['cpu']:7.1f} s  loss {loss:.5f}  "
                  f"grad norm {out[0]['grad_norm']:.5f}  ({time.perf_counter() - t:.0f} s with start-up)",
                  flush=True)
            if cp > 1:
                steps = [o["peak"] - o["rss0"] for o in out]
                print(f"      step memory per rank {' / '.join(fmt(x) for x in steps)}; last / first "
                      f"{steps[-1] / max(steps[0], 1):.2f}; peak last / first {out[-1]['peak'] / out[0]['peak']:.2f}"
                      f"{'  (cp_balance split ' + str(args.cp_balance) + ')' if args.cp_balance else ''}", flush=True)
    rec = {}
    if args.recompute:
        for T in Ts:
            for mode in modes:
                t = time.perf_counter()
                o = run_distributed(_step_rank, 1, T, 1, mode, True, timeout_s=3000, collective_timeout_s=3600)[0]
                rec[T, mode] = o
                print(f"  T={T:6d} recompute={mode:9s}: held {fmt(o['held'] or 0)}  peak {fmt(o['peak'])}  "
                      f"step {fmt(o['peak'] - o['rss0'])}  wall {o['wall']:7.1f} s  loss "
                      f"{o['loss_sum'] / o['step_tokens']:.7f}  grad norm {o['grad_norm']:.7f}  "
                      f"({time.perf_counter() - t:.0f} s with start-up)", flush=True)

    if res:
        print_cp_tables(args, Ts, res, cfg)
    if rec:
        print_recompute_table(Ts, modes, rec)


def print_cp_tables(args, Ts, res, cfg):
    print("\nPeak memory per rank (VmHWM) and step time")
    print(f"{'T':>7} {'cp':>3} {'peak':>11} {'step mem':>11} {'x vs T/4':>9} {'wall s':>8} {'cpu s':>8} "
          f"{'x vs T/4':>9}")
    for cp in args.cp:
        for T in Ts:
            o = res[T, cp]
            peak = max(x["peak"] for x in o)
            step = max(x["peak"] - x["rss0"] for x in o)
            wall = max(x["wall"] for x in o)
            cpu = max(x["cpu"] for x in o)
            prev = res.get((T // 4, cp))
            if prev:
                m_ratio = step / max(max(x["peak"] - x["rss0"] for x in prev), 1)
                t_ratio = cpu / max(max(x["cpu"] for x in prev), 1e-9)
                mr, tr = f"{m_ratio:9.2f}", f"{t_ratio:9.2f}"
            else:
                mr = tr = f"{'':>9}"
            print(f"{T:7d} {cp:3d} {fmt(peak):>11} {fmt(step):>11} {mr} {wall:8.1f} {cpu:8.1f} {tr}")
    for T in Ts:
        if (T, 1) in res:
            for cp in args.cp:
                if cp > 1:
                    one = max(x["peak"] - x["rss0"] for x in res[T, 1])
                    many = max(x["peak"] - x["rss0"] for x in res[T, cp])
                    print(f"  T={T}: step memory per rank cp={cp} / cp=1 = {many / one:.2f}")

    print("\nCP bytes sent per rank per layer (forward + backward), measured (comm_log), vs the sequence<->head "
          "all-to-all (computed)")
    print(f"{'T':>7} {'cp':>3} {'KDA scan':>11} {'KDA halo':>11} {'KDA a2a':>11} {'a2a/(scan+halo)':>16} "
          f"{'MLA latent':>11} {'MLA a2a':>11} {'a2a/latent':>11}")
    for T in Ts:
        for cp in args.cp:
            if cp == 1:
                continue
            mx = lambda kind, *names: max(sum(o["sent"][kind].get(n, 0) for n in names) for o in res[T, cp])
            scan = mx("kda", "all_gather", "reduce_scatter")
            halo = mx("kda", "all_to_all")
            lat = mx("mla", "mla_latent_all_gather", "mla_latent_reduce_scatter")
            a_kda, a_mla = alt_bytes(cfg, T, cp)
            print(f"{T:7d} {cp:3d} {fmt(scan):>11} {fmt(halo):>11} {fmt(a_kda):>11} {a_kda / (scan + halo):16.1f} "
                  f"{fmt(lat):>11} {fmt(a_mla):>11} {a_mla / lat:11.2f}")
    k3 = load_model_config("k3_full").mla
    per_head = 2 * (k3.qk_nope_head_dim + k3.qk_rope_head_dim) + 2 * k3.v_head_dim
    print("  KDA: the scan's bytes do not grow with T (the a2a's do); MLA: the latent gather sends every earlier "
          "token's latent to every later rank ((cp-1) x local tokens x (kv_lora_rank+rope) fp32 each way), "
          "the a2a (cp-1)/cp x local tokens x H x (2 (nope+rope) + 2 v) - at K3 size "
          f"{k3.kv_lora_rank + k3.qk_rope_head_dim} vs {k3.num_heads} x {per_head} values per token per rank pair")




def print_recompute_table(Ts, modes, rec):
    if rec:
        print("\nActivation recomputation (train.recompute), cp=1: bytes held after the forward for the backward "
              "(malloc), step peak (VmHWM) and step memory, step wall time")
        print(f"{'T':>7} {'recompute':>10} {'held':>11} {'x none':>7} {'peak':>11} {'step mem':>11} {'wall s':>8} "
              f"{'x none':>7}")
        for T in Ts:
            base = rec.get((T, "none"))
            for mode in modes:
                o = rec[T, mode]
                held = o["held"] or 0
                hr = f"{held / max(base['held'] or 1, 1):7.2f}" if base else f"{'':>7}"
                tr = f"{o['wall'] / max(base['wall'], 1e-9):7.2f}" if base else f"{'':>7}"
                print(f"{T:7d} {mode:>10} {fmt(held):>11} {hr} {fmt(o['peak']):>11} "
                      f"{fmt(o['peak'] - o['rss0']):>11} {o['wall']:8.1f} {tr}")


if __name__ == "__main__":
    main()
