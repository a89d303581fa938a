"""Cache-affine routing vs round-robin and least-loaded on an agent trace (megak3/inference/router.py).

    PYTHONPATH=$PWD python tools/bench_router.py [--replicas 4] [--groups 16] [--group-size 4] [--seed 0]

The trace: ``groups`` prompts x ``group-size`` agent episodes each (GRPO groups: an episode's first prompt is
its group's task prompt after one shared system prompt); an episode alternates model turns (40-200 decoded
tokens) and tool observations (50-400 tokens) for 3-8 turns, each turn's prompt being the whole context so
far; episodes advance interleaved in a seeded random order, as asynchronous environments return. Each
replica's prefix cache holds every block-aligned prefix it prefilled (no eviction); a prefix counts up to
its last KDA checkpoint boundary (``--interval`` tokens). Prints prompt tokens prefilled and max/mean load
(cost = prefill + decode tokens) per policy, and the ratios against round-robin measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megak3.inference.router import POLICIES, Router  # noqa: E402


def agent_trace(groups: int, group_size: int, seed: int) -> list:
    """[(prompt tokens, decode tokens)] in arrival order."""
    rng = random.Random(seed)
    fresh = iter(range(10 ** 9))
    system = [next(fresh) for _ in range(300)]
    episodes = []
    for _ in range(groups):
        task = system + [next(fresh) for _ in range(rng.randint(200, 600))]
        for _ in range(group_size):
            episodes.append({"ctx": list(task), "turns": rng.randint(3, 8)})
    out, live = [], list(range(len(episodes)))
    while live:
        e = episodes[rng.choice(live)]
        dec = rng.randint(40, 200)
        out.append((list(e["ctx"]), dec))
        e["ctx"] += [next(fresh) for _ in range(dec)] + [next(fresh) for _ in range(rng.randint(50, 400))]
        e["turns"] -= 1
        live = [i for i in live if episodes[i]["turns"] > 0]
    return out


def run(trace, replicas: int, interval: int, policy: str, ratio: float) -> Router:
    router = Router(replicas, interval, ratio, policy)
    for prompt, dec in trace:
        router.route(prompt, dec)
    return router


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--interval", type=int, default=64, help="KDA checkpoint interval (tokens)")
    ap.add_argument("--max-load-ratio", type=float, default=1.25)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    trace = agent_trace(a.groups, a.group_size, a.seed)
    res = {p: run(trace, a.replicas, a.interval, p, a.max_load_ratio) for p in POLICIES}
    base = res["round_robin"].prefill_tokens
    total = sum(len(p) for p, _ in trace)
    print(f"agent trace: {len(trace)} requests, {total} prompt tokens, {a.replicas} replicas, "
          f"checkpoint interval {a.interval}")
    for p, r in res.items():
        print(f"{p:>13}: prefill {r.prefill_tokens:>8} tokens ({r.prefill_tokens / base:.3f}x round-robin), "
              f"max/mean load {r.balance():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
