"""RL update at ep2 (MoonEP dispatch) and tp2 + sequence parallelism matches one process: loss and grad
norm over 3 updates on fixed rollouts (the rollouts and runner of tests/test_rl_parallel.py)."""
import functools

import pytest
import torch

from parallel.testing import run_distributed
from tests.test_rl_parallel import _fixed_rollouts  # the same fixed rollouts as the dp2/tp2 parity


class Tok:  # the update needs only the pad id
    pad_id, eos_id, bos_id = 0, 2, 1

    def decode(self, ids):
        return " ".join(map(str, ids))


def _job(world, tp=1, ep=1, sp=False):
    from conftest import SMALL_MODEL
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.optim.config import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig
    from parallel.config import ParallelConfig

    return JobConfig(model=load_model_config("k3_tiny", **SMALL_MODEL), data=DataConfig(vocab_size=512),
                     optim=OptimConfig(lr=3e-3, warmup_steps=0, ns_dtype="float32"),
                     train=TrainConfig(max_steps=3, global_batch_size=world, micro_batch_size=1, seed=5),
                     parallel=ParallelConfig(tp=tp, ep=ep, sequence_parallel=sp, backend="gloo",
                                             timeout_s=120)).validate(world)


def _rl_updates(rank, world, tp=1, ep=1, sp=False, init_from=None):
    from megak3.posttrain.objective import LossConfig
    from megak3.posttrain.rl import RLConfig, RLRunner
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    job = _job(world, tp, ep, sp)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rl = RLConfig(iterations=3, micro_batch_size=2, loss=LossConfig(aggregation="token", kl_coef=0.05))
    runner = RLRunner(job, rl, Tok(), ps=ps, engine_options={"page_size": 8, "num_pages": 16}, init_from=init_from)
    samples, adv = _fixed_rollouts()
    out = {"steps": []}
    for _ in range(3):
        rec = runner.update(samples, adv)
        runner.version += 1
        runner.refit()
        out["steps"].append((rec["loss"], rec["grad_norm"]))
    moe = [l.mlp for l in runner.model.layers if l.is_moe]
    out["dispatch"] = sum(getattr(m, "expert_dispatch", None) is not None for m in moe)
    out["sp"] = any(getattr(l.self_attn, "sequence_parallel", False) for l in runner.model.layers)
    # the refit engine generates (greedy) with the updated policy: same tokens as one process
    from megak3.inference import SamplingParams

    gen = runner.engine.generate([[5, 17, 99, 250], [9, 8, 7]], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                             temperature=0.0))
    out["tokens"] = [o.token_ids for o in gen]
    return out


@functools.lru_cache(maxsize=None)
def _one_process():
    return _rl_updates(0, 1)


@pytest.mark.parametrize("layout", [{"ep": 2}, {"tp": 2, "sp": True}], ids=["ep2", "tp2-sp"])
def test_rl_ep2_and_tp2_sp_match_one_process(layout):
    ref = _one_process()
    for r in run_distributed(_rl_updates, 2, layout.get("tp", 1), layout.get("ep", 1), layout.get("sp", False),
                             timeout_s=300):
        assert r["dispatch"] > 0 if "ep" in layout else r["sp"], r  # the layout is really on
        for (l1, g1), (l2, g2) in zip(ref["steps"], r["steps"]):
            assert abs(l1 - l2) <= 1e-4 and abs(g1 - g2) <= 1e-4, (ref["steps"], r["steps"])
        assert r["tokens"] == ref["tokens"]
    assert ref["steps"][0][0] != ref["steps"][2][0]  # the policy moved


def _init_runs(rank, world, paths):
    return [_rl_updates(rank, world, 2, init_from=p)["steps"] for p in paths]


def test_rl_init_from_a_one_process_checkpoint_and_hf_export_at_tp2(tmp_path):
    """--init-from at tp2: each rank takes its shards of the whole tensors of a one-process checkpoint / HF
    export; the 3 updates then match the one-process run from the same weights."""
    import sys
    from dataclasses import asdict
    from pathlib import Path

    from megak3.data.tokenizer import train_bpe_tokenizer
    from megak3.model.k3 import build_model
    from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import convert_hf

    torch.manual_seed(11)  # weights unlike the runner's own initialisation (train.seed=5)
    model = build_model(_job(1).model)
    run = tmp_path / "run"
    ent = {f"model/{k}": ShardEntry(v.detach(), tuple(v.shape), (0,) * v.dim()) for k, v in model.state_dict().items()}
    ShardedCheckpointer(run / "checkpoints", 0, 1).save(1, ent, common={"step": 1},
                                                         meta={"config": {"model": asdict(model.config)}})
    train_bpe_tokenizer(["def f(x):\n    return x + 1\n" * 20], 300, run / "tokenizer.json")
    hf = tmp_path / "hf"
    convert_hf.export(run / "checkpoints", hf, experts="bf16", dtype="fp32", log=lambda s: None)
    (hf / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes())
    fresh = _one_process()["steps"]
    ref = _rl_updates(0, 1, init_from=str(run))["steps"]
    assert abs(ref[0][1] - fresh[0][1]) > 1e-2  # the checkpoint's weights are in use
    for rank in run_distributed(_init_runs, 2, [str(run), str(hf)], timeout_s=300):
        for steps in rank:
            for (l1, g1), (l2, g2) in zip(ref, steps):
                assert abs(l1 - l2) <= 1e-4 and abs(g1 - g2) <= 1e-4, (ref, steps)
