"""Sequences served at once from a fixed page pool: admission with preemption by recompute vs reserving
prompt + max_tokens pages up front (the former policy), measured in the same run.

    python tools/bench_preempt.py                                  # 24 requests, 64-page pool
    python tools/bench_preempt.py --requests 8 --new 16 --pool 24  # quick look

The same ``--requests`` greedy requests (random prompts of ``--prompt`` tokens +- 25 %, ``--new`` new
tokens each, eos ignored) go through two megak3.inference.Engine instances with ``--pool`` pages of
``--page-size`` tokens: ``Engine(preempt=False)`` (every admission reserves its whole prompt + max_tokens)
and ``Engine(preempt=True)`` (admission reserves the prompt; the newest sequence is preempted and later
recomputed when decoding runs out of pages). Both are driven by ``Engine.step()``; after every step the
bench counts the sequences holding pages. Printed per policy: mean and peak sequences at once, scheduler
steps, preemptions, wall seconds and generated tokens/s, then the ratios (preempt / reserve) and whether
every output is identical across the two policies (it must be: recompute is exact).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megak3.cli import Parser, error_exit  # noqa: E402
from megak3.config import load_model_config  # noqa: E402
from megak3.inference import Engine, InferenceError, SamplingParams  # noqa: E402
from megak3.model.k3 import build_model  # noqa: E402
from parallel.testing import PARITY_MODEL  # noqa: E402


def serve(model, prompts, sp, args, preempt: bool) -> dict:
    eng = Engine(model, page_size=args.page_size, num_pages=args.pool, checkpoint_interval=args.interval,
                 prefill_chunk=args.chunk, max_batch=args.requests, preempt=preempt)
    hs = [eng.begin(p, sp) for p in prompts]
    counts, steps, t0 = [], 0, time.perf_counter()
    while eng.live():
        eng.step()
        steps += 1
        counts.append(sum(h.admitted for h in hs))
    wall = time.perf_counter() - t0
    return {"mean": sum(counts) / len(counts), "peak": max(counts), "steps": steps,
            "preemptions": eng.preemptions, "wall": wall, "tok_s": sum(len(h.token_ids) for h in hs) / wall,
            "outputs": [h.token_ids for h in hs]}


def main(argv=None) -> int:
    p = Parser(prog="bench_preempt", description=__doc__)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt", type=int, default=32, help="mean prompt tokens")
    p.add_argument("--new", type=int, default=48, help="new tokens per request (its max_tokens)")
    p.add_argument("--pool", type=int, default=64, help="pages in the pool")
    p.add_argument("--page-size", type=int, default=8)
    p.add_argument("--interval", type=int, default=64, help="KDA checkpoint interval (tokens)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk tokens")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("requests", "prompt", "new", "pool", "page_size", "interval", "chunk", "threads"):
        if getattr(args, name) < 1:
            return error_exit("bench_preempt", ValueError(f"--{name.replace('_', '-')} must be >= 1"))
    torch.set_num_threads(args.threads)
    model = build_model(load_model_config("k3_tiny", **PARITY_MODEL), seed=0).eval()
    g = torch.Generator().manual_seed(0)
    lo, hi = max(1, args.prompt * 3 // 4), max(1, args.prompt * 5 // 4)
    prompts = [torch.randint(4, model.config.vocab_size, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(args.requests)]
    sp = SamplingParams(max_tokens=args.new, ignore_eos=True)
    try:
        res = {name: serve(model, prompts, sp, args, pre) for name, pre in (("reserve", False), ("preempt", True))}
    except InferenceError as e:
        return error_exit("bench_preempt", e)
    print(f"{args.requests} requests, prompts {lo}-{hi} + {args.new} new tokens, pool {args.pool} pages "
          f"x {args.page_size} tokens")
    print(f"{'policy':<10}{'mean seqs':>10}{'peak':>6}{'steps':>7}{'preempt':>9}{'wall s':>8}{'tok/s':>8}")
    for name, r in res.items():
        print(f"{name:<10}{r['mean']:>10.2f}{r['peak']:>6}{r['steps']:>7}{r['preemptions']:>9}{r['wall']:>8.2f}"
              f"{r['tok_s']:>8.1f}")
    a, b = res["preempt"], res["reserve"]
    print(f"preempt / reserve: mean sequences at once {a['mean'] / b['mean']:.2f}x, peak {a['peak'] / b['peak']:.2f}x, "
          f"steps {a['steps'] / b['steps']:.2f}x, tokens/s {a['tok_s'] / b['tok_s']:.2f}x")
    same = a["outputs"] == b["outputs"]
    print(f"outputs identical across policies: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
