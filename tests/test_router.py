"""Cache-affine routing (megak3/inference/router.py): KDA-aware prefix hits by hand, session and group
affinity, the load guard, and the agent-trace bench's targets (prefill <= 0.5x round-robin at max/mean load
<= 1.25 with 4 replicas)."""
import sys
from pathlib import Path

import pytest

from megak3.inference.router import PrefixIndex, Router


def test_prefix_counts_only_to_the_last_checkpointed_boundary():
    idx = PrefixIndex(64)
    idx.insert(list(range(150)))  # blocks [0, 64) and [64, 128) checkpointed; 22 tokens past the last boundary
    assert idx.match(list(range(150))) == 128
    assert idx.match(list(range(300))) == 128
    assert idx.match(list(range(100))) == 64
    assert idx.match([7] + list(range(1, 300))) == 0  # differs in the first block


def test_a_session_returns_to_its_replica_and_the_guard_diverts_when_it_is_overloaded():
    r = Router(4, 16, max_load_ratio=1.25)
    for s in range(4):  # four sessions spread over the four replicas (first requests go to the least loaded)
        assert r.route([1000 * s + i for i in range(64)], 8) == s
    turn2 = [2000 + i for i in range(64)] + [9] * 32  # session 2's next turn extends its context
    assert r.route(turn2, 8) == 2
    assert r.prefill_tokens == 4 * 64 + 32
    r.load[2] += 10_000  # replica 2 is now far above the mean: the guard sends session 2 elsewhere
    assert r.route(turn2 + [5] * 16, 8) != 2


def test_round_robin_and_least_loaded_baselines():
    rr = Router(3, 16, policy="round_robin")
    assert [rr.route([i] * 16) for i in range(5)] == [0, 1, 2, 0, 1]
    ll = Router(2, 16, policy="least_loaded")
    ll.load = [5.0, 1.0]
    assert ll.route([1] * 16) == 1
    with pytest.raises(ValueError, match="policy="):
        Router(2, 16, policy="random")


def test_agent_trace_bench_meets_its_targets(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_router

    trace = bench_router.agent_trace(16, 4, 0)
    res = {p: bench_router.run(trace, 4, 64, p, 1.25) for p in ("affine", "round_robin", "least_loaded")}
    assert res["affine"].prefill_tokens <= 0.5 * res["round_robin"].prefill_tokens
    assert res["affine"].balance() <= 1.25
    assert res["least_loaded"].prefill_tokens > 0.9 * res["round_robin"].prefill_tokens  # no affinity, no gain


def test_rl_replicas_place_groups_once_and_by_prefix():
    from megak3.posttrain.buffer import RolloutBuffer
    from megak3.posttrain.engines import ReplicaRollouts

    buf = RolloutBuffer(2)
    long_ctx = list(range(100, 164))  # one checkpointed block of 64
    for p in ([1] * 64, [2] * 64, [3] * 64, [4] * 64, long_ctx + [7], long_ctx + [8]):
        buf.add_prompt(p, 4)
    rr = ReplicaRollouts(None, 0, 4, leader=True, sync=True, checkpoint_interval=64, max_load_ratio=4.0)
    rr.place(buf.unfinished())
    placed = dict(rr.placed)
    assert sorted(placed[g] for g in range(4)) == [0, 1, 2, 3]  # four fresh prompts spread over four replicas
    assert placed[5] == placed[4]  # the group sharing group 4's checkpointed prefix follows it
    rr.place(buf.unfinished())  # already placed: nothing moves
    assert rr.placed == placed
    guarded = ReplicaRollouts(None, 0, 4, leader=True, sync=True, checkpoint_interval=64)  # max/mean 1.25
    guarded.place(buf.unfinished())
    assert guarded.placed[5] != guarded.placed[4]  # that replica already holds 2x the mean: the guard diverts
