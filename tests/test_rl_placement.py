"""Rollout engines on ranks of their own (rl.rollout.placement=separate) equal one-process RL (gloo ranks).

One world of 3 ranks runs four separate placements in turn: a tp2 trainer + one tp1 engine rank at lag 0, a
dp2 trainer + one engine rank at lag 1, a one-rank trainer + two tp1 engine replicas at lag 0, and a pp2 (1f1b)
trainer + one engine rank at lag 1. Each is
compared over 3 updates with the one-process colocated run at the same lag: the same samples (uids, token ids,
the versions that sampled them; behaviour logprobs <= 1e-5), loss and grad norm <= 1e-4; at lag 0 the engine's
logprobs equal the trainer's forward after every refit (lp_gap <= 1e-5), at lag 1 every trained token of
batch k >= 1 is exactly one version stale; every engine rank received its shard bytes by message, the trainer
ranks none. The control: lag 0 and lag 1 differ by more than the tolerances, so the comparison can fail.
"""
import functools

import pytest
import torch

from parallel.testing import run_distributed
from tests.test_rl_trainer_layouts import _layout_job, tok_path  # noqa: F401  (the module fixture)

CASES = [  # trainer ranks, trainer layout, engine layout, lag
    (2, {"tp": 2}, {"tp": 1, "replicas": 1}, 0),
    (2, {}, {"tp": 1, "replicas": 1}, 1),
    (1, {}, {"tp": 1, "replicas": 2}, 0),
    (2, {"pp": 2}, {"tp": 1, "replicas": 1}, 1),
]


def token_reward(prompts, completions, metadata):
    """The test's reward (rl.reward): the share of even token ids in the response, so groups have advantages."""
    return [sum(t % 2 == 0 for t in m["token_ids"]) / max(len(m["token_ids"]), 1) for m in metadata]


def _run(rank, world, trainers, trainer, engine, lag, tok_path):
    from megak3.data.tokenizer import load_tokenizer
    from megak3.posttrain.engines import RolloutConfig
    from megak3.posttrain.placement import init_rl_parallel
    from megak3.posttrain.rl import RLConfig, RLRunner

    torch.set_num_threads(1)
    job = _layout_job(trainers, **trainer)
    placement = "separate" if world > trainers else "colocated"
    rl = RLConfig(iterations=3, prompts=2, group_size=2, max_tokens=4, micro_batch_size=2,
                  reward="tests.test_rl_placement:token_reward",
                  rollout=RolloutConfig(placement=placement, lag=lag, **engine))
    ps = init_rl_parallel(job, rl)
    runner = RLRunner(job, rl, load_tokenizer(tok_path), ps=ps,
                      engine_options={"page_size": 8, "num_pages": 64, "prefill_chunk": 8})
    seen, update = [], runner.update

    def recorded(samples, adv):
        seen.append({"version": runner.version, "samples": [(s.uid, list(s.token_ids), list(s.versions))
                                                             for s in samples],
                     "logprobs": [lp for s in samples for lp in s.logprobs]})
        return update(samples, adv)

    runner.update = recorded
    hist = runner.fit(log=None)
    return {"trainer": runner.model is not None, "engine": runner.engine is not None, "seen": seen,
            "steps": [(h["loss"], h["grad_norm"], h["lp_gap"]) for h in hist if "loss" in h],
            "refit_bytes": [h["refit_bytes"] for h in hist], "shard": runner.last_refit["shard_bytes"],
            "remote": runner.last_refit["bytes_remote"]}


def _cases(rank, world, tok_path):
    return [_run(rank, world, t, tr, en, lag, tok_path) for t, tr, en, lag in CASES]


@functools.lru_cache(maxsize=None)
def _one_process(lag, tok_path):
    return _run(0, 1, 1, {}, {}, lag, tok_path)


def _differences(ref, got) -> list:
    """What differs between a reference run and a trainer rank's run beyond the tolerances."""
    out = []
    for i, (a, b) in enumerate(zip(ref["seen"], got["seen"])):
        if a["samples"] != b["samples"]:
            out.append(f"update {i}: samples (uid, tokens, versions) differ")
        if max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) > 1e-5:
            out.append(f"update {i}: behaviour logprobs differ")
    for i, ((l1, g1, _), (l2, g2, _)) in enumerate(zip(ref["steps"], got["steps"])):
        if abs(l1 - l2) > 1e-4 or abs(g1 - g2) > 1e-4:
            out.append(f"update {i}: loss {l1} vs {l2}, grad norm {g1} vs {g2}")
    if len(ref["seen"]) != len(got["seen"]) or len(ref["steps"]) != len(got["steps"]):
        out.append("a different number of updates")
    return out


@pytest.fixture(scope="module")
def separate(tok_path):  # noqa: F811
    return run_distributed(_cases, 3, tok_path, timeout_s=600)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_separate_placement_equals_one_process_rl(case, separate, tok_path):  # noqa: F811
    trainers, _, engine, lag = CASES[case]
    ref = _one_process(lag, tok_path)
    assert len(ref["steps"]) == 3 and ref["steps"][0][0] != ref["steps"][2][0]  # three updates; the policy moved
    ranks = [r[case] for r in separate]
    assert [r["trainer"] for r in ranks] == [i < trainers for i in range(3)]
    assert [r["engine"] for r in ranks] == [i >= trainers for i in range(3)]
    for r in ranks:
        if r["trainer"]:
            assert _differences(ref, r) == [], _differences(ref, r)
            assert all(b == 0 for b in r["refit_bytes"]) and r["shard"] == 0
            staleness = [{v["version"] - x for _, _, vs in v["samples"] for x in vs} for v in r["seen"]]
            assert staleness == ([{0}] * 3 if lag == 0 else [{0}, {1}, {1}]), staleness
            if lag == 0:  # engine logprobs vs the trainer's forward right after every refit
                assert all(gap <= 1e-5 for _, _, gap in r["steps"]), r["steps"]
        else:  # the engine rank's refit: its shard bytes, every byte by message, each update
            print(f"case {case}: engine rank refit {r['refit_bytes']} bytes, shard {r['shard']} bytes")
            assert r["shard"] > 0 and r["refit_bytes"] == [r["shard"]] * 3 and r["remote"] == r["shard"]
            assert r["seen"] == [] and r["steps"] == []


def test_lag_control_differs(tok_path):  # noqa: F811
    """The negative control: the lag-1 run is not the lag-0 run (batch 0 is, later batches are not)."""
    lag0, lag1 = _one_process(0, tok_path), _one_process(1, tok_path)
    diff = _differences(lag0, lag1)
    assert diff and not any(d.startswith("update 0") for d in diff), diff
    assert any("loss" in d for d in diff) and any("logprobs" in d for d in diff), diff


@pytest.mark.parametrize("over,msg", [
    (["rl.rollout.placement=separate"], "error: rl.rollout.placement=separate needs ranks of its own"),
    (["rl.rollout.lag=2"], "error: rl.rollout.lag=2 must be 0"),
    (["rl.rollout.placement=apart"], "error: rl.rollout.placement='apart' must be one of colocated, separate"),
    (["rl.rollout.placement=separate", "rl.env=ledger"], "error: rl.env=ledger with rl.rollout.placement=separate"),
    (["rl.rollout.lag=1", "rl.env=ledger"], "error: rl.env=ledger with rl.rollout.lag=1"),
])
def test_bad_placement_is_one_line_exit_2(over, msg, capsys, tmp_path):
    """Refused before the checkpoint is read (it does not exist here), one line, exit code 2."""
    from megak3.posttrain.__main__ import main

    assert main(["--init-from", str(tmp_path / "none"), *over]) == 2
    err = capsys.readouterr().err
    assert err.startswith(msg) and err.count("\n") == 1, err


def test_separate_layout_errors_name_the_field():
    from megak3.posttrain.engines import RolloutConfig

    par = _layout_job(1).parallel
    assert RolloutConfig(placement="separate", tp=1).resolve(par, 3).trainer_ranks(3) == 2  # one replica by default
    assert RolloutConfig(placement="separate", tp=1, replicas=2).resolve(par, 3).engine_offset(3) == 1
    for cfg, msg in ((RolloutConfig(placement="separate", tp=1, replicas=3), "rl.rollout.replicas=3 x 1 ranks each"),
                     (RolloutConfig(placement="separate", tp=2), "rl.rollout.tp=2 x rl.rollout.ep=1 needs 2 ranks")):
        with pytest.raises(ValueError) as e:
            cfg.resolve(par, 2)
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)
