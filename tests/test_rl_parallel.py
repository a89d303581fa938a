"""RL update at dp2 and tp2 matches one process: loss and grad norm over 3 updates on fixed rollouts."""
import pytest
import torch

from parallel.testing import run_distributed

SAMPLES = 8


def _fixed_rollouts():
    from megak3.posttrain.buffer import Rollout

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(SAMPLES):
        P, R = 5 + i % 3, 3 + (i * 5) % 7
        r = Rollout(i, i // 4, torch.randint(4, 512, (P,), generator=g).tolist(), budget=16)
        r.extend(torch.randint(4, 512, (R,), generator=g).tolist(),
                 (-6.2 + 0.1 * torch.randn(R, generator=g)).tolist(), version=0)
        r.finish("length")
        out.append(r)
    adv = torch.randn(SAMPLES, generator=g)
    return out, adv


def _rl_updates(rank, world, tp=1):
    from conftest import SMALL_MODEL
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.optim.config import OptimConfig
    from megak3.posttrain.objective import LossConfig
    from megak3.posttrain.rl import RLConfig, RLRunner
    from megak3.job.config import JobConfig, TrainConfig
    from parallel.config import ParallelConfig
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)

    class Tok:  # the update needs only the pad id
        pad_id, eos_id, bos_id = 0, 2, 1

    job = JobConfig(model=load_model_config("k3_tiny", **SMALL_MODEL), data=DataConfig(vocab_size=512),
                    optim=OptimConfig(lr=3e-3, warmup_steps=0, ns_dtype="float32"),
                    train=TrainConfig(max_steps=3, global_batch_size=world, micro_batch_size=1, seed=5),
                    parallel=ParallelConfig(tp=tp, backend="gloo", timeout_s=120)).validate(world)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    out = {}
    for agg in ("token", "sequence"):
        rl = RLConfig(iterations=3, micro_batch_size=2, loss=LossConfig(aggregation=agg, kl_coef=0.05))
        runner = RLRunner(job, rl, Tok(), ps=ps, engine_options={"page_size": 8, "num_pages": 16})
        samples, adv = _fixed_rollouts()
        out[agg] = []
        for _ in range(3):
            rec = runner.update(samples, adv)
            runner.version += 1
            out[agg].append((rec["loss"], rec["grad_norm"]))
        rows = {k: v.shape[0] for k, v in runner.engine.model.state_dict().items() if "lm_head" in k}
        out["lm_head_rows"] = sorted(rows.values())  # the engine's copy is sharded like the trainer's
    return out


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_rl_dp2_and_tp2_match_one_process(tp):
    ref = _rl_updates(0, 1)
    dp = run_distributed(_rl_updates, 2, tp, timeout_s=300)
    for agg in ("token", "sequence"):
        for r in dp:
            for (l1, g1), (l2, g2) in zip(ref[agg], r[agg]):
                assert abs(l1 - l2) <= 1e-4 and abs(g1 - g2) <= 1e-4, (agg, ref[agg], r[agg])
        assert ref[agg][0][0] != ref[agg][2][0]  # the policy moved
    assert all(r["lm_head_rows"] == [512 // tp] for r in dp), dp[0]["lm_head_rows"]
