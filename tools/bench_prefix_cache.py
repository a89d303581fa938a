"""Replay a synthetic multi-turn agent trace under four prefix-cache policies, in one run.

    python tools/bench_prefix_cache.py                       # default trace (a few minutes on 2 cores)
    python tools/bench_prefix_cache.py --sessions 3 --turns 2 --system 64   # quick look

The trace: ``--sessions`` sessions share a ``--system``-token system prompt; every turn appends a
tool output (random length) to the session's history and the model's greedy reply (``--reply``
tokens) after it; ``--branches`` extra sessions fork an existing session after its first turn and
continue with their own tool outputs. Turns are replayed round-robin over the sessions (so entries
compete for the pool), one request at a time through megak3.inference.Engine.

Policies (KDA checkpoint placement; all restore MLA blocks + KDA state together):
  no-reuse     no prefix cache
  last         a checkpoint only at the last boundary before each prompt's end (vLLM hybrid "align")
  coarse       checkpoints every ``--coarse`` tokens (K3's 32K serving interval, scaled by the
               same factor as ``--interval`` is from 512)
  ours         checkpoints every ``--interval`` tokens (K3's 512, scaled) at prefill and decode
no-reuse and last get the pool budget ``--pages``; coarse and ours get only the peak that last
actually used, so "ours" is compared at no more cache memory than "last".

Printed per policy: prompt tokens prefilled (computed), hit rate (prompt tokens restored / prompt
tokens), mean time to first token, peak cache bytes in use and the budget. The last lines check
the targets: ours <= 1/3 of no-reuse's prefill tokens and < last's, at peak memory <= last's.
"""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megak3.config import load_model_config  # noqa: E402
from megak3.inference import Engine, SamplingParams  # noqa: E402
from megak3.model.k3 import build_model  # noqa: E402
from parallel.testing import PARITY_MODEL  # noqa: E402


def make_trace(args, vocab: int):
    """[(session id, fresh tokens to append before this turn's prompt, parent session or None)]."""
    rnd = random.Random(args.seed)
    tok = lambda n: [rnd.randrange(4, vocab) for _ in range(n)]
    system = tok(args.system)
    plan = []
    for t in range(args.turns):
        for s in range(args.sessions + args.branches):
            if s >= args.sessions and t == 0:
                continue   # a branch starts at turn 1 from its parent's history after turn 0
            parent = (s - args.sessions) % args.sessions if s >= args.sessions and t == 1 else None
            first = system + tok(args.user) if t == 0 else []
            plan.append((s, first + tok(rnd.randint(args.tool_min, args.tool_max)), parent))
    return plan


def replay(model, plan, args, mode: str, interval: int, pages: int) -> dict:
    eng = Engine(model, page_size=args.page_size, num_pages=pages, checkpoint_interval=interval,
                 checkpoint_mode=mode, prefill_chunk=args.chunk, max_batch=1)
    hist, prompt_tokens, ttft, replies = {}, 0, [], {}
    for s, fresh, parent in plan:
        base = list(hist[parent]) if parent is not None else hist.get(s, [])
        prompt = base + fresh
        prompt_tokens += len(prompt)
        t0 = time.perf_counter()
        out = []
        for i, (t, _) in enumerate(eng.stream(prompt, SamplingParams(max_tokens=args.reply, ignore_eos=True))):
            if i == 0:
                ttft.append(time.perf_counter() - t0)
            out.append(t)
        hist[s] = prompt + out
        replies[len(replies)] = out
    st = eng.cache_stats()
    return {"prefill": prompt_tokens - st["hit_tokens"], "prompt": prompt_tokens,
            "hit_rate": st["hit_tokens"] / prompt_tokens, "ttft_ms": 1e3 * sum(ttft) / len(ttft),
            "peak_bytes": st["peak_bytes"], "peak_pages": st["peak_pages"], "budget": st["device_bytes_budget"],
            "replies": replies, "checkpoints": st["checkpoints"], "evicted": st["evicted"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--branches", type=int, default=2)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system", type=int, default=256, help="shared system prompt tokens")
    p.add_argument("--user", type=int, default=32, help="first user message tokens")
    p.add_argument("--tool-min", type=int, default=48)
    p.add_argument("--tool-max", type=int, default=160)
    p.add_argument("--reply", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--interval", type=int, default=32, help="ours: checkpoint interval (K3's 512, scaled)")
    p.add_argument("--coarse", type=int, default=2048, help="coarse: interval (32K scaled like --interval)")
    p.add_argument("--pages", type=int, default=4096, help="cache budget in pages for no-reuse and last")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("sessions", "turns", "system", "reply", "page_size", "interval", "coarse", "pages", "chunk"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1", file=sys.stderr)
            return 2
    if args.branches and args.turns < 2:
        print("--branches needs --turns >= 2 (a branch forks after turn 0)", file=sys.stderr)
        return 2
    for name in ("interval", "coarse"):
        if getattr(args, name) % args.page_size:
            print(f"--{name}={getattr(args, name)} must be a multiple of --page-size={args.page_size}",
                  file=sys.stderr)
            return 2
    torch.set_num_threads(args.threads)
    model = build_model(load_model_config("k3_tiny", **{**PARITY_MODEL, "max_seq_len": 1 << 16}), seed=0).eval()
    plan = make_trace(args, model.config.vocab_size)
    print(f"trace: {len(plan)} requests, {args.sessions} sessions + {args.branches} branches x {args.turns} turns, "
          f"system prompt {args.system} tokens, page {args.page_size} tokens, "
          f"KDA checkpoint {model.config.kda.num_heads}x{model.config.kda.head_dim}^2 state per KDA layer")
    res = {}
    res["no-reuse"] = replay(model, plan, args, "none", args.interval, args.pages)
    res["last"] = replay(model, plan, args, "last", args.interval, args.pages)
    tight = max(res["last"]["peak_pages"], 1)
    res[f"coarse({args.coarse})"] = replay(model, plan, args, "all", args.coarse, tight)
    res[f"ours({args.interval})"] = replay(model, plan, args, "all", args.interval, tight)
    print(f"{'policy':<14}{'prefilled':>10}{'hit rate':>10}{'TTFT ms':>10}{'peak MiB':>10}{'budget MiB':>12}"
          f"{'ckpts':>7}{'evicted':>9}")
    for name, r in res.items():
        print(f"{name:<14}{r['prefill']:>10}{r['hit_rate']:>10.3f}{r['ttft_ms']:>10.1f}"
              f"{r['peak_bytes'] / 2**20:>10.2f}{r['budget'] / 2**20:>12.2f}{r['checkpoints']:>7}{r['evicted']:>9}")
    base, last, ours = res["no-reuse"], res["last"], res[f"ours({args.interval})"]
    same = all(r["replies"] == base["replies"] for r in res.values())
    print(f"replies identical across policies: {same}")
    ok1 = ours["prefill"] * 3 <= base["prefill"]
    ok2 = ours["prefill"] < last["prefill"] and ours["peak_bytes"] <= last["peak_bytes"]
    print(f"ours / no-reuse prefill = {ours['prefill'] / base['prefill']:.3f} (target <= 0.333): "
          f"{'PASS' if ok1 else 'FAIL'}")
    print(f"ours / last prefill = {ours['prefill'] / max(last['prefill'], 1):.3f} (target < 1) at peak memory "
          f"{ours['peak_bytes'] / max(last['peak_bytes'], 1):.3f}x last's (target <= 1): {'PASS' if ok2 else 'FAIL'}")
    return 0 if (ok1 and ok2 and same) else 1


if __name__ == "__main__":
    sys.exit(main())
