#!/usr/bin/env python
"""Engine cost per step and per sequence, the current code vs a git revision's, in one run.

    python tools/bench_engine_batch.py                 # about a minute on a shared CPU core
    python tools/bench_engine_batch.py --baseline HEAD~3 --batches 1 8 32
    python tools/bench_engine_batch.py --long 4096 --long-group 8   # prompt holds on vs off

Three measurements on the tiny random K3 of tools/bench_rollout.py (parallel.testing's PARITY_MODEL widths,
fp32, one thread, the page size and pool of that bench), each run by both engines, alternating:

* decode: B sequences with distinct ``--prompt``-token prompts, seeded sampling at temperature 1, all
  prefilled; then ``--steps`` scheduler iterations (one ragged decode step of B sequences each, with
  the sampling and cache bookkeeping) are timed. Printed: ms per step for every B and the least-squares
  fit ``a + b * B`` (b: the per-sequence cost of a decode step).
* group start: ``--group`` samples of one prompt (a GRPO group) from ``begin`` until every one has its
  first token (one prefill chunk per scheduler iteration, the others decoding meanwhile). Printed: ms
  per sample.

* long group start (current code only): ``--long-group`` samples of one ``--long``-token prompt (an
  agent context), prompt holds on (``Engine(share_prompts=True)``: the later samples wait for the first
  to fill the prefix cache) vs off, from ``begin`` until every sample has its first token. Printed: CPU
  ms until the last and (mean) each sample has its first token, and the prefill tokens computed
  (``cache_stats()["prefill_computed"]``); the tokens must be equal and the logprobs within 1e-5
  (checked: a decode step's rounding depends on which sequences share it). ``--long 0`` skips it.

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


def long_group(model, prompt, k: int, share: bool):
    """CPU seconds until the last / (mean) each of ``k`` samples of ``prompt`` has its first token,
    the prefill tokens computed meanwhile, and the samples' outputs (4 tokens each)."""
    import megak3.inference.engine as new

    eng = new.Engine(model, page_size=16, num_pages=8192, max_batch=1024, share_prompts=share)
    t0 = time.process_time()
    hs = [eng.begin(prompt, params(new, i, 4)) for i in range(k)]
    first = {}
    while len(first) < k:
        for h, _, _ in eng.step(hs):
            first.setdefault(h.id, time.process_time() - t0)
    computed = eng.cache_stats()["prefill_computed"]
    while any(not h.finished for h in hs):
        eng.step(hs)
    return max(first.values()), sum(first.values()) / k, computed, [(h.token_ids, h.logprobs) for h in hs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the engine to compare with")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=20, help="decode iterations timed per batch size")
    ap.add_argument("--prompt", type=int, default=24, help="prompt tokens")
    ap.add_argument("--group", type=int, default=8, help="samples of one prompt in the group-start measurement")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of old/new (medians are printed)")
    ap.add_argument("--long", type=int, default=2048, help="prompt tokens of the long group start (0: skip it)")
    ap.add_argument("--long-group", type=int, default=4, help="samples in the long group start")
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.steps < 1 or args.prompt < 1 or args.group < 1 or args.repeat < 1:
        print("error: --batches, --steps, --prompt, --group and --repeat must be >= 1", file=sys.stderr)
        return 2
    if args.long < 0 or args.long_group < 1 or args.long > 8000:
        print("error: --long must be in [0, 8000] and --long-group >= 1", file=sys.stderr)
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
    if args.long:
        same &= long_start(model, args)
    return 0 if same else 1


def long_start(model, args) -> bool:
    """The long group start, holds on vs off (alternating rounds); prints it; False if outputs differ."""
    prompt = torch.randint(4, model.config.vocab_size, (args.long,), generator=torch.Generator().manual_seed(1)).tolist()
    res = {True: [], False: []}
    for r in range(args.repeat):
        for share in ((True, False) if r % 2 == 0 else (False, True)):
            res[share].append(long_group(model, prompt, args.long_group, share))
    outs = {share: res[share][0][3] for share in res}
    ok = all(a[0] == b[0] and np.allclose(a[1], b[1], rtol=0, atol=1e-5) for a, b in zip(outs[True], outs[False]))
    med = {(share, i): statistics.median(x[i] for x in res[share]) for share in res for i in range(3)}
    print(f"long group start ({args.long_group} samples of one {args.long}-token prompt, prefill chunk 256, "
          f"KDA checkpoint every 512): CPU ms until every sample / (mean) each sample has its first token")
    for share, tag in ((True, "holds on "), (False, "holds off")):
        print(f"  {tag}: {med[share, 0] * 1e3:9.1f} ms all, {med[share, 1] * 1e3:9.1f} ms mean, "
              f"{int(med[share, 2])} prefill tokens computed")
    print(f"  on/off: all {med[True, 0] / med[False, 0]:.2f}, mean {med[True, 1] / med[False, 1]:.2f}, "
          f"prefill tokens {med[True, 2] / med[False, 2]:.2f}")
    print("long group outputs, holds on vs off: " + ("same tokens, logprobs within 1e-5" if ok else "DIFFERENT"))
    return ok


if __name__ == "__main__":
    sys.exit(main())
