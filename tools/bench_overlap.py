"""Replica-weight fetch hidden behind the shared experts (issue 19), measured on gloo in one run.

    PYTHONPATH=. python tools/bench_overlap.py [--ranks 2] [--experts 4] [--reps 5] [--only 3,4,5]

[1] the collective alone: t_fetch = blocking all_to_all_single of the replica weights (k3_mini
    expert size, fp32), t_shared = the shared-expert MLP alone, t_seq = fetch then MLP, t_ovl = the
    fetch issued with async_op, MLP, wait (what MoonEPDispatcher does). Hidden fraction =
    (t_seq - t_ovl) / t_fetch (1 = the fetch is free, 0 = no overlap).
[2] a skewed LatentMoE layer (k3_mini widths) under MoonEP: forward+backward step time with
    ``overlap_shared`` on vs off, same run, same outputs (the ratio is printed).
[3] ZeRO-1 gradient reduce-scatter behind the backward (``parallel.overlap_grad_reduce``): the
    trainer's step (RankStep: accumulate + apply) of k3_tiny (vision off) on dp=ranks, 2
    micro-batches, 4 MiB buckets; step time on / off, both forms stepped alternately in one run;
    their losses must be bitwise equal.
[4] pipeline p2p posted with ``dist.batch_isend_irecv`` (``parallel.pp_batch_p2p``): the same
    step on pp=ranks (1f1b, 2·pp micro-batches); step time on / off, losses bitwise equal.
[5] ZeRO-1 parameter all-gather issued by the optimizer step and waited for in the next forward
    (``parallel.overlap_param_gather``): the step of [3] on dp=ranks, 4 MiB buckets; the forms
    alternate in rounds of 3 consecutive steps, steps 2-3 of each round timed (each waits for the
    gathers its predecessor left in flight, as in training); losses and final params bitwise equal.
    Also printed: the median all-gather time per step spent blocking in ``step()`` (off) and
    waiting in the forward's pre-hooks (on): their difference is the gather time hidden.
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


def _step_bench(rank, world, flag_name, pp, reps, seqlen, block=1):
    """Median step time of RankStep with ``parallel.<flag_name>`` off and on, the per-step losses of
    both (summed over dp) and section extras. The forms alternate in rounds of ``block``
    consecutive steps each (round 0: warm-up, not timed). With ``block`` > 1 only steps 2..block of
    a round are timed, back to back: a step then waits for the gathers its predecessor of the
    same form left in flight, as in training, and the gathers left by a round's last step are
    waited for untimed (the other form's round must not hide them)."""
    torch.set_num_threads(1)
    from megak3.train.step import RankStep, all_reduce_sum
    from parallel.data_parallel import build_sharded_optimizer
    from parallel.testing import global_batch, local_rows
    from megak3.train.parity import parity_job
    from parallel.state import init_parallel

    dp = world // pp
    micro = 2 * pp
    rows = micro * dp * 2  # 2 rows per micro-batch and rank
    total = (reps + 1) * block
    job = parity_job(1, dp, False, {"vision.enabled": False}, batch=rows, seqlen=seqlen, seed=5, lr=1e-3,
                     steps=total, pp=pp)
    ps = init_parallel(job.parallel, model_cfg=job.model)
    zero = flag_name in ("overlap_grad_reduce", "overlap_param_gather")
    steps = {}
    for flag in (False, True):
        setattr(job.parallel, flag_name, flag and not zero)
        rs = RankStep(job, ps, "cpu", grad_accum=micro)
        if zero:  # several buckets (the 40 MiB default holds all of k3_tiny)
            rs.optimizer = build_sharded_optimizer(rs.model, job.optim, rs.plan, bucket_bytes=4 * 2**20,
                                                   **{flag_name: flag})
        steps[flag] = rs
    # where the all-gather time goes: blocking in step() (off) / waited for in the forward (on)
    comm = {False: [0.0], True: [0.0]}
    if flag_name == "overlap_param_gather":
        def timed(fn, acc, only=None):
            def run(*a):
                t = time.perf_counter()
                fn(*a)
                if only is None or a[-1] == only:
                    acc[0] += time.perf_counter() - t
            return run
        off, on = steps[False].optimizer, steps[True].optimizer
        off._all_gather = timed(off._all_gather, comm[False])
        on._wait_gathers = timed(on._wait_gathers, comm[True], "forward")
    times = {False: [], True: []}
    comm_t = {False: [], True: []}
    losses = {False: [], True: []}
    forward_waits = 0
    for rnd in range(reps + 1):
        for flag in ((False, True) if rnd % 2 else (True, False)):
            rs, recs = steps[flag], []
            dist.barrier()
            for j in range(block):
                step = rnd * block + j
                ids, labels, _ = global_batch(step, rows, seqlen, job.model.vocab_size)
                ids, labels, _ = local_rows(ids, labels, ps.dp_rank, dp)
                mbs = [{"input_ids": a, "labels": b} for a, b in zip(ids.chunk(micro), labels.chunk(micro))]
                comm[flag][0] = 0.0
                t = time.perf_counter()
                rec = rs.accumulate(mbs)
                waits = sum(e == "forward" for e, _ in rs.optimizer.gather_log)  # a few us, inside the timing
                rs.apply(step, total)
                dt = time.perf_counter() - t
                recs.append(rec)
                if rnd and (block == 1 or j > 0):
                    times[flag].append(dt)
                    comm_t[flag].append(comm[flag][0])
                    forward_waits = waits if flag else forward_waits
            rs.optimizer.finish_param_gather()
            losses[flag] += [float(all_reduce_sum(r["loss_sum"].clone(), [ps.dp_cp_group])) for r in recs]
    med = {f: (sorted(v)[len(v) // 2], min(v), max(v)) for f, v in times.items()}
    on = steps[True].optimizer
    state = {f: steps[f].model.state_dict() for f in (False, True)}  # the hook finishes any gather
    extra = {"params_equal": all(torch.equal(state[False][k], state[True][k]) for k in state[False]),
             "launch_log": list(on.overlap_log),
             "buckets": len(getattr(on, "_gather_order", [])),
             "comm_ms": {f: 1e3 * sorted(v)[len(v) // 2] for f, v in comm_t.items()}}
    extra["forward_waits"] = forward_waits  # of the last timed step with the switch on
    return med, losses, extra


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4, help="replica experts sent to each peer")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="1,2,3,4,5", help="comma-separated sections to run")
    ap.add_argument("--seqlen", type=int, default=256, help="tokens per row in [3], [4] and [5]")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from parallel.testing import run_distributed

    only = {int(x) for x in args.only.split(",")}
    if only & {1, 2}:
        _sections_1_2(args, run_distributed)
    for sec, flag, pp, block, what in (
            (3, "overlap_grad_reduce", 1, 1, f"dp{args.ranks} ZeRO-1 reduce-scatter in backward"),
            (4, "pp_batch_p2p", args.ranks, 1, f"pp{args.ranks} batch_isend_irecv p2p"),
            (5, "overlap_param_gather", 1, 3, f"dp{args.ranks} ZeRO-1 all-gather behind the next forward")):
        if sec not in only:
            continue
        res = run_distributed(_step_bench, args.ranks, flag, pp, args.reps, args.seqlen, block, timeout_s=900)
        med, losses, extra = res[0]
        same = all(r[1][True] == r[1][False] for r in res)
        on, off = med[True], med[False]
        if sec == 3:
            tail = f", {len(extra['launch_log'])} buckets issued during backward"
        elif sec == 5:
            c = extra["comm_ms"]
            same = same and all(r[2]["params_equal"] for r in res)
            tail = (f" (params too); {extra['forward_waits']} of {extra['buckets']} bucket gathers waited for in "
                    f"the forward; all-gather time per step: blocking {c[False]:.1f} ms (off), waited for in "
                    f"the forward {c[True]:.1f} ms (on)")
        else:
            tail = ""
        n = args.reps * max(1, block - 1)
        print(f"[{sec}] {what} (parallel.{flag}), k3_tiny step, gloo x{args.ranks}, median of {n}: on "
              f"{on[0] * 1e3:.1f} ms / off {off[0] * 1e3:.1f} ms = {on[0] / off[0]:.3f} (min {on[1] / off[1]:.3f}; "
              f"spread on {on[1] * 1e3:.0f}-{on[2] * 1e3:.0f}, off {off[1] * 1e3:.0f}-{off[2] * 1e3:.0f} ms); "
              f"losses identical: {same}{tail}")


def _sections_1_2(args, run_distributed):
    t, lt, same, nrep = run_distributed(_bench, args.ranks, args.experts, args.reps, timeout_s=600)[0]
    hidden = (t["seq"] - t["ovl"]) / t["fetch"]
    print(f"[1] gloo x{args.ranks}, {args.experts} k3_mini experts per peer (fp32): fetch {t['fetch'] * 1e3:.1f} ms, "
          f"shared MLP {t['shared'] * 1e3:.1f} ms, sequential {t['seq'] * 1e3:.1f} ms, overlapped "
          f"{t['ovl'] * 1e3:.1f} ms -> hidden fraction of the fetch {hidden:.2f}")
    print(f"[2] MoonEP layer fwd+bwd ({nrep} replicas): overlap on {lt[True] * 1e3:.1f} ms / off "
          f"{lt[False] * 1e3:.1f} ms = {lt[True] / lt[False]:.3f}; outputs identical: {same}")


if __name__ == "__main__":
    main()
