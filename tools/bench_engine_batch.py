#!/usr/bin/env python
"""Engine cost per step and per sequence, the current code vs a git revision's, in one run.

    python tools/bench_engine_batch.py                 # about a minute on a shared CPU core
    python tools/bench_engine_batch.py --baseline HEAD~3 --batches 1 8 32

Two measurements on the tiny random K3 of tools/bench_rollout.py (parallel.testing's PARITY_MODEL widths,
fp32, one thread, the page size and pool of that bench), each run by both engines, alternating:

* decode: B sequences with distinct ``--prompt``-token prompts, seeded sampling at temperature 1, all
  prefilled; then ``--steps`` scheduler iterations (one ragged decode step of B sequences each, with
  the sampling and cache bookkeeping) are timed. Printed: ms per step for every B and the least-squares
  fit ``a + b * B`` (b: the per-sequence cost of a decode step).
* group start: ``--group`` samples of one prompt (a GRPO group) from ``begin`` until every one has its
  first token (one prefill chunk per scheduler iteration, the others decoding meanwhile). Printed: ms
  per sample.

The baseline engine is megak3/inference/{types,sampling,cache,runner,handles,engine}.py as of ``--baseline``
(default: the commit before the prefill sharing), read with ``git show`` and imported beside the
current ones (nothing is checked out). Both engines must produce the same tokens and logprobs bit for
bit on every workload (checked; a difference exits 1). Times are CPU seconds of this process (the
machine may be shared); the median of ``--repeat`` rounds is printed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BASELINE = "450af82"
MODULES = ("types", "sampling", "cache", "runner", "handles", "engine")   # in import order
OPTIONAL = {"handles"}   # not at every revision


def load_baseline(rev: str):
    """megak3/inference's engine modules as of git revision ``rev``, as a package of their own."""
    pkg = types.ModuleType("megak3._baseline_inference")
    pkg.__path__ = []
    sys.modules[pkg.__name__] = pkg
    for name in MODULES:
        path = f"megak3/inference/{name}.py"
        src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True)
        if src.returncode and name in OPTIONAL:
            continue
        if src.returncode:
            raise ValueError(f"--baseline {rev}: git show {path} failed: {src.stderr.strip()}")
        mod = types.ModuleType(f"{pkg.__name__}.{name}")
        mod.__package__, mod.__file__ = pkg.__name__, f"{path}@{rev}"
        sys.modules[mod.__name__] = mod
        exec(compile(src.stdout, mod.__file__, "exec"), mod.__dict__)
        setattr(pkg, name, mod)
    return pkg.engine


def build_model():
    from megak3.config import load_model_config
    from megak3.model.k3 import build_model as build
    from parallel.testing import PARITY_MODEL

    return build(load_model_config("k3_tiny", **PARITY_MODEL), seed=0).eval()


def engine(mod, model):
    return mod.Engine(model, page_size=16, num_pages=8192, max_batch=1024)


def params(mod, i: int, n: int):
    return mod.SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)


def decode(mod, model, prompts, steps: int):
    """CPU seconds per scheduler iteration of len(prompts) decoding sequences; their outputs."""
    eng = engine(mod, model)
    hs = [eng.begin(p, params(mod, i, steps + len(prompts) + 2)) for i, p in enumerate(prompts)]
    while any(not h.token_ids for h in hs):   # one prefill per iteration: the first ones decode meanwhile
        eng.step(hs)
    t0 = time.process_time()
    for _ in range(steps):
        eng.step(hs)
    dt = (time.process_time() - t0) / steps
    return dt, [(h.token_ids, h.logprobs) for h in hs]


def group_start(mod, model, prompt, k: int):
    """CPU seconds per sample until all ``k`` samples of one prompt have their first token."""
    eng = engine(mod, model)
    t0 = time.process_time()
    hs = [eng.begin(prompt, params(mod, i, 64)) for i in range(k)]
    while any(not h.token_ids for h in hs):
        eng.step(hs)
    dt = (time.process_time() - t0) / k
    return dt, [(h.token_ids, h.logprobs) for h in hs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the engine to compare with")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=20, help="decode iterations timed per batch size")
    ap.add_argument("--prompt", type=int, default=24, help="prompt tokens")
    ap.add_argument("--group", type=int, default=8, help="samples of one prompt in the group-start measurement")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of old/new (medians are printed)")
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.steps < 1 or args.prompt < 1 or args.group < 1 or args.repeat < 1:
        print("error: --batches, --steps, --prompt, --group and --repeat must be >= 1", file=sys.stderr)
        return 2
    try:
        old = load_baseline(args.baseline)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import megak3.inference.engine as new

    torch.set_num_threads(1)
    model = build_model()
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prompts = [torch.randint(4, V, (args.prompt,), generator=g).tolist() for _ in range(max(args.batches))]
    times = {(tag, key): [] for tag in ("old", "new") for key in list(args.batches) + ["group"]}
    same = True
    for r in range(args.repeat):
        order = (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))
        outs = {}
        for tag, mod in order:
            for B in args.batches:
                dt, outs[tag, B] = decode(mod, model, prompts[:B], args.steps)
                times[tag, B].append(dt)
            dt, outs[tag, "group"] = group_start(mod, model, prompts[0], args.group)
            times[tag, "group"].append(dt)
        same &= all(outs["old", k] == outs["new", k] for k in list(args.batches) + ["group"])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: k3_tiny at parity widths, fp32, 1 thread; {args.prompt}-token prompts; CPU ms, median of "
          f"{args.repeat}; old = megak3/inference at {args.baseline}")
    print(f"{'decode batch':>14}{'new ms/step':>13}{'old ms/step':>13}{'new/old':>9}")
    for B in args.batches:
        print(f"{B:>14}{med['new', B] * 1e3:13.2f}{med['old', B] * 1e3:13.2f}{med['new', B] / med['old', B]:9.2f}")
    if len(set(args.batches)) > 1:
        A = np.stack([np.ones(len(args.batches)), np.array(args.batches, float)], 1)
        for tag in ("new", "old"):
            a, b = np.linalg.lstsq(A, np.array([med[tag, B] for B in args.batches]), rcond=None)[0]
            print(f"{tag} decode step: {a * 1e3:.2f} ms + {b * 1e3:.3f} ms per sequence")
    print(f"group start ({args.group} samples of one prompt, to their first tokens): "
          f"new {med['new', 'group'] * 1e3:.2f} ms/sample, old {med['old', 'group'] * 1e3:.2f} ms/sample, "
          f"new/old {med['new', 'group'] / med['old', 'group']:.2f}")
    print("outputs (tokens, logprobs) of old and new: " + ("identical" if same else "DIFFERENT"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
