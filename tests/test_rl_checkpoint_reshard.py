"""An RL checkpoint is reshardable: saved by one process (policy, optimizer, KL reference, RL state), resumed at
tp2 and at dp2 on gloo ranks, the next updates equal the one-process continuation (loss and grad norm <= 1e-4);
saved again by those ranks, it loads as one process with the one-process continuation's weights."""
import shutil

import pytest
import torch

from parallel.testing import run_distributed
from test_rl_parallel import _fixed_rollouts


def _job(world, tp):
    from conftest import SMALL_MODEL
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.job.config import JobConfig, TrainConfig
    from megak3.optim.config import OptimConfig
    from parallel.config import ParallelConfig

    return JobConfig(model=load_model_config("k3_tiny", **SMALL_MODEL), data=DataConfig(vocab_size=512),
                     optim=OptimConfig(lr=3e-3, warmup_steps=0, ns_dtype="float32"),
                     train=TrainConfig(max_steps=3, global_batch_size=world, micro_batch_size=1, seed=5),
                     parallel=ParallelConfig(tp=tp, backend="gloo", timeout_s=120)).validate(world)


def _continue(rank, world, tp, run_dir, tok_path, steps=2):
    """Resume ``run_dir`` at this layout and run ``steps`` updates on the fixed rollouts: [(loss, grad_norm)]."""
    from megak3.data.tokenizer import load_tokenizer
    from megak3.posttrain.objective import LossConfig
    from megak3.posttrain.rl import RLConfig, RLRunner
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    job = _job(world, tp)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rl = RLConfig(iterations=3, micro_batch_size=2, loss=LossConfig(kl_coef=0.05))
    runner = RLRunner(job, rl, load_tokenizer(tok_path), ps=ps, engine_options={"page_size": 8, "num_pages": 16})
    restored = runner.resumable(run_dir)
    samples, adv = _fixed_rollouts()
    out = [restored, runner.version]
    for _ in range(steps):
        rec = runner.update(samples, adv)
        runner.version += 1
        out.append((rec["loss"], rec["grad_norm"]))
    if steps:
        if world > 1:
            runner.state.after_update()  # the last version: every rank writes its shards, rank 0 commits
        else:
            out.append({k: v.clone() for k, v in runner.model.state_dict().items()})
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A one-process run directory after one update (and its saved checkpoint), and the tokenizer."""
    from megak3.data.demo_sft import build_demo_sft_dataset

    root = tmp_path_factory.mktemp("reshard")
    tok_path = str(build_demo_sft_dataset(root / "cache", 512, num_conversations=100, progress=False)[1])
    _continue(0, 1, 1, str(root / "run"), tok_path, steps=0)  # a fresh run: nothing restored
    from megak3.data.tokenizer import load_tokenizer
    from megak3.posttrain.objective import LossConfig
    from megak3.posttrain.rl import RLConfig, RLRunner

    runner = RLRunner(_job(1, 1), RLConfig(iterations=3, micro_batch_size=2, loss=LossConfig(kl_coef=0.05)),
                      load_tokenizer(tok_path), engine_options={"page_size": 8, "num_pages": 16})
    runner.resumable(root / "run")
    samples, adv = _fixed_rollouts()
    first = runner.update(samples, adv)
    runner.version += 1
    runner.state.after_update()
    ref = _continue(0, 1, 1, str(root / "run"), tok_path)
    assert ref[:2] == [True, 1] and ref[2][0] != first["loss"]  # it went on from the saved policy
    return root, tok_path, ref[:-1], ref[-1]


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_rl_checkpoint_resumes_at_another_layout(saved, tmp_path, tp):
    from megak3.inference import Engine

    root, tok_path, ref, weights = saved
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    got = run_distributed(_continue, 2, tp, str(run), tok_path, timeout_s=300)
    for r in got:
        assert r[:2] == [True, 1]
        for (l1, g1), (l2, g2) in zip(ref[2:], r[2:]):
            assert abs(l1 - l2) <= 1e-4 and abs(g1 - g2) <= 1e-4, (ref, r)
    assert ref[2] != ref[3]  # the policy moved
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
    loaded = Engine.from_pretrained(str(run)).model.state_dict()
    gap = max(float((loaded[k] - v).abs().max()) for k, v in weights.items())
    assert gap <= 1e-5, gap
