"""Cache-affine routing vs round-robin vs least-loaded on a multi-turn agent trace, in one run.

    python tools/bench_router.py                         # 4 replicas, 48 sessions (a few seconds)
    python tools/bench_router.py --replicas 8 --sessions 96 --capacity 200000

The trace: ``--sessions`` agent sessions share a ``--system``-token system prompt; each runs a random
number of turns (``--turns`` range), every turn appending a tool observation (log-uniform length in
``--obs``) and a ``--reply``-token model reply to its context, then sends the whole context again. A
session issues its next turn when the previous one has finished plus a random think time; sessions
start staggered. Replicas are simulated with continuous batching (processor sharing of ``--rate``
tokens per tick over the requests they run), and each replica's prefix cache is modelled at KDA
checkpoint granularity (``--interval``, K3's 512) with LRU eviction at ``--capacity`` tokens
(megak3.inference.router.PrefixModel) — the cache a replica really holds, updated as requests
finish, separate from the router's own view. A request's prefill is its prompt minus what the
replica's cache restores; work = prefill + decode tokens.

Printed per policy: prompt tokens prefilled, hit rate, max/mean work per replica, the makespan and
the mean turn latency in ticks. The last lines check the targets: affinity's prefill <= 0.5 x
round-robin's, at max/mean work <= 1.25.
"""
import argparse
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megak3.cli import Parser, error_exit  # noqa: E402
from megak3.inference.router import POLICIES, PrefixModel, Router, boundary_hashes  # noqa: E402
from megak3.inference.types import InferenceError  # noqa: E402


def make_sessions(args):
    rnd = random.Random(args.seed)
    system = [rnd.randrange(4, 1 << 20) for _ in range(args.system)]
    lo, hi = args.obs
    out = []
    for s in range(args.sessions):
        turns = rnd.randint(*args.turns)
        obs = [int(math.exp(rnd.uniform(math.log(lo), math.log(hi)))) for _ in range(turns)]
        out.append({"turns": turns, "obs": obs, "start": rnd.uniform(0, args.stagger),
                    "think": [rnd.uniform(0, args.think) for _ in range(turns)],
                    "tokens": [[rnd.randrange(4, 1 << 20) for _ in range(n)] for n in obs],
                    "replies": [[rnd.randrange(4, 1 << 20) for _ in range(args.reply)] for _ in range(turns)],
                    "system": system})
    return out


def simulate(args, sessions, policy: str) -> dict:
    router = Router(args.replicas, checkpoint_interval=args.interval, capacity_tokens=args.capacity, policy=policy,
                    balance=args.balance)
    caches = [PrefixModel(args.interval, args.capacity) for _ in range(args.replicas)]
    ctx = [list(s["system"]) for s in sessions]
    turn = [0] * len(sessions)
    ready = [s["start"] for s in sessions]                  # when each session sends its next turn
    running = [[] for _ in range(args.replicas)]            # [session, ticket, work left, issued at, prompt len]
    prefill = prompt = 0
    work = [0] * args.replicas
    latencies, t, done_sessions = [], 0.0, 0
    while done_sessions < len(sessions):
        for s, sess in enumerate(sessions):                 # issue every turn that is due
            if turn[s] < sess["turns"] and ready[s] is not None and ready[s] <= t:
                ctx[s] += sess["tokens"][turn[s]]
                k = router.route(ctx[s], max_new=args.reply)
                hashes = boundary_hashes(ctx[s][:-1], args.interval)
                need = len(ctx[s]) - caches[k].match(hashes)
                caches[k].insert(hashes)
                prefill += need
                prompt += len(ctx[s])
                work[k] += need + args.reply
                running[k].append([s, router.last_ticket, need + args.reply, t])
                ready[s] = None
        for k in range(args.replicas):                      # one tick of processor sharing per replica
            budget = args.rate
            while budget > 1e-9 and running[k]:
                share = budget / len(running[k])
                budget = 0.0
                for req in list(running[k]):
                    used = min(share, req[2])
                    req[2] -= used
                    budget += share - used
                    if req[2] <= 1e-9:
                        running[k].remove(req)
                        s = req[0]
                        ctx[s] += sessions[s]["replies"][turn[s]]
                        router.done(req[1], ctx[s])
                        caches[k].insert(boundary_hashes(ctx[s][:-1], args.interval))
                        latencies.append(t + 1 - req[3])
                        turn[s] += 1
                        if turn[s] == sessions[s]["turns"]:
                            done_sessions += 1
                        else:
                            ready[s] = t + 1 + sessions[s]["think"][turn[s]]
        t += 1
    mean = sum(work) / len(work)
    return {"prefill": prefill, "prompt": prompt, "hit": 1 - prefill / prompt, "imbalance": max(work) / mean,
            "makespan": t, "latency": sum(latencies) / len(latencies), "fallbacks": router.stats.fallbacks,
            "work": work, "routed_work": list(router.stats.per_replica_work)}


def main(argv=None) -> int:
    ap = Parser(prog="bench_router.py", description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=48)
    ap.add_argument("--turns", type=int, nargs=2, default=(8, 24), metavar=("MIN", "MAX"))
    ap.add_argument("--system", type=int, default=4096, help="shared system-prompt tokens")
    ap.add_argument("--obs", type=int, nargs=2, default=(100, 3000), metavar=("MIN", "MAX"),
                    help="tool observation tokens per turn (log-uniform)")
    ap.add_argument("--reply", type=int, default=256)
    ap.add_argument("--interval", type=int, default=512, help="KDA checkpoint interval (tokens)")
    ap.add_argument("--capacity", type=int, default=300_000, help="prefix-cache tokens per replica")
    ap.add_argument("--rate", type=float, default=20_000, help="tokens per tick per replica")
    ap.add_argument("--think", type=float, default=3.0, help="max ticks between a reply and the next turn")
    ap.add_argument("--stagger", type=float, default=20.0, help="sessions start within this many ticks")
    ap.add_argument("--balance", type=float, default=1.1, help="affinity's load guard (x the mean work; Router's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        for name in ("replicas", "sessions", "system", "reply", "interval", "capacity"):
            if getattr(args, name) < 1:
                raise InferenceError(f"--{name}={getattr(args, name)} must be >= 1")
        if not 1 <= args.turns[0] <= args.turns[1] or not 1 <= args.obs[0] <= args.obs[1]:
            raise InferenceError("--turns and --obs take MIN MAX with 1 <= MIN <= MAX")
        if args.rate <= 0:
            raise InferenceError(f"--rate={args.rate} must be > 0")
        Router(args.replicas, checkpoint_interval=args.interval, capacity_tokens=args.capacity, balance=args.balance)
    except InferenceError as e:
        return error_exit(ap.prog, e)
    sessions = make_sessions(args)
    print(f"{args.replicas} replicas, {args.sessions} sessions, {sum(s['turns'] for s in sessions)} turns, "
          f"checkpoint interval {args.interval}, cache {args.capacity:,} tokens per replica")
    print(f"{'policy':<13} {'prefilled':>12} {'hit rate':>9} {'max/mean work':>14} {'makespan':>9} {'latency':>8}")
    res = {}
    for policy in ("round_robin", "least_loaded", "affinity"):
        r = res[policy] = simulate(args, sessions, policy)
        print(f"{policy:<13} {r['prefill']:>12,} {r['hit']:>9.3f} {r['imbalance']:>14.3f} {r['makespan']:>9} "
              f"{r['latency']:>8.2f}")
    ratio = res["affinity"]["prefill"] / res["round_robin"]["prefill"]
    ok = ratio <= 0.5 and res["affinity"]["imbalance"] <= 1.25
    print(f"affinity prefill / round-robin: {ratio:.3f} (target <= 0.5); affinity max/mean work "
          f"{res['affinity']['imbalance']:.3f} (target <= 1.25); {'OK' if ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    assert set(POLICIES) == {"affinity", "round_robin", "least_loaded"}
    sys.exit(main())
