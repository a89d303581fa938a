"""Colocated vs separate rollout engines on the same ranks: wall time per RL iteration, learner-idle fraction and
peak memory per rank, all measured in one run.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tools/bench_rl_placement.py [--iterations 4] [--tp 1] [--repeats 1]

W = 2 gloo ranks, the parity-sized model, 4 prompts x 4 samples of 16 tokens (ignore_eos). Three runs of the real
loop (megak3/posttrain/rl.py, placement.py), each on the same 2 ranks:

- colocated, lag 0 (the default): the trainer on both ranks (``--tp 1``: dp2 with ZeRO-1 and two tp1 engine
  replicas; ``--tp 2``: tp2 and one tp2 replica), the engines' weights released during the update;
- separate, lag 0: the trainer on rank 0, one tp1 engine on rank 1; each waits while the other works;
- separate, lag 1: the same ranks, the engine generating batch k+1 while the trainer updates on batch k.

Per run: seconds per iteration (mean over the iterations after the first, which warms up; the slowest rank's
clock; with ``--repeats N`` the three runs are repeated N times in turn and the median is printed), the
learner-idle fraction (rank 0: 1 - update seconds / iteration seconds, over the same iterations:
the time its trainer spends generating, waiting for samples or in the refit), and the peak memory per rank,
counted as the bytes of the tensors a rank holds at its peak: the trainer's parameters, gradients (as many bytes
as the parameters, held during the update only) and optimizer state; the engine's weights and paged cache pool.
Ratios are printed against colocated. On a host with fewer free cores than ranks (the development host: 2 cores
shared by several users) the overlap of lag 1 shows in the idle fraction more than in the wall time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _job(ranks, tp=1):
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.job.config import JobConfig, TrainConfig
    from megak3.optim.config import OptimConfig
    from parallel.config import ParallelConfig
    from parallel.testing import PARITY_MODEL

    return JobConfig(model=load_model_config("k3_tiny", **PARITY_MODEL), data=DataConfig(vocab_size=512),
                     optim=OptimConfig(lr=3e-3, warmup_steps=0),
                     train=TrainConfig(max_steps=3, global_batch_size=ranks, micro_batch_size=1, seed=5),
                     parallel=ParallelConfig(tp=tp, backend="gloo", timeout_s=600))


def _memory(runner) -> int:
    """Peak tensor bytes of this rank (module docstring)."""
    eng_w = cache = 0
    if runner.engine is not None:
        eng = runner.engine
        eng_w = _bytes(list(eng.model.parameters()) + list(eng.model.buffers()))
        cache = _bytes([eng.runner.pool, getattr(eng.runner, "host", None)])
    if runner.model is None:
        return eng_w + cache
    params = _bytes(runner.model.parameters())
    opt = runner.rs.optimizer
    state = _bytes([v for o in opt.optimizers for st in o.state.values() for v in st.values() if torch.is_tensor(v)])
    generating = params + state + eng_w + cache
    released = eng_w if runner.rollout.release else 0  # colocated: the engine's weights are freed in the update
    return max(generating, 2 * params + state + eng_w + cache - released)


def _run(rank, world, tok_path, iterations, placement, lag, tp):
    from megak3.data.tokenizer import load_tokenizer
    from megak3.posttrain.engines import RolloutConfig
    from megak3.posttrain.placement import init_rl_parallel
    from megak3.posttrain.rl import RLConfig, RLRunner

    torch.set_num_threads(1)
    sep = placement == "separate"
    job = _job(1 if sep else world, 1 if sep else tp)
    engine = {"tp": 1, "replicas": 1} if sep else {"tp": tp, "replicas": world // tp}
    rl = RLConfig(iterations=iterations, prompts=4, group_size=4, max_tokens=16, micro_batch_size=4,
                  ignore_eos=True, rollout=RolloutConfig(placement=placement, lag=lag, **engine))
    ps = init_rl_parallel(job, rl)
    runner = RLRunner(job, rl, load_tokenizer(tok_path), ps=ps,
                      engine_options={"page_size": 8, "num_pages": 128, "prefill_chunk": 16})
    ends, t0 = [], time.perf_counter()
    while runner.version < iterations:
        runner.iteration()
        ends.append(time.perf_counter())
    times = [b - a for a, b in zip([t0] + ends, ends)][1:]  # after the first (warm-up) iteration
    train = sum(h.get("train_s", 0.0) for h in runner.history[1:])
    return {"wall": sum(times) / len(times), "idle": 1 - train / sum(times) if runner.model is not None else None,
            "memory": _memory(runner), "role": ("trainer" if runner.model is not None else "") +
            ("+engine" if runner.model is not None and runner.engine is not None else
             "engine" if runner.engine is not None else "")}


def _wall(ranks) -> float:
    return max(r["wall"] for r in ranks)  # the slowest rank's seconds per iteration


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=4, help="updates per run (the first is not timed)")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2), help="the colocated trainer: dp2 (1) or tp2 (2)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each placement, in turn (the median is printed)")
    args = ap.parse_args(argv)
    if args.iterations < 2 or args.repeats < 1:
        print("error: --iterations must be >= 2 (the first iteration is not timed) and --repeats >= 1", file=sys.stderr)
        return 2
    import tempfile

    from megak3.data.demo_sft import build_demo_sft_dataset
    from parallel.testing import run_distributed

    runs = [("colocated", 0), ("separate", 0), ("separate", 1)]
    every: dict = {run: [] for run in runs}
    with tempfile.TemporaryDirectory() as d:
        _, tok = build_demo_sft_dataset(d, vocab_size=512, num_conversations=200, progress=False)
        for _ in range(args.repeats):
            for placement, lag in runs:
                every[placement, lag].append(run_distributed(_run, 2, str(tok), args.iterations, placement, lag,
                                                             args.tp, timeout_s=1200, collective_timeout_s=1200))
    out = {}
    for run, reps in every.items():  # the repeat of median wall time (its idle fraction and memory with it)
        reps = sorted(reps, key=_wall)
        out[run] = reps[len(reps) // 2]
        if len(reps) > 1:
            print(f"{run[0]} lag {run[1]}: s/iteration over {len(reps)} repeats: "
                  f"{', '.join(f'{_wall(x):.3f}' for x in reps)}")
    mib = 2 ** 20
    base = out["colocated", 0]
    what = {"colocated": f"trainer {'dp2' if args.tp == 1 else 'tp2'} + "
                         f"{'two tp1 replicas' if args.tp == 1 else 'one tp2 replica'} on both ranks",
            "separate": "trainer on rank 0, one tp1 engine on rank 1"}
    for placement, lag in runs:
        ranks = out[placement, lag]
        wall = _wall(ranks)
        peak = max(r["memory"] for r in ranks)
        per_rank = ", ".join(f"rank {i} ({r['role']}) {r['memory'] / mib:.2f} MiB" for i, r in enumerate(ranks))
        print(f"{placement:9s} lag {lag} ({what[placement]}): {wall:.3f} s/iteration, learner idle "
              f"{ranks[0]['idle']:.2f}; peak memory {per_rank}")
        if (placement, lag) != ("colocated", 0):
            print(f"    {placement} lag {lag} / colocated: wall time {wall / _wall(base):.2f}x, "
                  f"peak memory per rank {peak / max(r['memory'] for r in base):.2f}x, learner idle "
                  f"{ranks[0]['idle']:.2f} vs {base[0]['idle']:.2f}")
    print(f"W = 2 gloo ranks on {os.cpu_count()} CPU cores (shared with whatever else runs): two ranks get a "
          "parallel speed-up only as far as free cores allow")
    return 0


if __name__ == "__main__":
    sys.exit(main())
