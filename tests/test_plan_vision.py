"""The planner's vision-tower terms (data.vision_fraction, data.image_side; megak3/launch/planner/vision.py).

- vision_activation_bytes against the bytes autograd really saves for the k3_tiny tower (forward on
  CPU under saved_tensors_hooks, deduplicated by storage, weights and autocast weight copies left
  out), fp32 and bf16 autocast, square / non-square / off-grid images and a two-image call;
- vision_flops_per_patch against torch's FLOP counter at an image off the position grid;
- the plan: text-only plans carry no vision keys; the stage-0 memory, step time, TP traffic and MFU
  grow by exactly the hand-computed vision terms; the tool prints the vision row only when asked;
- bad inputs (cp > 1, no tower, off-grid side, an image longer than a row, fraction outside [0, 1]).
"""
import contextlib
import math

import pytest
import torch

from megak3.config import load_model_config
from megak3.launch import planner as P
from megak3.launch.hardware import load_hardware

SIZES = [(4, 4), (16, 16), (32, 32), (16, 48)]   # patches (h, w); k3_tiny's position grid is 16 x 16
MEASURE_RTOL = 0.05


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter seen through views / autocast's cast copy (not an activation)."""
    fn = t.grad_fn
    while fn is not None and fn.name() in ("TBackward0", "ToCopyBackward0", "ViewBackward0", "PermuteBackward0",
                                           "TransposeBackward0"):
        fn = fn.next_functions[0][0]
    return fn is not None and fn.name() == "torch::autograd::AccumulateGrad"


def measure_saved_bytes(cfg, images, precision: str) -> int:
    """Bytes of the distinct storages autograd saves in one training forward of the tower."""
    from megak3.model.vision import VisionTower

    torch.manual_seed(0)
    tower = VisionTower(cfg.vision, cfg.hidden_size, cfg.rms_norm_eps).train()
    params = {p.untyped_storage().data_ptr() for p in tower.parameters()}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and not _is_weight(t):
            saved[st.data_ptr()] = st.nbytes()
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        out = tower(images)
    torch.cat(out).float().sum().backward()      # the graph is whole: every saved tensor was used
    assert all(p.grad is not None for p in tower.parameters())
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_vision_activation_bytes_match_autograd(precision):
    cfg = load_model_config("k3_tiny")
    p = cfg.vision.patch_size
    rows = []
    for h, w in SIZES:
        img = torch.randn(3, h * p, w * p)
        measured = measure_saved_bytes(cfg, [img], precision)
        est = P.vision_activation_bytes(cfg, h, w, precision)["total"]
        rows.append((h, w, measured, est))
        assert est == pytest.approx(measured, rel=MEASURE_RTOL), (h, w, measured, est)
    # two images in one call: the sum of the two
    two = measure_saved_bytes(cfg, [torch.randn(3, 16 * p, 16 * p), torch.randn(3, 32 * p, 16 * p)], precision)
    est = (P.vision_activation_bytes(cfg, 16, 16, precision)["total"]
           + P.vision_activation_bytes(cfg, 32, 16, precision)["total"])
    assert est == pytest.approx(two, rel=MEASURE_RTOL), (two, est)
    # linear in the patches: 4x the patches, 4x the bytes (the fused attention keeps no scores)
    assert rows[2][2] == pytest.approx(4 * rows[1][2], rel=0.01)
    print(precision, [(h, w, m, round(e / m, 4)) for h, w, m, e in rows])


def test_vision_flops_off_grid_match_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    from megak3.model.vision import VisionTower

    cfg = load_model_config("k3_tiny")
    v = cfg.vision
    with torch.device("meta"):
        tower = VisionTower(v, cfg.hidden_size)
        image = torch.empty(3, 16 * v.patch_size, 48 * v.patch_size)
    with FlopCounterMode(display=False) as counter:
        tower([image])
    assert P.vision_flops_per_patch(cfg, 16 * 48) * 16 * 48 == pytest.approx(counter.get_total_flops(), rel=1e-9)


def _tiny_pc(**kw):
    base = dict(tp=2, pp=2, world_size=8, seq_len=1024, micro_batch_size=2, global_batch_size=16, precision="fp32")
    return P.PlanConfig(**{**base, **kw})


@pytest.mark.parametrize("ckpt", [False, True])
def test_plan_vision_terms_hand_computed(ckpt):
    cfg = load_model_config("k3_tiny")
    hw = load_hardware("h200")
    text = P.make_plan(cfg, _tiny_pc(activation_checkpointing=ckpt), hw)
    assert "vision" not in text and "vision_activations" not in text["stages"][0]
    assert P.make_plan(cfg, _tiny_pc(vision_fraction=0.0, activation_checkpointing=ckpt), hw) == text
    f, side = 0.25, 448                               # 32 x 32 patches, 256 LM tokens per image
    p = P.make_plan(cfg, _tiny_pc(vision_fraction=f, image_side=side, activation_checkpointing=ckpt), hw)
    v = p["vision"]
    assert v["image_patches"] == [32, 32] and v["tokens_per_image"] == 256
    assert v["images_per_micro_batch"] == f * 2 * 1024 / 256 == 2.0
    assert v["images_per_rank"] == 1                  # round robin over tp = 2
    assert v["images_per_step"] == f * 16 * 1024 / 256
    per_image = P.vision_activation_bytes(cfg, 32, 32, "fp32", recompute=ckpt)["total"]
    s0, s0_text = p["stages"][0], text["stages"][0]
    in_flight = s0["in_flight_micro_batches"]
    assert in_flight == 2                             # 1F1B, stage 0 of 2, 4 micro-batches
    assert s0["vision_activations"] == in_flight * 1 * per_image
    assert s0["activations"] == pytest.approx(s0_text["activations"] + in_flight * per_image, rel=1e-12)
    s1 = p["stages"][1]                               # only the first stage runs the tower
    assert s1["vision_activations"] == 0 and {k: x for k, x in s1.items() if not k.startswith("vision")} \
        == text["stages"][1]
    # compute: 3 x forward (+ the blocks' forward again when they are recomputed), over the stage's
    # tp x dp = 4 ranks
    v_ = cfg.vision
    blocks = v_.num_layers * (2 * (4 * v_.hidden_size * v_.num_heads * v_.head_dim + 2 * v_.hidden_size
                                   * v_.intermediate_size) + 4 * v_.num_heads * v_.head_dim * 1024)
    train = (3 * P.vision_flops_per_patch(cfg, 1024) + (blocks if ckpt else 0)) * f * 16 * 1024 * 4
    assert v["train_flops_per_step"] == pytest.approx(train, rel=1e-12)
    dt = train / 4 / (hw.peak_flops("fp32") * hw.mfu)
    assert v["compute_s"] == pytest.approx(dt, rel=1e-12)
    gather = (2 - 1) / 2 * f * 2 * 1024 * cfg.hidden_size * 4 * 4    # (tp-1)/tp x tokens x E x 4 B x 4 micro-batches
    assert v["gather_bytes_per_step"] == pytest.approx(gather, rel=1e-12)
    assert p["stage_step_s"][1] == text["stage_step_s"][1]
    assert p["stage_step_s"][0] > text["stage_step_s"][0]
    # a micro-batch with less than one image on average still holds a whole one when it holds any
    small = P.make_plan(cfg, _tiny_pc(vision_fraction=0.01, image_side=448), hw)["vision"]
    assert small["images_per_micro_batch"] < 1 and small["images_per_rank"] == 1


def test_plan_vision_k3_full_is_linear_in_the_patches():
    """The tower's fused attention keeps no [H, N, N] scores: saved bytes per patch do not grow with
    the image (before the 4-D SDPA inputs, the math path's fp32 scores were >70% of a 64x64 image)."""
    cfg = load_model_config("k3_full")
    small, big = (P.vision_activation_bytes(cfg, n, n, "bf16") for n in (16, 64))
    assert big["total"] == pytest.approx(16 * small["total"], rel=1e-12)
    assert big["total"] < 27 * 12 * 4096 ** 2 * 4 / 3  # under a third of the old scores alone (5.5 vs 21.7 GB)


@pytest.mark.parametrize("kw,msg", [
    (dict(cp=2, world_size=16, seq_len=1024, vision_fraction=0.1), "context parallelism"),
    (dict(vision_fraction=0.1, image_side=100), "multiple of patch_size x merge"),
    (dict(vision_fraction=0.1, image_side=28 * 40, seq_len=256), "more than data.seq_len"),
    (dict(vision_fraction=1.5), r"\[0, 1\]"),
    (dict(vision_fraction=-0.1), r"\[0, 1\]"),
    (dict(vision_fraction=0.1, image_side=-28), "image_side"),
])
def test_plan_vision_rejects(kw, msg):
    cfg = load_model_config("k3_tiny")
    base = dict(tp=2, pp=2, world_size=8, seq_len=1024)
    with pytest.raises(ValueError, match=msg):
        P.make_plan(cfg, P.PlanConfig(**{**base, **kw}), load_hardware("h200"))


def test_plan_vision_needs_tower():
    cfg = load_model_config("k3_tiny", **{"vision.enabled": False})
    with pytest.raises(ValueError, match="vision.enabled"):
        P.make_plan(cfg, _tiny_pc(vision_fraction=0.1), load_hardware("h200"))


def test_tool_prints_vision_row(capsys):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("plan_tool", Path(__file__).resolve().parents[1] / "tools/plan.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    args = ["model=k3_tiny", "gpu=h200", "world_size=8", "parallel.tp=2", "parallel.pp=2", "data.seq_len=1024"]
    tool.main(args)
    assert "vision tower" not in capsys.readouterr().out
    tool.main(args + ["data.vision_fraction=0.25", "data.image_side=448"])
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.strip().startswith("vision tower"))
    assert "blocks recomputed" in line and "image(s) of 32x32 patches" in line
    assert math.isfinite(float(line.split()[2]))
    assert tool.main(args + ["data.vision_fraction=x"]) == 2
