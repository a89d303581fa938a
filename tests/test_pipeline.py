"""Pipeline parallelism (gloo, fp32): k3_tiny (parity widths, 9 layers, 3 AttnRes blocks) under
pp in {2, 4} x schedule in {afab, 1f1b, interleaved_1f1b (vp=2), zb_h1} x micro-batches in
{pp, 2 pp}; the step loss and every gradient of every stage equal one process running the same
micro-batches (rel 1e-5). pp=2 with vp=1 keeps AttnRes blocks whole; pp=4 and vp=2 need stage
boundaries inside blocks (allowed explicitly). A stage whose neighbour stops answering fails with
a clear error within the timeout instead of hanging."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from megak3.config import load_model_config
from megak3.model.k3 import build_model
from parallel.pipeline import PipelineEngine, keep_stage, partition_layers, rank_chunks
from parallel.testing import PARITY_MODEL, global_batch, local_rows, run_distributed

RTOL = 1e-5
ATOL = 1e-9  # absolute floor (norm) for near-cancelling gradients, e.g. a KDA A_log grad of norm 9e-6


def _cfg():
    return load_model_config("k3_tiny", **PARITY_MODEL)


def _micro_batches(m, seqlen=32):
    cfg = _cfg()
    ids, labels, _ = global_batch(0, m, seqlen, cfg.vocab_size)
    out = []
    for i in range(m):
        a, b, cu = local_rows(ids, labels, i, m)
        out.append({"input_ids": a, "labels": b, "cu_seqlens": cu})
    return out, int((labels != -100).sum())


def _reference(m):
    torch.set_num_threads(1)  # the ranks' thread count: same fp32 reduction order in every kernel
    model = build_model(_cfg(), seed=4)
    mbs, n = _micro_batches(m)
    loss = 0.0
    for mb in mbs:
        out = model(mb["input_ids"], labels=mb["labels"], cu_seqlens=mb["cu_seqlens"])
        (out.loss_sum / n).backward()
        loss += float(out.loss_sum.detach())
    return loss, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _stage(rank, world, cases):
    cfg = _cfg()
    results = {}
    for schedule, m, split, *vp in cases:
        vp = vp[0] if vp else 2 if schedule == "interleaved_1f1b" else 1
        model = build_model(cfg, seed=4)
        mine = rank_chunks(cfg, world, rank, vp, allow_split_blocks=split or vp > 1)
        keep_stage(model, mine, rank == 0, rank == world - 1)
        eng = PipelineEngine(model, mine, dist.group.WORLD, schedule=schedule)
        mbs, n = _micro_batches(m)
        loss, stats = eng.train_step(mbs, n)
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results[(schedule, m)] = {"loss": loss, "grads": grads, "inflight": eng.max_inflight,
                                  "stats": sum(len(s) for s in stats),
                                  "moe_layers": sum(cfg.is_moe_layer(i) for c in mine for i in c) * m,
                                  "pending_w": eng.store.bytes_held}
    return results


def _check(res_by_rank, world, cases):
    for schedule, m, *_ in cases:
        ref_loss, ref_grads = _reference(m)
        seen = set()
        for rank, res in enumerate(res_by_rank):
            r = res[(schedule, m)]
            assert abs(r["loss"] - ref_loss) <= RTOL * abs(ref_loss), (schedule, m, rank, r["loss"], ref_loss)
            for k, g in r["grads"].items():  # ||g - ref|| <= RTOL ||ref|| + ATOL
                diff, scale = float((g - ref_grads[k]).norm()), float(ref_grads[k].norm())
                assert diff <= RTOL * scale + ATOL, (schedule, m, rank, k, diff, scale)
                seen.add(k)
            assert r["stats"] == r["moe_layers"] and r["pending_w"] == 0
            if schedule in ("1f1b", "zb_h1"):  # rank r holds at most p - r micro-batches of activations
                assert r["inflight"] <= world - rank, (rank, r["inflight"])
            elif schedule == "afab":
                assert r["inflight"] == m
        assert seen == set(ref_grads), set(ref_grads) - seen   # every gradient is produced by some stage


def test_pp3_and_vp3_on_real_ranks_match_one_process():
    """pp = 3 (3 layers a stage) and pp = 3 x vp = 3 (one layer a chunk), on 3 gloo ranks, not only
    on the simulator: every schedule's loss and gradients against one process."""
    cases = [("1f1b", 3, True), ("zb_h1", 6, True), ("afab", 3, True), ("interleaved_1f1b", 6, True, 3)]
    _check(run_distributed(_stage, 3, cases, timeout_s=300), 3, cases)


def test_partition_respects_blocks_and_errors():
    cfg = _cfg()
    chunks = partition_layers(cfg, 2)
    assert all(c.start % cfg.attn_res_block_size == 0 for c in chunks)
    assert chunks[0].start == 0 and chunks[-1].stop == cfg.num_layers
    assert [len(c) for c in partition_layers(cfg, 3, layout=[3, 3, 3])] == [3, 3, 3]
    with pytest.raises(ValueError, match="inside an AttnRes block"):
        partition_layers(cfg, 2, layout=[4, 5])
    with pytest.raises(ValueError, match="block starts"):
        partition_layers(cfg, 4)
    with pytest.raises(ValueError, match="exceeds model.num_layers"):
        partition_layers(cfg, 10, allow_split_blocks=True)
    assert len(partition_layers(cfg, 4, allow_split_blocks=True)) == 4


SCHEDS = ("afab", "1f1b", "interleaved_1f1b", "zb_h1")


def test_pp2_schedules_match_one_process():
    cases = [(s, m, False) for s in SCHEDS for m in (2, 4)]
    _check(run_distributed(_stage, 2, cases, timeout_s=300), 2, cases)


def test_pp4_split_blocks_match_one_process():
    cases = [(s, m, True) for s in SCHEDS for m in (4, 8)]
    _check(run_distributed(_stage, 4, cases, timeout_s=300), 4, cases)


def _silent_neighbour(rank, world, flag):
    cfg = _cfg()
    model = build_model(cfg, seed=4)
    mine = partition_layers(cfg, world)[rank]
    keep_stage(model, mine, rank == 0, rank == world - 1)
    eng = PipelineEngine(model, mine, dist.group.WORLD, schedule="1f1b", timeout_s=6)
    mbs, n = _micro_batches(2)
    if rank == 1:                # alive but silent until stage 0 has given up waiting for its gradients
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return "silent"
    t0 = time.perf_counter()
    try:
        eng.train_step(mbs, n)
    except RuntimeError as e:
        return (str(e), time.perf_counter() - t0)
    finally:
        open(flag, "w").close()  # an event, not a race against the peer's clock
    return "no error"


def test_silent_neighbour_fails_within_timeout(tmp_path):
    res = run_distributed(_silent_neighbour, 2, str(tmp_path / "stage0_done"), timeout_s=120)
    msg, waited = res[0]
    assert "pipeline rank 0" in msg and "from pipeline rank 1" in msg and "micro-batch 0" in msg, msg
    assert "within 6 s" in msg, msg
    assert waited >= 5, waited  # not before its timeout (one-sided: load only adds time)


def test_pipeline_trace_tool(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "pipeline_trace.py"
    spec = importlib.util.spec_from_file_location("pipeline_trace", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    # hand-computed: 2 stages, span 0..4; stage 0 busy 3 (bubble 1/4), stage 1 busy 2 (bubble 1/2)
    traces = [[("F", 0, 0, 0.0, 1.0), ("B", 0, 0, 2.0, 3.5), ("send_F", 0, 0, 1.0, 1.5), ("W", 0, 0, 3.5, 4.0)],
              [("F", 0, 0, 1.0, 2.0), ("B", 0, 0, 2.0, 3.0)]]
    mean, per, t0 = tool.bubble(traces)
    assert per == [0.25, 0.5] and mean == 0.375 and t0 == 0.0
    out = tmp_path / "trace.png"
    measured, closed, sim = tool.main(["--pp", "2", "--micro-batches", "2", "--layers", "4", "--seqlen", "16",
                                       "--steps", "1", "--out", str(out)])
    assert out.stat().st_size > 0 and 0.0 <= measured < 1.0 and closed == 1 / 3 and 0 < sim < 1


def test_executed_order_is_the_schedule_and_its_bubble_the_theory():
    """The engine runs each rank's F / B / W in the schedule's order; replayed on the simulator's
    ideal clock (unit op times) that order's bubble is the closed form, (p-1)/(m+p-1) for 1F1B and
    (p-1)/(3m+p-1) for ZB-H1 (p = 2, m = 4). Simulator timestamps, not wall-clock sleeps."""
    from parallel.pipeline.schedules import Action, build_schedule, closed_form_bubble, simulate, splits_weight_grad
    from parallel.pipeline_trace import BUSY, traced_step

    got = {}
    for schedule, want in (("1f1b", 1 / 5), ("zb_h1", 1 / 13)):
        assert closed_form_bubble(schedule, 2, 4) == pytest.approx(want)
        res = run_distributed(traced_step, 2, 4, schedule, 2, 8, 1, None, 1, (0.0, 0.0, 0.0), timeout_s=120)
        executed = [[Action(t[0], t[1], t[2]) for t in r["trace"] if t[0] in BUSY] for r in res]
        assert executed == [list(a) for a in build_schedule(schedule, 2, 4)], schedule
        timeline, span = simulate(executed, 2, 1, {"F": 1.0, "B": 1.0, "W": 1.0}, splits_weight_grad(schedule))
        got[schedule] = sum(1 - sum(e - s for _, s, e in tl) / span for tl in timeline) / 2
        assert got[schedule] == pytest.approx(want), (schedule, got[schedule])
    assert got["zb_h1"] < got["1f1b"], got


def test_1f1b_holds_at_most_p_micro_batches():
    """Measured by the engine's activation meter (saved tensors): AFAB's peak is m micro-batches
    of activations on every rank, 1F1B's is p - r on rank r (first stage: p)."""
    from parallel.pipeline_trace import traced_step

    p, m = 2, 4
    peak = {s: [r["peak_bytes"] for r in run_distributed(traced_step, p, m, s, 4, 32, 1, None, 1, None, True,
                                                         timeout_s=120)]
            for s in ("afab", "1f1b")}
    for r in range(p):
        per_mb = peak["afab"][r] / m
        assert peak["1f1b"][r] <= (p - r) * per_mb * 1.02 + 1024, (r, peak)
        assert peak["1f1b"][r] >= (p - r) * per_mb * 0.9, (r, peak)


# ---- schedules in combined layouts, production step ----------------------------------------------
def _combined_steps(rank, world, tp, sp, cp, dp, schedule, vp):
    """3 production steps (RankStep: pipeline engine inside tp / cp / dp groups); rank 0's losses and
    global gradient norms."""
    from megak3.train.step import RankStep, all_reduce_sum
    from megak3.train.parity import parity_job
    from parallel.state import init_parallel

    job = parity_job(tp, dp, sp, PARITY_MODEL, 4, 32, 5, 1e-3, 3, cp=cp, pp=2)
    job.parallel.pp_schedule, job.parallel.vp = schedule, vp
    job.parallel.pp_split_blocks = vp > 1
    job.train.micro_batch_size = 1  # 4 / dp micro-batches a step through the pipeline
    ps = init_parallel(job.parallel, model_cfg=job.model)
    rs = RankStep(job, ps, "cpu", grad_accum=4 // dp)
    losses, norms = [], []
    for step in range(3):
        ids, labels, _ = global_batch(step, 4, 32, job.model.vocab_size)
        ids, labels, _ = local_rows(ids, labels, ps.dp_rank, dp)
        micro = [dict(zip(("input_ids", "labels", "cu_seqlens"), local_rows(ids, labels, i, len(ids))))
                 for i in range(len(ids))]
        rec = rs.accumulate(micro)
        out = rs.apply(step, 3)
        losses.append(float(all_reduce_sum(rec["loss_sum"].clone(), [ps.dp_cp_group])) / float(rec["step_tokens"]))
        norms.append(float(out["grad_norm"]))
    return {"losses": losses, "norms": norms}


COMBINED = {"pp2-tp2sp-zb_h1": (2, True, 1, 1, "zb_h1", 1), "pp2-cp2-afab": (1, False, 2, 1, "afab", 1),
            "pp2-dp2-interleaved_vp2": (1, False, 1, 2, "interleaved_1f1b", 2)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMBINED))
def test_schedules_in_combined_layouts_match_one_process(name):
    from megak3.train.parity import run_steps

    tp, sp, cp, dp, schedule, vp = COMBINED[name]
    ref = run_steps(0, 1, 1, 1, False, 3, PARITY_MODEL, batch=4, seqlen=32, seed=5, lr=1e-3)
    got = run_distributed(_combined_steps, 2 * tp * cp * dp, tp, sp, cp, dp, schedule, vp, timeout_s=300)
    for r in got:
        for a, b in zip(r["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-4 * abs(b), (name, r["losses"], ref["losses"])
        for a, b in zip(r["norms"], ref["grad_norms"]):
            assert abs(a - b) <= 1e-4 * abs(b), (name, r["norms"], ref["grad_norms"])
