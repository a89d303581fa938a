"""The vision tower under tp (+SP), dp and pp with images reproduces one process (fp32, same seed).

Each layout runs the production step (RankStep.accumulate / apply, 2 micro-batches a step) on the
same deterministic image-text batches; images travel with their rows (dp splits rows, so each rank
gets the images of its rows), the tower runs on the first pipeline stage, and under tp each rank
encodes its share of the images (parallel/tensor_parallel/image_split.py; the grads are summed
over tp). Checked: the step losses within 1e-4 over 5 steps, and the step-0 gradient of every vision
parameter (summed over dp) against the single-process gradient.
"""
import pytest
import torch
import torch.distributed as dist

from megak3.train.parity import parity_job
from parallel.testing import PARITY_MODEL, run_distributed

MODEL = {**PARITY_MODEL, "vision.enabled": True}
STEPS, BATCH, SEQ, MEDIA, SIDE = 5, 4, 32, 3, 28
LOSS_TOL = 1e-4
GRAD_RTOL = 1e-5
SIZES = ((28, 28), (56, 28), (28, 56), (56, 56))


def vision_batch(step: int, vocab: int):
    """[BATCH, SEQ] ids/labels with 2 images per row (1 at step 1; 1-4 slots each), images per row."""
    g = torch.Generator().manual_seed(4242 + step)
    ids = torch.randint(4, vocab, (BATCH, SEQ), generator=g)
    rows = []
    for b in range(BATCH):
        imgs, pos = [], 1 + b
        # step 1: one image per row, so under tp2 x dp2 one TP rank has no image to encode
        for h, w in (SIZES[b % 4], SIZES[(b + 1 + step) % 4])[:1 if step == 1 else 2]:
            n = (h // SIDE) * (w // SIDE)
            ids[b, pos:pos + n] = MEDIA
            imgs.append(torch.rand(3, h, w, generator=g) * 2 - 1)
            pos += n + 6
        rows.append(imgs)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[labels == MEDIA] = -100  # what the packer does: vision slots are never targets
    return ids, labels, rows


def micro_batches(ids, labels, rows, lo: int, hi: int, parts: int):
    out, per = [], (hi - lo) // parts
    for k in range(parts):
        a, b = lo + k * per, lo + (k + 1) * per
        cu = [0]
        for r in range(b - a):
            cu += [r * SEQ + SEQ // 3, (r + 1) * SEQ]
        imgs = [im for r in rows[a:b] for im in r]
        out.append({"input_ids": ids[a:b], "labels": labels[a:b], "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
                    "images": imgs, "num_images": len(imgs),
                    "vision_tokens": int((ids[a:b] == MEDIA).sum())})
    return out


def run_vision_steps(rank: int, world: int, tp: int, dp: int, sp: bool, pp: int, lr: float = 1e-3):
    from megak3.train.step import RankStep, all_reduce_sum
    from parallel.state import ParallelState, init_parallel

    job = parity_job(tp, dp, sp, MODEL, BATCH, SEQ, 5, lr, STEPS)
    job.parallel.pp = pp
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rs = RankStep(job, ps, "cpu", grad_accum=2)
    losses, grads0 = [], {}
    rows_per_rank = BATCH // dp
    for step in range(STEPS):
        ids, labels, rows = vision_batch(step, job.model.vocab_size)
        lo = ps.dp_rank * rows_per_rank
        rec = rs.accumulate(micro_batches(ids, labels, rows, lo, lo + rows_per_rank, 2))
        if step == 0 and rs.model.vision is not None:
            for n, p in rs.model.vision.named_parameters():  # under tp: ImageSplitTower's inner.*
                grads0[n.removeprefix("inner.")] = all_reduce_sum(p.grad.detach().clone(), [ps.dp_group])
        rs.apply(step, STEPS)
        loss_sum = all_reduce_sum(rec["loss_sum"].clone(), [ps.dp_group])
        losses.append(float(loss_sum) / float(rec["step_tokens"]))
        assert float(rec["images"]) == sum(len(r) for r in rows)  # counted over dp for the log line
    if world > 1 and dist.get_rank() != 0:
        return None
    return {"losses": losses, "vision_grads": grads0}


@pytest.fixture(scope="module")
def reference():
    ref = run_vision_steps(0, 1, 1, 1, False, 1)
    # the updates matter: with lr=1e-12 (frozen; each step's batch differs, so "the loss went down" says nothing)
    # the losses of steps 1-4 move by >= 24 x LOSS_TOL (measured), so a layout whose update were lost fails
    frozen = run_vision_steps(0, 1, 1, 1, False, 1, lr=1e-12)["losses"]
    assert frozen[0] == ref["losses"][0]
    assert min(abs(a - b) for a, b in zip(ref["losses"][1:], frozen[1:])) > 10 * LOSS_TOL, (ref["losses"], frozen)
    return ref


LAYOUTS = [(1, False, 2, 1), (2, False, 1, 1), (2, True, 1, 1), (1, False, 1, 2), (2, True, 2, 1),
           (2, True, 2, 2)]  # the last: 8 ranks, pp2 x tp2 (+SP) x dp2


@pytest.mark.parametrize("tp,sp,dp,pp", LAYOUTS,
                         ids=[f"tp{t}{'-sp' if s else ''}-dp{d}-pp{p}" for t, s, d, p in LAYOUTS])
def test_vision_layout_matches_single_process(reference, tp, sp, dp, pp):
    got = run_distributed(run_vision_steps, tp * dp * pp, tp, dp, sp, pp, timeout_s=300)[0]
    ref = reference
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= LOSS_TOL, (got["losses"], ref["losses"])
    assert got["vision_grads"].keys() == ref["vision_grads"].keys() and ref["vision_grads"]
    for n, g in ref["vision_grads"].items():
        assert float(g.norm()) > 0, n  # the tower gets gradient through the spliced tokens
        rel = float((got["vision_grads"][n] - g).norm()) / float(g.norm())
        assert rel <= GRAD_RTOL, (n, rel)


@pytest.mark.parametrize("preset", ["k3_full", "k3_tiny"])
def test_planner_vision_flops_match_flop_counter(preset):
    """The planner's tower FLOPs per patch (at a pos_grid x pos_grid-patch image) equal torch's count."""
    from torch.utils.flop_counter import FlopCounterMode

    from megak3.config import load_model_config
    from megak3.launch.planner import flops_per_token
    from megak3.model.vision import VisionTower

    cfg = load_model_config(preset)
    v = cfg.vision
    with torch.device("meta"):
        tower = VisionTower(v, cfg.hidden_size)
        image = torch.empty(3, v.pos_grid * v.patch_size, v.pos_grid * v.patch_size)
    with FlopCounterMode(display=False) as counter:
        tower([image])
    measured = counter.get_total_flops() / v.pos_grid ** 2
    assert flops_per_token(cfg, 4096)["vision_per_patch_forward"] == pytest.approx(measured, rel=1e-9)
