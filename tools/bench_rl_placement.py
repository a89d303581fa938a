"""Colocated vs separate rollout engines on the same ranks: memory per rank and wall time per RL iteration.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python tools/bench_rl_placement.py [--iterations 3] [--tp 2]

Synchronous RL on W = 2 gloo ranks at a small size (the parity-sized model, 4 prompts x 4 samples).
Colocated (the default, megak3/posttrain/engines.py): the trainer runs on both ranks (``--tp 2``: tp2, the
model sharded as a large model must be; ``--tp 1``: dp2, ZeRO-1) with the engine at the same tp (one tp2
replica, or two tp1 replicas), its weights released during the update. Separate: the trainer on one rank and
the engine on the other; in a synchronous loop each waits for the other, so an iteration costs the one-rank
generation plus the one-rank update (both measured here, in the same run, with the one-process runner: that
is exactly what each side of the separate placement runs). Memory per rank: the trainer's parameters,
gradients and optimizer state, and the engine's weights and cache pool (bytes of the tensors held), at the
update's peak and during generation.
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


def _job(world, tp=1):
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.job.config import JobConfig, TrainConfig
    from megak3.optim.config import OptimConfig
    from parallel.config import ParallelConfig
    from parallel.testing import PARITY_MODEL

    return JobConfig(model=load_model_config("k3_tiny", **PARITY_MODEL), data=DataConfig(vocab_size=512),
                     optim=OptimConfig(lr=3e-3, warmup_steps=0),
                     train=TrainConfig(max_steps=3, global_batch_size=world, micro_batch_size=1, seed=5),
                     parallel=ParallelConfig(tp=tp, backend="gloo", timeout_s=300)).validate(world)


def _run(rank, world, tok_path, iterations, tp=1):
    from megak3.data.tokenizer import load_tokenizer
    from megak3.posttrain.rl import RLConfig, RLRunner
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    job = _job(world, tp)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rl = RLConfig(iterations=iterations, prompts=4, group_size=4, max_tokens=16, micro_batch_size=4, ignore_eos=True)
    runner = RLRunner(job, rl, load_tokenizer(tok_path), ps=ps,
                      engine_options={"page_size": 8, "num_pages": 128, "prefill_chunk": 16})
    model, opt = runner.model, runner.rs.optimizer
    eng = runner.engine
    eng_w = _bytes(list(eng.model.parameters()) + list(eng.model.buffers()))
    cache = _bytes([eng.runner.pool, getattr(eng.runner, "host", None)])  # the paged MLA pool
    t0 = time.perf_counter()
    hist = runner.fit(log=None)
    wall = time.perf_counter() - t0
    params = _bytes(model.parameters())
    # optimizer state after the first step (ZeRO-1: this rank's shard of it)
    state = [v for o in opt.optimizers for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
    gen = sum(h["gen_s"] for h in hist) / len(hist)
    train = sum(h["train_s"] + h["refit_s"] for h in hist) / len(hist)
    # the trainer holds parameters + optimizer state throughout, gradients (as many bytes as the
    # parameters) only during the update: they are freed (set_to_none) after each step
    return {"weights": eng_w, "resident": params + _bytes(state), "update": 2 * params + _bytes(state), "engine": eng_w + cache,
            "gen_s": gen, "train_s": train, "wall_s": wall / len(hist)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--tp", type=int, default=2, choices=(1, 2), help="the 2-rank trainer: tp2 or dp2")
    args = ap.parse_args(argv)
    import tempfile

    from megak3.data.demo_sft import build_demo_sft_dataset
    from parallel.testing import run_distributed

    with tempfile.TemporaryDirectory() as d:
        _, tok = build_demo_sft_dataset(d, vocab_size=512, num_conversations=200, progress=False)
        one = _run(0, 1, str(tok), args.iterations)
        two = run_distributed(_run, 2, str(tok), args.iterations, args.tp, timeout_s=900)
    co = max(two, key=lambda r: r["wall_s"])
    what = "trainer tp2 + one tp2 engine" if args.tp == 2 else "trainer dp2 + two tp1 engine replicas"
    sep_wall = one["gen_s"] + one["train_s"]  # each side's work on one rank, in turn (synchronous RL)
    co_gen = co["resident"] + co["engine"]  # generating: trainer state + engine weights and cache
    co_upd = co["update"]  # updating: the engine's weights are released (its cache pool stays)
    co_peak = max(co_gen, co_upd + co["engine"] - co["weights"])
    sep_peak = max(one["update"], one["engine"])
    mib = 2 ** 20
    print(f"separate  (trainer 1 rank, engine 1 rank): {sep_wall:.3f} s/iteration "
          f"(generation {one['gen_s']:.3f} s + update and refit {one['train_s']:.3f} s, in turn); peak memory: "
          f"trainer rank {one['update'] / mib:.2f} MiB, engine rank {one['engine'] / mib:.2f} MiB")
    print(f"colocated ({what} on 2 ranks): {co['wall_s']:.3f} s/iteration (generation {co['gen_s']:.3f} s + "
          f"update and refit {co['train_s']:.3f} s); memory per rank {co_gen / mib:.2f} MiB while generating, "
          f"{(co_upd + co['engine'] - co['weights']) / mib:.2f} MiB during the update")
    print(f"colocated / separate: wall time {co['wall_s'] / sep_wall:.2f}x, peak memory per rank "
          f"{co_peak / sep_peak:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
