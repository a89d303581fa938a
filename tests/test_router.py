"""Cache-affine routing (megak3/inference/router.py): KDA-aware prefix matching, stickiness of sessions
and GRPO groups, the load guard, bad input, and tools/bench_router.py's targets on a small trace."""
import subprocess
import sys
from pathlib import Path

import pytest

from megak3.inference.cache import chain_hashes
from megak3.inference.router import PrefixModel, Router, boundary_hashes
from megak3.inference.types import InferenceError

ROOT = Path(__file__).resolve().parents[1]


def test_boundary_hashes_are_the_engines_chain_at_interval_blocks():
    ids = list(range(7, 7 + 1300))
    assert boundary_hashes(ids, 64, b"img") == chain_hashes(ids, 64, b"img")
    assert boundary_hashes(ids, 64) != boundary_hashes(ids, 64, b"img")       # images salt the chain


def test_match_counts_whole_checkpoint_intervals_only():
    m = PrefixModel(interval=16, capacity_tokens=10_000)
    ids = list(range(100))
    m.insert(boundary_hashes(ids, 16))                       # 6 boundaries: 96 tokens
    assert m.match(boundary_hashes(ids, 16)) == 96
    assert m.match(boundary_hashes(ids[:40], 16)) == 32      # a shorter prompt: its own deepest boundary
    other = ids[:20] + [999] + ids[21:]                      # differs inside the second interval
    assert m.match(boundary_hashes(other, 16)) == 16
    r = Router(1, checkpoint_interval=16)
    r.route(ids[:33])                                        # the last prompt token is always computed:
    assert r.models[0].match(boundary_hashes(ids, 16)) == 32  # 32 cached from a 33-token prompt, not 33


def test_lru_evicts_leaves_first_and_respects_capacity():
    m = PrefixModel(interval=10, capacity_tokens=50)
    a, b = list(range(30)), list(range(100, 130))
    m.insert(boundary_hashes(a, 10))
    m.insert(boundary_hashes(b, 10))                         # 6 boundaries > 5: the oldest leaf of a goes
    assert m.tokens == 50
    assert m.match(boundary_hashes(a, 10)) == 20 and m.match(boundary_hashes(b, 10)) == 30


def _session_turns(rng, n_turns, start):
    ctx = list(start)
    for _ in range(n_turns):
        ctx = ctx + [rng.randrange(4, 10_000) for _ in range(rng.randrange(50, 300))]
        yield list(ctx)
        ctx = ctx + [rng.randrange(4, 10_000) for _ in range(32)]


def test_sessions_return_to_their_replica_and_groups_stay_together():
    import random

    rng = random.Random(0)
    r = Router(4, checkpoint_interval=64, capacity_tokens=1 << 20, balance=1.5)
    homes = {}
    sessions = [list(_session_turns(random.Random(s), 5, [1, 2, 3])) for s in range(8)]
    for t in range(5):
        for s, turns in enumerate(sessions):
            k = r.route(turns[t], max_new=32)
            r.done(r.last_ticket, turns[t] + [5] * 32)
            if t == 0:
                homes[s] = k
            else:
                assert k == homes[s], (s, t)
    assert len(set(homes.values())) == 4                     # new sessions spread over the replicas
    prompt = [rng.randrange(4, 10_000) for _ in range(500)]
    group = [r.route(prompt, max_new=16) for _ in range(8)]  # a GRPO group: one prefill, seven hits
    assert len(set(group)) == 1


def test_load_guard_moves_work_off_an_overloaded_replica():
    r = Router(2, checkpoint_interval=64, capacity_tokens=1 << 20, balance=1.1, slack_tokens=0)
    hot = list(range(4, 4 + 2048))
    k0 = r.route(hot, max_new=50_000)                        # replica k0 holds the prefix and a long decode
    k1 = r.route(hot + [7] * 64, max_new=16)                 # best prefix on k0, but k0 is over the guard
    assert k1 == 1 - k0 and r.stats.fallbacks == 1
    r.done(1, hot + [9] * 100)
    r.done(2)
    assert r.load == [0, 0]                                  # done() takes each request's work back
    rr = Router(3, policy="round_robin")
    assert [rr.route([1, 2, 3]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("kw, field", [({"num_replicas": 0}, "num_replicas"), ({"policy": "random"}, "policy"),
                                       ({"balance": 0.5}, "balance"), ({"checkpoint_interval": 0}, "checkpoint_interval")])
def test_bad_router_settings_name_the_field(kw, field):
    args = {"num_replicas": 2, **kw}
    n = args.pop("num_replicas")
    with pytest.raises(InferenceError, match=f"router.{field}="):
        Router(n, **args)


def test_bench_router_meets_its_targets_small():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_router.py"), "--sessions", "16", "--turns", "6",
                          "12", "--capacity", "100000"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK"), out.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_router.py"), "--replicas", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_down_replicas_are_skipped_and_restart_cold():
    r = Router(3, checkpoint_interval=16, balance=100.0)
    s = list(range(50))
    k = r.route(s, max_new=4)
    r.done(r.last_ticket, s + [1, 2, 3, 4])
    assert r.route(s + [1, 2, 3, 4, 5], max_new=4) == k        # the session sticks
    r.done(r.last_ticket)
    r.set_up(k, False)
    got = [r.route(s, max_new=4) for _ in range(6)]
    assert k not in got and r.models[k].tokens == 0             # skipped, its cache model emptied
    for t in list(r.pending):
        r.done(t)
    r.set_up(k, True)
    assert r.route([7] * 40, max_new=1, replica=k) == k          # a group's later copy follows its first
    r.cached(k, s)                                              # another output of that group, recorded
    assert r.models[k].match(r._hashes(s + [0], b"")) == 48
    for j in range(3):
        r.set_up(j, False)
    with pytest.raises(RuntimeError, match="no engine replica is up"):
        r.route(s)
    rr = Router(3, policy="round_robin")
    rr.set_up(1, False)
    assert [rr.route([1, 2]) for _ in range(4)] == [0, 2, 0, 2]
