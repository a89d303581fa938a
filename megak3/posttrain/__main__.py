"""RL from a fine-tuned checkpoint on a verifiable demo task, with an optional shuffled-reward control.

    python -m megak3.posttrain --init-from runs/sft rl.iterations=30 rl.prompts=8 rl.group_size=8 optim.lr=3e-3
    python -m megak3.posttrain --init-from runs/sft --control ...   # + the same run with rewards shuffled
    python -m megak3.posttrain --init-from runs/sft rl.env=ledger rl.partial_fraction=0.5 ...   # agentic RL

``--init-from``: a megak3 run / checkpoint directory (any layout) or a Hugging Face directory; the model
config, quantisation and tokenizer come from it. ``rl.FIELD=VALUE`` / ``rl.loss.FIELD=VALUE`` set
:class:`megak3.posttrain.rl.RLConfig` fields, ``optim.FIELD=VALUE`` the optimizer (Muon by default).
``train.run_dir=RUN`` keeps the run (megak3/posttrain/checkpoint.py): a megak3 checkpoint every
``train.save_interval`` policy versions and at the last (``train.keep_last`` kept), which ``python -m
megak3.generate --checkpoint RUN``, ``--init-from RUN`` and ``rl.mopd_teachers`` read; ``train.resume=auto``
continues from the newest one (a run directory of the older ``rl_rank*.pt`` format is refused, exit 2).
Before and after the run the greedy exact-answer accuracy on ``--eval-prompts`` held-out prompts of the
task is measured; the line ``reward: a -> b`` compares the mean training reward of the first and the last
``--window`` iterations. With ``rl.env=FAMILY`` (megak3/posttrain/agentic.py) every sample is a multi-turn
episode of that megak3.envs task family; instead of the accuracy the run prints how many episodes were paused
at an iteration boundary and resumed with their sandboxes unchanged, and how many trained trajectories hold
tokens of two or more policy versions. Bad input: one line on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import torch


def _set(obj, dotted: str, raw: str, prefix: str) -> None:
    *path, name = dotted.split(".")
    for p in path:
        obj = getattr(obj, p)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        raise ValueError(f"{prefix}{dotted}: no such field; fields: {', '.join(fields)}")
    cur = getattr(obj, name)
    try:
        if isinstance(cur, bool):
            if raw.lower() not in ("true", "false"):
                raise ValueError
            val = raw.lower() == "true"
        else:
            val = type(cur)(raw) if cur is not None else raw
    except ValueError:
        raise ValueError(f"{prefix}{dotted}={raw!r} must be a {type(cur).__name__}") from None
    setattr(obj, name, val)


def accuracy(engine, tokenizer, task: str, n: int) -> float:
    from megak3.data.chat import generation_prompt
    from megak3.data.demo_sft import rl_prompts
    from megak3.inference import SamplingParams
    from megak3.posttrain.rewards import exact_answer

    pairs = rl_prompts(n, task, seed=10 ** 6)  # held out: RL prompts use seeds < 10**6
    outs = engine.generate([generation_prompt(tokenizer, m) for m, _ in pairs], SamplingParams(max_tokens=8))
    return sum(exact_answer(o.text, a) for o, (_, a) in zip(outs, pairs)) / n


TRAIN_FIELDS = ("run_dir", "save_interval", "keep_last", "resume")
"""the ``train.*`` fields an RL run takes (the trainer's names and meanings)"""


def run(args, rl_over, optim_over, shuffle: bool, train_over=(), par_over=()) -> dict:
    from megak3.inference import Engine
    from megak3.optim.config import OptimConfig
    from megak3.posttrain.placement import init_rl_parallel, trainer_ranks
    from megak3.posttrain.rl import RLConfig, RLRunner
    from megak3.job.config import JobConfig, TrainConfig
    from parallel.config import ParallelConfig

    rl = RLConfig()
    for k, v in rl_over:
        _set(rl, k, v, "rl.")
    rl.shuffle_rewards = rl.shuffle_rewards or shuffle
    rl.validate()
    if args.budgets and not rl.env:
        raise ValueError("--budgets sets trajectory budgets of agentic runs; add rl.env=ledger (or fixbug) or drop it")
    optim = OptimConfig(lr=3e-3, warmup_steps=0, min_lr_ratio=1.0)
    for k, v in optim_over:
        _set(optim, k, v, "optim.")
    par = ParallelConfig()
    for k, v in par_over:
        _set(par, k, v, "parallel.")
    trainer_ranks(rl, par)  # the rollout layout and placement (check_run), before the load
    src = Engine.from_pretrained(args.init_from)  # after the cheap checks: a typo fails before the load
    from megak3.data.config import DataConfig

    mcfg = src.model.config
    train = TrainConfig(max_steps=rl.iterations, global_batch_size=1, micro_batch_size=1, seed=rl.seed)
    for k, v in train_over:
        _set(train, k, v, "train.")
    if shuffle and train.run_dir:  # the control keeps its own run directory inside the run's
        train.run_dir = str(Path(train.run_dir) / "control")
    job = JobConfig(model=mcfg, optim=optim, quant=src.load_info["quant"],
                    data=DataConfig(vocab_size=max(260, min(8192, mcfg.vocab_size))),  # unused by RL
                    train=train, parallel=par)
    ps = init_rl_parallel(job, rl)  # validates the job at the trainer's rank count; torchrun: the groups
    if rl.env:
        return run_agentic(args, job, rl, src.tokenizer)
    runner = RLRunner(job, rl, src.tokenizer, ps=ps, init_from=args.init_from)
    resumed = keep(runner, job.train)
    tasks = sorted({t.name for t in runner.task_specs})
    judge = runner.replica == 0  # the first replica's ranks measure the accuracy (together, at its tp)
    before = {t: accuracy(runner.engine, src.tokenizer, t, args.eval_prompts) for t in tasks} if judge else {}
    t0 = time.time()
    tag = "control" if rl.shuffle_rewards else "rl"
    lead = rank0()
    runner.fit(log=(lambda s: print(f"[{tag}] {s}", flush=True)) if args.verbose and lead else None)
    after = {t: accuracy(runner.engine, src.tokenizer, t, args.eval_prompts) for t in tasks} if judge else {}
    before, after = from_judge(before, after, runner)
    if not lead:
        return {}
    a, b, w = first_last(runner.history, "reward", args.window)
    acc = ", ".join(f"{t} {before[t]:.3f} -> {after[t]:.3f}" for t in tasks)
    print(f"[{tag}] reward: {a:.3f} -> {b:.3f} (mean of the first/last {w} iterations); greedy accuracy on "
          f"{args.eval_prompts} held-out prompts: {acc}; {time.time() - t0:.0f} s", flush=True)
    domains = sorted({k for h in runner.history for k in h if k.startswith(("reward_", "kl_"))})
    if domains:  # per domain: the mean reward of its samples and the KL to its teacher (MOPD), first/last window
        parts = []
        for k in domains:
            x, y, _ = first_last(runner.history, k, args.window)
            what = f"KL to teacher {k[3:]}" if k.startswith("kl_") else f"reward {k[7:]}"
            parts.append(f"{what} {x:.3f} -> {y:.3f}")
        print(f"[{tag}] by domain: {'; '.join(parts)}", flush=True)
    if job.train.run_dir:
        print(f"[{tag}] policy version {runner.version} saved in {job.train.run_dir} (megak3 checkpoint"
              f"{'; resumed at version ' + str(resumed) if resumed is not None else ''})", flush=True)
    return {"reward_first": a, "reward_last": b, "acc_before": before, "acc_after": after}


def rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def from_judge(before: dict, after: dict, runner) -> tuple:
    """The accuracies the first engine rank measured, on rank 0 (torchrun; rank 0 trains and prints)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return before, after
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (before, after) if runner.replica == 0 and runner.engine_ps.rank == 0 else None)
    return next(e for e in every if e is not None)


def first_last(history, key: str, window: int):
    """(mean of ``key`` over the first ``window`` records that have it, over the last ``window``, window)."""
    vals = [h[key] for h in history if key in h]
    w = max(min(window, len(vals)), 1)
    return (sum(vals[:w]) / w, sum(vals[-w:]) / w, w) if vals else (float("nan"), float("nan"), 0)


def keep(runner, train) -> "int | None":
    """With ``train.run_dir``: checkpoint the run there and restore per ``train.resume``; returns the
    version resumed at (None: a fresh start)."""
    if not train.run_dir:
        if train.resume != "none":
            raise ValueError(f"train.resume={train.resume} needs train.run_dir=RUN (where the checkpoints are)")
        return None
    if runner.resumable(train.run_dir, train.save_interval, train.resume, train.keep_last):
        return runner.version
    return None


def run_agentic(args, job, rl, tokenizer) -> dict:
    from megak3.posttrain.agentic import AgentRunner

    t0 = time.time()
    mixed, resumed = 0, 0
    cycle = itertools.cycle(args.budgets) if args.budgets else None
    budgets = (lambda: [next(cycle)] * rl.group_size) if cycle else None
    with AgentRunner(job, rl, tokenizer, init_from=args.init_from, budgets=budgets) as runner:
        keep(runner, job.train)
        update = runner.update

        def count(samples, adv):
            nonlocal mixed
            mixed += sum(len({v for v in r.versions if v >= 0}) > 1 for r in samples)
            return update(samples, adv)

        runner.update = count
        runner.fit(log=(lambda s: print(f"[agent] {s}", flush=True)) if args.verbose else None)
        resumed = sum(h["episodes_resumed"] for h in runner.history)
        trained = sum(h.get("trained", 0) for h in runner.history)
        rewards = [h["reward"] for h in runner.history if "reward" in h]
    w = max(min(args.window, len(rewards)), 1)
    a, b = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    print(f"[agent] rl.env={rl.env}: {len(runner.history)} updates, {trained} episodes trained; {resumed} episode pauses at "
          f"iteration boundaries, each resumed with its sandbox digest unchanged; {mixed} trained trajectories hold "
          f"tokens of 2+ policy versions; reward {a:.3f} -> {b:.3f}; {time.time() - t0:.0f} s", flush=True)
    return {"resumed": resumed, "mixed": mixed, "reward_first": a, "reward_last": b}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megak3.posttrain", description=__doc__.split("\n")[0])
    ap.add_argument("--init-from", required=True, help="megak3 run/checkpoint or Hugging Face directory")
    ap.add_argument("--control", action="store_true", help="also run the shuffled-reward control")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--verbose", action="store_true", help="one line per iteration")
    ap.add_argument("--budgets", default="", help="with rl.env: trajectory budgets in tokens, cycled over new "
                    "groups, e.g. 10,400 (episodes of different lengths; default: rl.episode_tokens for all)")
    ap.add_argument("overrides", nargs="*", help="rl.FIELD=VALUE, rl.loss.FIELD=VALUE, rl.rollout.FIELD=VALUE, "
                    "optim.FIELD=VALUE, parallel.FIELD=VALUE (the trainer's layout under torchrun), "
                    "train.run_dir=RUN, train.save_interval=N, train.keep_last=N, train.resume=auto|none|CKPT")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        rl_over, optim_over, train_over, par_over = [], [], [], []
        for o in args.overrides:
            if "=" not in o or not o.startswith(("rl.", "optim.", "train.", "parallel.")):
                raise ValueError(f"{o}: overrides are rl.FIELD=VALUE, optim.FIELD=VALUE, parallel.FIELD=VALUE or "
                                 f"train.FIELD=VALUE (train.{', train.'.join(TRAIN_FIELDS)})")
            k, v = o.split("=", 1)
            if k.startswith("train.") and k.split(".", 1)[1] not in TRAIN_FIELDS:
                raise ValueError(f"{k}: an RL run takes train.{', train.'.join(TRAIN_FIELDS)}")
            {"rl": rl_over, "optim": optim_over, "train": train_over,
             "parallel": par_over}[k.split(".", 1)[0]].append((k.split(".", 1)[1], v))
        try:
            args.budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
        except ValueError:
            args.budgets = [0]
        if any(b < 1 for b in args.budgets):
            raise ValueError("--budgets must be comma-separated integers >= 1, e.g. 10,400")
        if args.eval_prompts < 1:
            raise ValueError(f"--eval-prompts={args.eval_prompts} must be >= 1")
        run(args, rl_over, optim_over, shuffle=False, train_over=train_over, par_over=par_over)
        if args.control:
            run(args, rl_over, optim_over, shuffle=True, train_over=train_over, par_over=par_over)
    except ValueError as e:  # InferenceError, config errors: one line (under torchrun: rank 0 prints it)
        import os

        from megak3.launch.torchrun import record_user_error

        if os.environ.get("RANK", "0") in ("", "0"):
            print(f"error: {e}", file=sys.stderr, flush=True)
        record_user_error(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
