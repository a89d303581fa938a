"""Generation through the trainer's parallelize() plan: tp2 and ep2 (MoonEP dispatch) give the
greedy tokens of one process, with logprobs within fp32 rounding (2 gloo ranks each)."""
import pytest
import torch

from parallel.testing import PARITY_MODEL, run_distributed

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 99, 250, 41, 7, 300, 12, 64], [9, 8, 7, 6, 5, 4, 3, 200, 201, 202, 203, 204, 205, 206, 207, 208,
                                                 209, 210]]


def _generate(rank, world, tp, dp, ep):
    from megak3.inference import Engine, SamplingParams
    from megak3.train.step import RankStep
    from megak3.train.parity import parity_job
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    job = parity_job(tp, dp, False, PARITY_MODEL, batch=4, seqlen=32, seed=5, lr=1e-3, steps=1, ep=ep)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rs = RankStep(job, ps, "cpu", grad_accum=1)
    eng = Engine(rs.model, page_size=8, checkpoint_interval=16, prefill_chunk=8)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    moe = [l.mlp for l in rs.model.layers if l.is_moe]
    layout = {"tp_regions": sum(hasattr(l.self_attn, "inner") for l in rs.model.layers),
              "dispatch": sum(m.expert_dispatch is not None for m in moe)}
    return [o.token_ids for o in outs], [o.logprobs for o in outs], layout


@pytest.mark.parametrize("layout", [{"tp": 2, "dp": 1, "ep": 1}, {"tp": 1, "dp": 2, "ep": 2}])
def test_tp2_and_ep2_generate_the_tokens_of_one_process(layout):
    ref_tokens, ref_lp, _ = _generate(0, 1, 1, 1, 1)
    for tokens, lp, used in run_distributed(_generate, 2, layout["tp"], layout["dp"], layout["ep"], timeout_s=300):
        assert used["tp_regions" if layout["tp"] == 2 else "dispatch"] > 0, used   # the layout is really on
        assert tokens == ref_tokens
        assert max(abs(a - b) for r, o in zip(ref_lp, lp) for a, b in zip(r, o)) <= 1e-4
