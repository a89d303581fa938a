"""The vision tower under activation recomputation (K3Model.recompute != 'none'): every block keeps
only its input and is rerun in backward. Losses and gradients equal the unrecomputed model's
bitwise; the activation memory left after the forward is measured (live tensor storages, counted by
a dispatch spy) and equals the planner's figure exactly in fp32; the planner's recompute FLOPs equal
torch's FLOP counter over the blocks."""
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megak3.config import load_model_config
from megak3.launch import planner as P
from megak3.model.k3 import build_model
from megak3.model.vision import VisionTower
from tests.conftest import SMALL_MODEL


class _LiveStorages(TorchDispatchMode):
    """Records a weak reference to the storage of every tensor an op creates."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.refs.append((weakref.ref(st), st.nbytes()))
        return out


def _activation_bytes_after_forward(cfg, mode: str, h: int, w: int) -> int:
    """Bytes of the storages an fp32 training forward of the tower leaves alive for backward (not
    the parameters, the input image or the outputs)."""
    torch.manual_seed(0)
    tower = VisionTower(cfg.vision, cfg.hidden_size, cfg.rms_norm_eps).train()
    tower.recompute = mode
    p = cfg.vision.patch_size
    img = torch.randn(3, h * p, w * p)
    spy = _LiveStorages()
    with spy:
        out = tower([img])
    gc.collect()
    skip = ({o.untyped_storage().data_ptr() for o in out} | {img.untyped_storage().data_ptr()}
            | {q.untyped_storage().data_ptr() for q in tower.parameters()})
    alive = {r().data_ptr(): n for r, n in spy.refs if r() is not None and r().data_ptr() not in skip}
    torch.cat(out).sum().backward()
    return sum(alive.values())


@pytest.mark.parametrize("h,w", [(16, 16), (16, 48)])
def test_tower_activation_memory_measured_down_and_planned(h, w):
    cfg = load_model_config("k3_tiny")
    kept = _activation_bytes_after_forward(cfg, "none", h, w)
    rerun = _activation_bytes_after_forward(cfg, "full", h, w)
    assert _activation_bytes_after_forward(cfg, "selective", h, w) == rerun   # blocks rerun whole either way
    assert kept == P.vision_activation_bytes(cfg, h, w, "fp32", recompute=False)["total"]
    assert rerun == P.vision_activation_bytes(cfg, h, w, "fp32", recompute=True)["total"]
    print(f"tower activations {h}x{w} patches: {kept} -> {rerun} bytes ({rerun / kept:.3f}x)")
    assert rerun < 0.45 * kept      # k3_tiny's 2 blocks; K3's 27 blocks save far more


def test_k3_full_tower_recompute_figure():
    """At K3 size (27 blocks) the per-image figure drops by more than 5x."""
    cfg = load_model_config("k3_full")
    a, b = (P.vision_activation_bytes(cfg, 64, 64, "bf16", recompute=r)["total"] for r in (False, True))
    assert b < a / 5, (a, b)


def test_block_recompute_flops_match_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    cfg = load_model_config("k3_tiny")
    v = cfg.vision
    with torch.device("meta"):
        tower = VisionTower(v, cfg.hidden_size)
        x = torch.empty(16 * 48, v.hidden_size)
    with FlopCounterMode(display=False) as counter:
        for blk in tower.blocks:
            x = blk(x)
    assert P.vision_block_flops_per_patch(cfg, 16 * 48) * 16 * 48 == pytest.approx(counter.get_total_flops(),
                                                                                   rel=1e-9)


def test_model_with_images_same_loss_and_grads_under_recompute():
    cfg = load_model_config("k3_tiny", **{**SMALL_MODEL, "vision.enabled": True, "media_placeholder_token_id": 3})
    p = cfg.vision.patch_size * cfg.vision.merge
    gen = torch.Generator().manual_seed(3)
    images = [torch.randn(3, 2 * p, 3 * p, generator=gen), torch.randn(3, 2 * p, 2 * p, generator=gen)]
    n_img = 6 + 4
    ids = torch.randint(4, cfg.vocab_size, (1, 32), generator=gen)
    ids[0, 3:3 + n_img] = cfg.media_placeholder_token_id
    labels = torch.roll(ids, -1, 1)
    labels[0, 3:3 + n_img] = -100
    results = {}
    for mode in ("none", "full", "selective"):
        model = build_model(cfg, seed=0).train()
        model.recompute = mode
        out = model(ids, labels, images=images)
        out.loss.backward()
        results[mode] = (out.loss.detach(), {n: q.grad.clone() for n, q in model.named_parameters()
                                             if q.grad is not None})
    loss0, grads0 = results["none"]
    assert any(n.startswith("vision.blocks.") for n in grads0)
    for mode in ("full", "selective"):
        loss, grads = results[mode]
        assert torch.equal(loss, loss0), mode
        assert grads.keys() == grads0.keys()
        for n in grads0:
            assert torch.equal(grads[n], grads0[n]), (mode, n)
