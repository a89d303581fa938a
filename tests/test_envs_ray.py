"""The pool on Ray (a local Ray instance on loopback): same results as the process pool, and a
killed worker's episodes move to another worker from their last snapshots."""
import os
import signal

import pytest

ray = pytest.importorskip("ray")

from megak3.envs import EnvPool, ToolCall  # noqa: E402

SCRIPT = [
    ToolCall("list_dir", {"path": "data"}),
    ToolCall("shell", {"cmd": "cat data/*/*.csv | wc -l; echo x > scratch.txt"}),
    "<tool_call>{malformed",
    ToolCall("python", {"code": "import glob; print(sorted(glob.glob('/work/data/*/*.csv')))"}),
    ToolCall("write_file", {"path": "out/answer.txt", "content": "42"}),
    ToolCall("submit", {"answer": "42"}),
]
EPISODES = {f"ep{i}": {"family": "ledger", "seed": i} for i in range(3)}


def run(pool, kill_after=None):
    """Every episode through SCRIPT in lock-step; optionally SIGKILL ep0's worker after step ``kill_after``."""
    out = {eid: [pool.reset(eid, t)] for eid, t in EPISODES.items()}
    for i, action in enumerate(SCRIPT):
        if i == kill_after:
            os.kill(pool.worker_pid("ep0"), signal.SIGKILL)
        for eid, r in pool.step_batch({eid: action for eid in EPISODES}).items():
            out[eid].append((r.observation, r.done, r.reward))
    return out, {eid: (pool.digest(eid, mtimes=False), pool.state(eid)) for eid in EPISODES}


@pytest.fixture(scope="module")
def ray_session():
    from megak3.envs.ray_backend import ensure_ray
    ensure_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_ray_pool_matches_process_pool_and_recovers(ray_session):
    with EnvPool(2, backend="process") as p:
        ref = run(p)
    with EnvPool(2, backend="ray") as r:
        assert r.isolation.startswith("megak3.envs isolation: ")
        assert run(r) == ref
        for eid in EPISODES:
            r.close(eid)
        moved = run(r, kill_after=3)                                  # an actor process dies mid-episode
        assert moved == ref
        assert len(r.events) == 1 and "ep0" in r.events[0].moved
        assert all(w != r.events[0].worker for w in r.events[0].moved.values())
