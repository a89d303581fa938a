"""Resumable RL with the batch generated ahead (rl.rollout.lag=1) and with engines on ranks of their own
(rl.rollout.placement=separate): stop after the save at version 1, resume = the uninterrupted run over 3 updates
(the same uids and losses, bit-identical weights), as tests/test_rl_checkpoint.py asserts at lag 0.

- colocated, lag 1, one process: the child is killed with SIGKILL right after the save at version 1;
- separate, gloo (one world of 3 ranks): a dp2 trainer + one engine rank at lag 1, and a one-rank trainer + two
  tp1 engine replicas at lag 0 (the engine state travels through both engine ranks; the router of two replicas
  is restored); the runner is dropped after the save at version 1 and a new one resumes in the same processes.

The control: without the batch generated ahead (the restore loses it) the resumed run trains other samples.
Also: a kill -9 while the batch ahead is generated before the first save loses no finished sample, and a buffer
file the engine ranks refuse is refused on every rank (one line, nobody left waiting in a collective).
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.testing import run_distributed
from tests.test_rl_trainer_layouts import _layout_job, tok_path  # noqa: F401  (the module fixture)

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------ colocated, lag 1
def make_runner(cache):
    from megak3.posttrain.engines import RolloutConfig
    from test_rl_checkpoint import make_runner as base

    return base(cache, rollout=RolloutConfig(lag=1), reward="tests.test_rl_placement:token_reward")


def child(run_dir, cache):
    """Runs until the checkpoint of version 1 is committed, then kills itself with SIGKILL."""
    from test_rl_checkpoint import child as run_until_saved

    run_until_saved(run_dir, cache, make_runner)


@pytest.fixture(scope="module")
def straight_lag1(tmp_path_factory):
    from test_rl_checkpoint import uninterrupted

    return uninterrupted(tmp_path_factory.mktemp("rllag"), make_runner)


def _killed_at_1(root, run):
    from test_rl_checkpoint import _run_child

    p = _run_child(run, root / "cache", "test_rl_lag_resume")
    assert p.returncode == -signal.SIGKILL and "saved 1 pending True" in p.stdout, p.stderr[-2000:]


def test_lag1_kill9_after_a_save_resumes_exactly(straight_lag1, tmp_path):
    root, hist, weights = straight_lag1
    assert len(hist) == 3 and len({h["loss"] for h in hist}) == 3
    _killed_at_1(root, tmp_path / "run")
    runner = make_runner(root / "cache")
    assert runner.resumable(tmp_path / "run") and runner.version == 1 and runner._pending is not None
    runner.fit(log=None)
    assert [h["uids"] for h in runner.history] == [h["uids"] for h in hist]
    assert [h["loss"] for h in runner.history] == [h["loss"] for h in hist]
    for k, v in runner.model.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_lag1_control_without_the_batch_ahead_differs(straight_lag1, tmp_path, monkeypatch):
    """The negative control: a restore that drops the batch generated ahead trains other samples."""
    import megak3.posttrain.checkpoint as ck

    root, hist, weights = straight_lag1
    _killed_at_1(root, tmp_path / "run")
    monkeypatch.setattr(ck, "load_batch", lambda state: None)
    runner = make_runner(root / "cache")
    assert runner.resumable(tmp_path / "run") and runner._pending is None
    runner.fit(log=None)
    assert [h["uids"] for h in runner.history][1:] != [h["uids"] for h in hist][1:]
    assert not all(torch.equal(v, weights[k]) for k, v in runner.model.state_dict().items())


def _make_partial(cache):
    runner = make_runner(cache)
    runner.rl.partial_fraction = 0.5
    return runner


def child_mid(run_dir, cache, kill_after):
    """Partial rollouts at lag 1, killed with SIGKILL the moment the kill_after-th sample finished."""
    from test_rl_resume import child as run_until_finished

    run_until_finished(run_dir, cache, kill_after, _make_partial)


def test_lag1_kill9_mid_generation_loses_no_finished_sample(tmp_path):
    """Killed while the batch ahead is generated before the first update (no checkpoint yet: the buffer file
    holds the first batch), resumed: every sample finished before the kill is trained on or still waits."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_rl_lag_resume as t; "
            f"t.child_mid({str(run)!r}, {str(cache)!r}, 4)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    before = {int(l.split()[1]) for l in p.stdout.splitlines() if l.startswith("finished ")}
    assert len(before) == 4 and not list(run.glob("checkpoints/step_*"))  # killed before the first save
    runner = make_runner(cache)
    runner.rl.partial_fraction = 0.5
    assert runner.resumable(run) and runner.version == 0 and runner._pending is not None
    waiting = {r.uid for g in runner._pending[1] for r in g} | {r.uid for r in runner.buffer.rollouts.values()
                                                                 if r.finished}
    assert before <= waiting, (before, waiting)
    runner.fit(log=None)
    trained = [u for h in runner.history for u in h.get("uids", [])]
    assert before <= set(trained) | {r.uid for r in runner.buffer.rollouts.values()}
    assert len(trained) == len(set(trained))  # none trained twice
    assert runner.version == 3


# ---------------------------------------------------------------------------------- separate, gloo
CASES = [  # trainer ranks, trainer layout, engine layout, lag
    (2, {}, {"tp": 1, "replicas": 1}, 1),
    (1, {}, {"tp": 1, "replicas": 2}, 0),
]


def _separate(rank, world, trainers, trainer, engine, lag, tok_path, run_dir):
    import torch.distributed as dist

    from megak3.data.tokenizer import load_tokenizer
    from megak3.posttrain.engines import RolloutConfig
    from megak3.posttrain.placement import init_rl_parallel
    from megak3.posttrain.rl import RLConfig, RLRunner

    torch.set_num_threads(1)
    job = _layout_job(trainers, **trainer)
    rl = RLConfig(iterations=3, prompts=2, group_size=2, max_tokens=4, micro_batch_size=2,
                  reward="tests.test_rl_placement:token_reward",
                  rollout=RolloutConfig(placement="separate", lag=lag, **engine))
    ps = init_rl_parallel(job, rl)

    def runner():
        return RLRunner(job, rl, load_tokenizer(tok_path), ps=ps,
                        engine_options={"page_size": 8, "num_pages": 64, "prefill_chunk": 8})

    def outcome(r):
        m = r.model if r.model is not None else r.engine.model
        return {"uids": [h.get("uids") for h in r.history], "loss": [h.get("loss") for h in r.history],
                "weights": {k: v.clone() for k, v in m.state_dict().items()},
                "routing": None if r.sampler is None else r.sampler.state_dict()}

    a = runner()
    a.resumable(os.path.join(run_dir, "straight"))
    a.fit(log=None)
    straight = outcome(a)
    del a
    b = runner()
    assert not b.resumable(os.path.join(run_dir, "cut"))
    b.iteration()  # version 1, saved
    assert b.version == 1
    del b
    c = runner()
    restored = c.resumable(os.path.join(run_dir, "cut"))
    at, pending = c.version, c._pending is not None
    c.fit(log=None)
    resumed = outcome(c)
    same_weights = all(torch.equal(v, resumed["weights"][k]) for k, v in straight["weights"].items())
    refused = ""
    if lag == 1:  # a buffer file that is not JSON (read by the engine ranks): every rank raises its one line
        dist.barrier()
        if rank == 0:
            with open(os.path.join(run_dir, "cut", "rl_buffer.json"), "wb") as f:
                f.write(b"\x80\x04not json")
        dist.barrier()
        try:
            runner().resumable(os.path.join(run_dir, "cut"))
        except ValueError as e:
            refused = str(e)
    return {"refused": refused, "trainer": c.model is not None, "restored": restored, "at": at, "pending": pending,
            "uids": (straight["uids"], resumed["uids"]), "loss": (straight["loss"], resumed["loss"]),
            "same_weights": same_weights, "routing": (straight["routing"], resumed["routing"])}


def _cases(rank, world, tok_path, run_dir):
    return [_separate(rank, world, t, tr, en, lag, tok_path, os.path.join(run_dir, str(i)))
            for i, (t, tr, en, lag) in enumerate(CASES)]


@pytest.fixture(scope="module")
def separate(tok_path, tmp_path_factory):  # noqa: F811
    return run_distributed(_cases, 3, tok_path, str(tmp_path_factory.mktemp("rlsep")), timeout_s=600)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_separate_resumes_exactly(case, separate):
    trainers, _, _, lag = CASES[case]
    for rank, r in enumerate(res[case] for res in separate):
        assert r["trainer"] == (rank < trainers)
        assert r["restored"] and r["at"] == 1 and r["pending"] == (lag == 1), r
        (u1, u2), (l1, l2) = r["uids"], r["loss"]
        assert len(u1) == 3 and u1 == u2, (rank, u1, u2)
        if r["trainer"]:
            assert len(set(l1)) == 3 and l1 == l2, (rank, l1, l2)
        else:
            assert r["routing"][0] == r["routing"][1] and r["routing"][1]["placed"], rank
        assert r["same_weights"], f"rank {rank}: weights differ"
    if lag == 1:  # the engine ranks' refusal of the buffer file reached the trainer ranks
        assert all("rollout buffer is not JSON" in res[case]["refused"] for res in separate), separate
    if CASES[case][2]["replicas"] == 2:  # both replicas were used, so the restored router decided something
        placed = separate[-1][case]["routing"][1]["placed"]
        assert {k for _, k in placed} == {0, 1}, placed


def test_cli_keeps_a_lag1_run(straight_lag1, tmp_path, capsys):
    """python -m megak3.posttrain with rl.rollout.lag=1 and train.run_dir: saved, and resumed by a rerun."""
    from megak3.posttrain.__main__ import main

    run = straight_lag1[0] / "run"
    common = ["--init-from", str(run), "--eval-prompts", "2", "--threads", "1", "rl.iterations=2", "rl.prompts=2",
              "rl.group_size=2", "rl.max_tokens=4", "rl.rollout.lag=1", f"train.run_dir={tmp_path / 'a'}"]
    assert main(common) == 0
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("step_*")) == ["step_00000002"]
    assert main(common + ["rl.iterations=3", "train.resume=auto"]) == 0  # one more update, from version 2
    assert "resumed at version 2" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("step_*")) == ["step_00000002",
                                                                                     "step_00000003"]
