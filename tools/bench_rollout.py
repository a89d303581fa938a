#!/usr/bin/env python
"""Partial vs synchronous rollouts on a long-tailed (agent-like) response-length trace, same work, one run.

    python tools/bench_rollout.py                 # 3-10 min on 2 shared CPU cores (3 modes)
    python tools/bench_rollout.py --small         # seconds: checks that it runs and prints the ratios

Every mode runs the real loop (megak3/posttrain/rl.py RLRunner: engine rollouts through PartialRollouts,
the RankStep update, the in-memory refit) on the same tiny random K3 (parallel.testing's PARITY_MODEL
widths), the same prompt stream and the same per-sample budgets: group g of every mode gets the g-th
prompt and the g-th K budgets of one seeded trace. Every sample runs to its budget (rl.ignore_eos), so the
response lengths are exactly the trace: log-normal with median ``--median`` tokens and shape ``--sigma``
(p99/p50 = exp(2.326 sigma), 20.6 at sigma 1.3), cut at ``--cap``: most samples are short and a few are
20-60x the median, as agent episodes are (most tasks end in a few turns, some run long). The trace's
quantiles are printed, and those of the samples trained.

The work is the same in every mode: the prompt set is ceil(samples / K) groups (no prompt joins after
them, so the loop drains at the end), every mode trains all of them, and the time counts from the first
iteration (engine and trainer built before) to the last update: the same tokens generated, the same
samples trained, only the schedule differs. With ``--endless`` the prompt stream goes on (as in a long
run): each mode is timed until those groups are trained, and the work it did on later groups meanwhile
counts in its time but not in its trained samples (a bias against the partial modes).

Staleness: rl.py's partial_fraction mode has no staleness bound (a paused sample continues until its
budget is spent, however many updates pass), so it is compared at about equal update size: ``--update`` samples per update in the synchronous mode (rl.prompts = update / K, lambda = 1), and
``--inflight`` times as many groups in the engine in the partial mode (rl.prompts = inflight * update / K),
which updates once ``--lam`` of them are finished (rl.partial_fraction); the samples per update of each
and the staleness the partial mode reached (mean versions behind per trained token, the most versions one
trained sample spans) are printed. ``--max-stale S`` (default 2; 0: off) runs a third mode with
``rl.update_groups = update / K`` (the update starts once that many groups are finished) and
``rl.max_staleness = S`` (no trained token more than S versions stale).

Printed per mode: trained samples per second, the learner's idle fraction (the share of the mode's time
spent generating, when the colocated learner waits), the mean decode batch (sequences per decode step:
the decode-batch occupancy) and the update + refit seconds per update; then the ratios against the
synchronous mode. The modes are interleaved iteration by iteration (the one with the least time so far
goes next), so a change in the machine's load falls on all of them alike. Measured figures and why partial
rollouts pay what they do here: docs/POSTTRAIN.md, "Partial rollouts on a long tail".
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def trace(args, n: int) -> np.ndarray:
    """The response budgets of the first ``n`` samples (the same list for both modes)."""
    rng = np.random.default_rng(args.seed)
    return np.clip(np.rint(args.median * np.exp(args.sigma * rng.standard_normal(n))), 1, args.cap).astype(int)


class Mode:
    """One RL run of the comparison; :meth:`step` runs one iteration of its loop and adds up its time."""

    def __init__(self, name: str, kind: str, args, tok, budgets_all):
        from megak3.config import load_model_config
        from megak3.data.config import DataConfig
        from megak3.optim.config import OptimConfig
        from megak3.posttrain.rl import RLConfig, RLRunner
        from megak3.job.config import JobConfig, TrainConfig
        from parallel.testing import PARITY_MODEL

        K = args.group_size
        job = JobConfig(model=load_model_config("k3_tiny", **PARITY_MODEL), data=DataConfig(vocab_size=512),
                        optim=OptimConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0),
                        train=TrainConfig(max_steps=10 ** 6, global_batch_size=1, micro_batch_size=1,
                                          seed=1)).validate()
        self.name, self.args = name, args
        self.groups = args.update // K * (1 if kind == "sync" else args.inflight)
        rl = RLConfig(prompts=self.groups, group_size=K, max_tokens=args.cap, temperature=1.0,
                      partial_fraction=args.lam if kind == "partial" else 1.0, ignore_eos=True,
                      micro_batch_size=args.micro_batch, iterations=10 ** 6, seed=1,
                      update_groups=args.update // K if kind == "group" else 0,
                      max_staleness=args.max_stale if kind == "group" else 0)
        next_group = iter(range(10 ** 9))
        budgets = lambda: [int(b) for b in budgets_all[next(next_group) * K:][:K]]  # noqa: E731
        self.runner = runner = RLRunner(job, rl, tok, budgets=budgets,
                                   engine_options={"page_size": 16, "num_pages": 8192, "max_batch": 1024})
        self.steps = {"n": 0, "seqs": 0}
        decode = runner.engine._decode

        def counted(seqs):  # measures the decode batch; the step itself is the engine's
            self.steps["n"] += 1
            self.steps["seqs"] += len(seqs)
            return decode(seqs)

        runner.engine._decode = counted
        self.window = -(-args.samples // K)
        """groups 0 .. window-1 are the measured work (the same prompts and budgets in every mode)"""
        self.seen = {"lens": [], "span": 0, "stale": 0, "tokens": 0, "window": 0, "all": 0}
        update = runner.update

        def watched(samples, adv):  # records what is trained on; the update itself is RLRunner's
            self.seen["all"] += len(samples)
            for r in samples:
                if r.group >= self.window:  # --endless: a later group's sample (its work is in the time)
                    continue
                self.seen["window"] += 1
                self.seen["lens"].append(len(r.token_ids))
                self.seen["span"] = max(self.seen["span"], max(r.versions) - min(r.versions) + 1)
                self.seen["stale"] += sum(runner.version - v for v in r.versions)
                self.seen["tokens"] += len(r.versions)
            t0 = self.clock()
            out = update(samples, adv)
            self.upd += self.clock() - t0
            return out

        runner.update = watched
        add_prompt = runner.buffer.add_prompt

        admitted = iter(range(10 ** 9))

        def finite(*prompt, **tags):  # the prompt set ends after the window: the loop drains
            return add_prompt(*prompt, **tags) if next(admitted) < self.window or args.endless else []

        runner.buffer.add_prompt = finite
        self.wall, self.updates, self.gen, self.upd = 0.0, 0, 0.0, 0.0
        self.clock = time.perf_counter if args.wall_clock else time.process_time
        generate, refit = runner.generate, runner.refit

        def timed_generate():  # the generation phase's time on this mode's clock
            t0 = self.clock()
            out = generate()
            self.gen += self.clock() - t0
            return out

        def timed_refit():
            t0 = self.clock()
            out = refit()
            self.upd += self.clock() - t0
            return out

        runner.generate, runner.refit = timed_generate, timed_refit

    @property
    def trained(self) -> int:
        return self.seen["window"]

    @property
    def done(self) -> bool:
        return self.trained >= self.window * self.args.group_size

    def step(self) -> None:
        t0 = self.clock()
        rec = self.runner.iteration()
        self.wall += self.clock() - t0
        self.updates += bool(rec.get("trained"))

    def result(self) -> dict:
        return {"wall": self.wall, "updates": self.updates, "trained": self.trained, "upd": self.upd,
                "all": self.seen["all"],
                "sps": self.trained / self.wall, "idle": self.gen / self.wall, "groups": self.groups,
                "batch": self.steps["seqs"] / max(self.steps["n"], 1), "steps": self.steps["n"],
                "per_update": self.wall / self.updates,
                "lens": np.array(self.seen["lens"]), "span": self.seen["span"],
                "stale": self.seen["stale"] / max(self.seen["tokens"], 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--group-size", type=int, default=8, help="K rollouts per prompt (the GRPO group)")
    ap.add_argument("--update", type=int, default=32, help="samples per update of the synchronous mode")
    ap.add_argument("--inflight", type=int, default=2,
                    help="partial mode: groups in the engine, as a multiple of the synchronous update's")
    ap.add_argument("--lam", type=float, default=0.9, help="partial mode: rl.partial_fraction")
    ap.add_argument("--samples", type=int, default=256, help="trained samples per mode after the warm-up")
    ap.add_argument("--median", type=float, default=8.0, help="median response tokens of the trace")
    ap.add_argument("--sigma", type=float, default=1.3, help="log-normal shape of the trace (p99/p50 = e^2.326s)")
    ap.add_argument("--cap", type=int, default=512, help="longest response budget")
    ap.add_argument("--micro-batch", type=int, default=8, help="rl.micro_batch_size of the update")
    ap.add_argument("--max-stale", type=int, default=2,
                    help="a third mode: rl.update_groups=update/K with rl.max_staleness=S (0: not run)")
    ap.add_argument("--endless", action="store_true",
                    help="the prompt stream does not end: a mode is timed until the same groups are trained, and "
                         "the later groups it worked on meanwhile count in its time only")
    ap.add_argument("--wall-clock", action="store_true",
                    help="time by the wall clock (default: this process's CPU time, as the machine may be shared)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="a seconds-long run (tests): tiny trace and update")
    args = ap.parse_args(argv)
    if args.small:
        args.group_size, args.update, args.samples, args.median, args.cap = 2, 4, 16, 2.0, 48
    for name in ("group_size", "update", "inflight", "samples", "cap", "micro_batch", "max_stale"):
        if getattr(args, name) < (0 if name == "max_stale" else 1):
            print(f"error: --{name.replace('_', '-')}={getattr(args, name)} must be >= "
                  f"{0 if name == 'max_stale' else 1}", file=sys.stderr)
            return 2
    if args.update % args.group_size:
        print(f"error: --update={args.update} must be a multiple of --group-size={args.group_size}", file=sys.stderr)
        return 2
    if not 0 < args.lam < 1:
        print(f"error: --lam={args.lam} must lie in (0, 1)", file=sys.stderr)
        return 2
    if args.median <= 0 or args.sigma < 0:
        print("error: --median must be > 0 and --sigma >= 0", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    from megak3.data.tokenizer import load_tokenizer
    from megak3.data.demo_sft import build_demo_sft_dataset

    with tempfile.TemporaryDirectory() as d:
        tok = load_tokenizer(build_demo_sft_dataset(d, 512, num_conversations=300, progress=False)[1])
    budgets = trace(args, 200_000)
    q = lambda x, p: float(np.percentile(x, p))  # noqa: E731
    print(f"trace: log-normal, median {args.median:g}, sigma {args.sigma:g}, cap {args.cap}: p50 {q(budgets, 50):.0f}, "
          f"p90 {q(budgets, 90):.0f}, p99 {q(budgets, 99):.0f} tokens, p99/p50 = {q(budgets, 99) / q(budgets, 50):.1f} "
          f"(uncut: {math.exp(2.3263 * args.sigma):.1f}), mean {budgets.mean():.1f}")
    modes = [Mode("synchronous", "sync", args, tok, budgets),
             Mode(f"partial (lambda={args.lam:g})", "partial", args, tok, budgets)]
    if args.max_stale:
        modes.append(Mode(f"partial, group trigger*", "group", args, tok, budgets))
    while not all(m.done for m in modes):  # interleaved: the machine's load falls on every mode alike
        min((m for m in modes if not m.done), key=lambda m: m.wall).step()
    res = [m.result() for m in modes]
    print("times: " + ("wall clock" if args.wall_clock else "CPU seconds of this one-thread process (the wall clock "
                                                              "counts other programs' load; --wall-clock for it)"))
    K = args.group_size
    for m, r in zip(modes, res):
        L = r["lens"]
        print(f"{m.name:>24}: {r['groups']} groups x {K} in flight; {r['trained']} samples of groups 0-{m.window - 1} "
              f"(lengths p50 {q(L, 50):.0f}, p99 {q(L, 99):.0f}, max {L.max()}) trained in {r['wall']:.1f} s, "
              f"{r['updates']} updates ({r['all'] / r['updates']:.1f} samples/update): "
              f"{r['sps']:.2f} trained samples/s, "
              f"learner idle {r['idle']:.1%}, "
              f"mean decode batch {r['batch']:.1f} seqs ({r['steps']} decode steps), "
              f"{r['upd'] / r['updates']:.2f} s update + refit per update; "
              f"staleness {r['stale']:.2f} versions/token, a sample spans <= {r['span']} versions")
    sync = res[0]
    for m, r in zip(modes[1:], res[1:]):
        print(f"{m.name} / synchronous: trained samples per second x{r['sps'] / sync['sps']:.2f}, "
              f"learner idle fraction x{r['idle'] / sync['idle']:.2f}, "
              f"mean decode batch x{r['batch'] / sync['batch']:.2f}")
    if args.max_stale:
        print(f"* rl.update_groups={args.update // K} (update once that many groups are finished) and "
              f"rl.max_staleness={args.max_stale} (no trained token more than that many versions stale)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
