"""A non-finite gradient on ONE rank under tp / dp / pp / ep: every rank skips that step (the flag
comes from the global gradient norm), no rank changes a parameter, optimizer state or QB bias, and
the steps before and after run normally on every rank (the production RankStep, gloo ranks)."""
import math

import pytest
import torch

from parallel.testing import PARITY_MODEL, run_distributed

pytestmark = pytest.mark.slow
STEPS, BAD_STEP = 3, 1


def _snapshot(rs):
    opt_state = [t for o in rs.optimizer.optimizers for st in o.state.values() for t in st.values()
                 if torch.is_tensor(t)]
    biases = [m.gate.e_score_correction_bias for m in rs.model.moe_layers()]
    return [t.detach().clone() for t in list(rs.model.parameters()) + opt_state + biases]


def _poisoned_steps(rank, world, tp, dp, sp, pp, ep, where):
    from megak3.train.step import RankStep
    from parallel.testing import global_batch, local_rows
    from megak3.train.parity import parity_job
    from parallel.state import init_parallel

    job = parity_job(tp, dp, sp, PARITY_MODEL, 4, 32, 5, 1e-3, STEPS, pp=pp, ep=ep)
    ps = init_parallel(job.parallel, model_cfg=job.model)
    rs = RankStep(job, ps, "cpu", grad_accum=1)
    out = []
    for step in range(STEPS):
        ids, labels, _ = global_batch(step, 4, 32, job.model.vocab_size)
        ids, labels, cu = local_rows(ids, labels, ps.dp_rank, dp)
        rs.accumulate([{"input_ids": ids, "labels": labels, "cu_seqlens": cu}])
        poisoned = None
        if step == BAD_STEP and rank == world - 1:  # one element of one gradient, on the last rank only
            poisoned, p = next((n, p) for n, p in rs.model.named_parameters() if p.grad is not None and where in n)
            p.grad.view(-1)[0] = float("nan")
        before = _snapshot(rs)
        res = rs.apply(step, STEPS)
        after = _snapshot(rs)
        changed = len(before) != len(after) or any(not torch.equal(a, b) for a, b in zip(before, after))
        out.append({"skipped": bool(res["skipped"]), "changed": changed, "norm": float(res["grad_norm"]),
                    "poisoned": poisoned})
    return out


LAYOUTS = {  # degrees (tp, dp, sp, pp, ep), and where the NaN goes: a TP shard, a dense weight, the
    # last stage, one rank's own experts (their gradients are reduced over the expert-dp group only)
    "tp2-sp": (2, 1, True, 1, 1, "self_attn."), "dp2": (1, 2, False, 1, 1, "embed_tokens"),
    "pp2": (1, 1, False, 2, 1, "lm_head"), "ep2-dp2": (1, 2, False, 1, 2, "experts.w2")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_rank_nonfinite_skips_the_step_on_every_rank(layout):
    tp, dp, sp, pp, ep, where = LAYOUTS[layout]
    ranks = run_distributed(_poisoned_steps, tp * dp * pp, tp, dp, sp, pp, ep, where, timeout_s=300)
    assert where in ranks[-1][BAD_STEP]["poisoned"] and not any(r[BAD_STEP]["poisoned"] for r in ranks[:-1])
    for rank, steps in enumerate(ranks):
        for step, s in enumerate(steps):
            if step == BAD_STEP:
                assert s["skipped"] and not s["changed"] and not math.isfinite(s["norm"]), (layout, rank, s)
            else:
                assert not s["skipped"] and s["changed"] and math.isfinite(s["norm"]), (layout, rank, step, s)
    # the global norm, hence the decision, is the same number on every rank
    for step in (0, 2):
        assert len({r[step]["norm"] for r in ranks}) == 1, (layout, [r[step]["norm"] for r in ranks])
