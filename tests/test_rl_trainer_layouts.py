"""RL at the trainer layouts of pretraining, with rollout engines of their own layout (gloo ranks):
pp2 (1f1b), cp2, tp2+SP x pp2 and ep2 x tp2 trainers, each refit into two tp1 engine replicas or one tp2
engine, match one process over 3 updates on fixed rollouts (loss and grad norm <= 1e-4); after every refit
each engine rank received exactly its shard bytes, no file appeared, and the engine's greedy tokens and
logprobs equal the one-process trainer's forward (<= 1e-5, fp32). The full loop (generation, rewards,
update, refit) at pp2 with two engine replicas samples the same rollouts as one process."""
import functools
import os

import pytest
import torch

from parallel.testing import run_distributed
from tests.test_rl_layouts import Tok, _job
from tests.test_rl_parallel import _fixed_rollouts

PROMPTS = [[5, 17, 99, 250], [9, 8, 7]]

LAYOUTS = {  # world, trainer layout, engine layout
    "pp2-1f1b": (2, {"pp": 2}, {"tp": 1, "replicas": 2}),
    "cp2": (2, {"cp": 2}, {"tp": 2, "replicas": 1}),
    "tp2sp-pp2": (4, {"tp": 2, "sp": True, "pp": 2}, {"tp": 1, "replicas": 2}),
    "ep2-tp2": (4, {"tp": 2, "sp": True, "ep": 2}, {"tp": 2, "ep": 1, "replicas": 1}),
}


def _layout_job(world, tp=1, ep=1, sp=False, pp=1, cp=1, qat="none", **more):
    import dataclasses

    from megak3.quant.config import QuantConfig

    job = dataclasses.replace(_job(1), quant=QuantConfig(qat=qat))
    par = dataclasses.replace(job.parallel, tp=tp, ep=ep, sequence_parallel=sp, pp=pp, cp=cp, dp=0, **more)
    train = dataclasses.replace(job.train, global_batch_size=world)
    return dataclasses.replace(job, parallel=par, train=train).validate(world)


def _files(dirs):
    return {os.path.join(dp, f) for d in dirs for dp, _, fs in os.walk(d) for f in fs}


def _engine_logprobs(runner, ref_model=None):
    """Greedy tokens + engine logprobs (engine leader), and, with ``ref_model``, that model's forward
    logprobs of the same tokens."""
    from megak3.inference import SamplingParams
    from megak3.posttrain.objective import token_logprobs

    if runner.engine is None:
        return None
    gen = runner.engine.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    if runner.engine_ps.rank != 0:  # every rank of the replica decodes; its first reports
        return None
    out = [(o.token_ids, o.logprobs) for o in gen]
    if ref_model is not None:
        fwd = []
        for p, (tok, _) in zip(PROMPTS, out):
            ids = torch.tensor([p + tok[:-1]])
            with torch.no_grad():
                lg = ref_model(ids, return_logits=True).logits
            fwd.append(token_logprobs(lg, torch.tensor([p[1:] + tok]))[0, len(p) - 1:].tolist())
        out = [(t, lp, f) for (t, lp), f in zip(out, fwd)]
    return out


def _updates(rank, world, trainer, engine, run_dir):
    from megak3.posttrain.engines import RolloutConfig
    from megak3.posttrain.objective import LossConfig
    from megak3.posttrain.rl import RLConfig, RLRunner
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    os.chdir(run_dir)
    job = _layout_job(world, **trainer)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rl = RLConfig(iterations=3, micro_batch_size=2, loss=LossConfig(aggregation="token", kl_coef=0.05),
                  rollout=RolloutConfig(**engine))
    runner = RLRunner(job, rl, Tok(), ps=ps, engine_options={"page_size": 8, "num_pages": 16})
    samples, adv = _fixed_rollouts()
    out = {"steps": [], "refits": [], "gen": [], "new_files": set()}
    watch = [run_dir, os.environ["TMPDIR"]]
    for _ in range(3):
        rec = runner.update(samples, adv)
        runner.version += 1
        before = _files(watch)
        runner.refit()
        out["new_files"] |= _files(watch) - before
        out["steps"].append((rec["loss"], rec["grad_norm"]))
        out["refits"].append(dict(runner.last_refit))
        out["gen"].append(_engine_logprobs(runner, runner.model if world == 1 else None))
    out["pp_engine"] = runner.rs.engine is not None
    out["engine_qat"] = runner.engine is not None and any(
        getattr(m, "weight_quant", None) is not None for m in runner.engine.model.modules())
    return out


@functools.lru_cache(maxsize=None)
def _one_process(run_dir):
    return _updates(0, 1, {}, {}, run_dir)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "run").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the ranks inherit it: refit must write nothing there
    return tmp_path


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rl_trainer_layouts_match_one_process_and_refit_reshards(name, private_tmp):
    world, trainer, engine = LAYOUTS[name]
    ref = _one_process(str(private_tmp / "run"))
    ranks = run_distributed(_updates, world, trainer, engine, str(private_tmp / "run"), timeout_s=600)
    leaders = 0
    for r in ranks:
        assert r["pp_engine"] == ("pp" in trainer)
        for (l1, g1), (l2, g2) in zip(ref["steps"], r["steps"]):
            assert abs(l1 - l2) <= 1e-4 and abs(g1 - g2) <= 1e-4, (name, ref["steps"], r["steps"])
        for ref_gen, got, refit in zip(ref["gen"], r["gen"], r["refits"]):
            print(f"{name}: refit {refit['seconds']:.4f} s, {refit['bytes_in']} bytes received "
                  f"({refit['bytes_remote']} from other ranks), shard {refit['shard_bytes']} bytes")
            assert refit["bytes_in"] == refit["shard_bytes"]
            if got is None:
                continue
            leaders += 1
            for (t1, _, fwd), (t2, lp2) in zip(ref_gen, got):
                assert t1 == t2, (name, ref_gen, got)
                assert max(abs(a - b) for a, b in zip(fwd, lp2)) <= 1e-5, (name, fwd, lp2)
        assert not r["new_files"], r["new_files"]
    assert leaders == 3 * engine["replicas"]
    engines = [r for r in ranks if r["refits"][0]["shard_bytes"] > 0]
    assert len(engines) == engine["replicas"] * max(engine["tp"], engine.get("ep", 1))
    assert ref["steps"][0][0] != ref["steps"][2][0]  # the policy moved


@pytest.mark.parametrize("field,value,msg", [("tp", 3, "rl.rollout.tp=3 must divide"),
                                             ("replicas", 5, "rl.rollout.replicas=5 x 1 ranks each exceeds"),
                                             ("ep", -1, "rl.rollout.ep=-1 must be >= 0"),
                                             ("ep", 2, "rl.rollout.ep=2 with rl.rollout.tp=2")])
def test_rollout_layout_errors_are_one_line(field, value, msg):
    import dataclasses

    from megak3.posttrain.engines import RolloutConfig

    with pytest.raises(ValueError) as e:
        cfg = dataclasses.replace(RolloutConfig(tp=2 if (field, value) == ("ep", 2) else 0), **{field: value})
        cfg.resolve(_layout_job(2).parallel, 4, _job(1).model)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)


def _loop(rank, world, trainer, engine, tok_path):
    from megak3.data.tokenizer import load_tokenizer
    from megak3.posttrain.engines import RolloutConfig
    from megak3.posttrain.rl import RLConfig, RLRunner
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    job = _layout_job(world, **trainer)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rl = RLConfig(iterations=3, prompts=2, group_size=2, max_tokens=4, micro_batch_size=2,
                  rollout=RolloutConfig(**engine))
    runner = RLRunner(job, rl, load_tokenizer(tok_path), ps=ps,
                      engine_options={"page_size": 8, "num_pages": 64, "prefill_chunk": 8})
    seen, update = [], runner.update

    def recorded(samples, adv):
        seen.append([(s.uid, list(s.token_ids)) for s in samples])
        return update(samples, adv)

    runner.update = recorded
    hist = runner.fit(log=None)
    return {"samples": seen, "steps": [(h["loss"], h["grad_norm"], h["lp_gap"]) for h in hist],
            "refit_bytes": [h["refit_bytes"] for h in hist], "shard": runner.last_refit["shard_bytes"]}


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    from megak3.data.demo_sft import build_demo_sft_dataset

    _, path = build_demo_sft_dataset(tmp_path_factory.mktemp("sft"), vocab_size=512, num_conversations=200,
                                     progress=False)
    return str(path)


@functools.lru_cache(maxsize=None)
def _one_process_loop(tok_path):
    return _loop(0, 1, {}, {}, tok_path)


@pytest.mark.parametrize("name", ["pp2-1f1b", "cp2"])
def test_rl_loop_at_trainer_layouts_samples_what_one_process_samples(name, tok_path):
    world, trainer, engine = LAYOUTS[name]
    ref = _one_process_loop(tok_path)
    assert all(gap <= 1e-5 for _, _, gap in ref["steps"]), ref["steps"]
    for r in run_distributed(_loop, world, trainer, engine, tok_path, timeout_s=600):
        assert r["samples"] == ref["samples"]  # same uids, same tokens, every update
        for (l1, g1, _), (l2, g2, gap) in zip(ref["steps"], r["steps"]):
            assert abs(l1 - l2) <= 1e-4 and abs(g1 - g2) <= 1e-4, (name, ref["steps"], r["steps"])
            assert gap <= 1e-5, (name, r["steps"])  # engine logprobs vs the trainer's forward, after each refit
        assert all(b == r["shard"] for b in r["refit_bytes"])


SCHEDULES = [("afab", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)]  # (1f1b: above)


def _schedules(rank, world, run_dir):
    return [_updates(rank, world, {"pp": 2, "pp_schedule": s, "vp": vp, "pp_split_blocks": vp > 1},
                     {"tp": 1, "replicas": 2}, run_dir)["steps"] for s, vp in SCHEDULES]


def test_rl_every_pipeline_schedule_matches_one_process(private_tmp):
    """afab, zb_h1 (deferred weight gradients) and interleaved_1f1b (2 chunks per rank; the update's micro-batch
    count padded to a multiple of pp) at pp2: loss and grad norm of one process over 3 updates."""
    ref = _one_process(str(private_tmp / "run"))["steps"]
    for rank in run_distributed(_schedules, 2, str(private_tmp / "run"), timeout_s=600):
        for (s, _), steps in zip(SCHEDULES, rank):
            for (l1, g1), (l2, g2) in zip(ref, steps):
                assert abs(l1 - l2) <= 1e-4 and abs(g1 - g2) <= 1e-4, (s, ref, steps)


def test_rl_qat_refit_gives_the_engine_the_mxfp4_weights_the_trainer_runs(private_tmp):
    """quant.qat=mxfp4_experts, trainer ep2 -> two tp1 engine replicas: the engines fake-quantise the experts
    they receive as the trainer does; greedy tokens and logprobs equal the one-process QAT trainer's forward."""
    ref = _updates(0, 1, {"qat": "mxfp4_experts"}, {}, str(private_tmp / "run"))
    assert ref["engine_qat"]
    for r in run_distributed(_updates, 2, {"ep": 2, "qat": "mxfp4_experts"}, {"tp": 1, "ep": 1, "replicas": 2},
                             str(private_tmp / "run"), timeout_s=600):
        assert r["engine_qat"]
        for (l1, g1), (l2, g2) in zip(ref["steps"], r["steps"]):
            assert abs(l1 - l2) <= 1e-4 and abs(g1 - g2) <= 1e-4, (ref["steps"], r["steps"])
        for ref_gen, got, refit in zip(ref["gen"], r["gen"], r["refits"]):
            assert refit["bytes_in"] == refit["shard_bytes"] > 0
            for (t1, _, fwd), (t2, lp2) in zip(ref_gen, got):
                assert t1 == t2 and max(abs(a - b) for a, b in zip(fwd, lp2)) <= 1e-5, (fwd, lp2)
