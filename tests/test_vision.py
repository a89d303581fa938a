"""MoonViT-V2-style vision tower: shapes, parameter count, and hand-built references."""
import pytest
import torch
import torch.nn.functional as F

from megak3.config import VisionConfig, load_model_config
from megak3.model.init import init_model
from megak3.model.vision import (VisionTower, interp_pos_embed, merge_patches, patchify,
                                 splice_image_tokens)


@pytest.fixture(scope="module")
def tiny():
    cfg = load_model_config("k3_tiny")
    torch.manual_seed(0)
    tower = init_model(VisionTower(cfg.vision, cfg.hidden_size), seed=0)
    return cfg, tower


def test_shapes_two_sizes(tiny):
    cfg, tower = tiny
    side = cfg.vision.patch_size * cfg.vision.merge  # 28
    imgs = [torch.randn(3, 2 * side, 3 * side), torch.randn(3, side, side)]
    out = tower(imgs)
    assert [tuple(o.shape) for o in out] == [(6, cfg.hidden_size), (1, cfg.hidden_size)]
    assert tower.num_tokens(2 * side, 3 * side) == 6
    # per-image processing: the second image's tokens do not depend on the first image
    alone = tower([imgs[1]])[0]
    torch.testing.assert_close(out[1], alone)


def test_bad_image_side_raises(tiny):
    _, tower = tiny
    with pytest.raises(ValueError, match=r"images\[1\].*multiples of patch_size\*merge=28"):
        tower([torch.randn(3, 28, 28), torch.randn(3, 28, 42)])
    with pytest.raises(ValueError, match=r"images\[0\].*C=3"):
        tower([torch.randn(1, 28, 28)])


def test_full_config_param_count_on_meta():
    vcfg = VisionConfig()  # defaults = NEMO KimiK3VisionConfig: 27 x 1024, 12 x 128, 4096, grid 64
    with torch.device("meta"):
        tower = VisionTower(vcfg, text_hidden_size=7168)
    count = lambda m: sum(p.numel() for p in m.parameters())
    per_block = 2 * 1024 + 1024 * 3 * 1536 + 1536 * 1024 + 1024 * 4096 + 4096 * 1024
    assert per_block == 14_682_112 and count(tower.blocks[0]) == per_block
    assert count(tower.patch_embed) == 3 * 14 * 14 * 1024 == 602_112
    assert tower.pos_embed.numel() == 64 * 64 * 1024 == 4_194_304
    encoder = count(tower) - count(tower.merger)
    assert encoder == 27 * 14_682_112 + 602_112 + 4_194_304 + 1024 == 401_214_464  # "401.2M"
    # projector (K3_SPEC §2.2 assumption): norm(4096) + 4096x4096 + 4096x7168 ~ 46M
    assert count(tower.merger) == 4096 + 4096 * 4096 + 4096 * 7168 == 46_141_440


def test_patch_embed_equals_strided_conv(tiny):
    _, tower = tiny
    p, D = tower.vcfg.patch_size, tower.vcfg.hidden_size
    img = torch.randn(3, 2 * p, 3 * p, dtype=torch.float64)
    W = tower.patch_embed.weight.detach().double()
    ref = F.conv2d(img[None], W.view(D, 3, p, p), stride=p)[0]  # [D, 2, 3]
    ours = patchify(img, p) @ W.T  # [6, D]
    torch.testing.assert_close(ours, ref.permute(1, 2, 0).reshape(6, D))


def test_pos_embed_interpolation():
    g = torch.randn(5, 5, 4)
    assert interp_pos_embed(g, 5, 5) is g  # identity when the grid matches
    # F.interpolate's bilinear on the identical grid size also reproduces the table exactly
    same = F.interpolate(g.permute(2, 0, 1)[None], size=(5, 5), mode="bilinear", align_corners=False)
    torch.testing.assert_close(same[0].permute(1, 2, 0), g)
    # constant along columns, linear along rows -> upsampled rows stay constant; shape [h, w, D]
    lin = torch.arange(4.0).view(4, 1, 1).expand(4, 4, 2).contiguous()
    up = interp_pos_embed(lin, 8, 6)
    assert up.shape == (8, 6, 2)
    torch.testing.assert_close(up[:, 0, 0], up[:, 5, 1])
    # align_corners=False: output row i samples source row (i + 0.5) * 4/8 - 0.5, clamped at 0
    expect = ((torch.arange(8.0) + 0.5) * 0.5 - 0.5).clamp(0, 3)
    torch.testing.assert_close(up[:, 0, 0], expect)


def test_merge_groups_neighbourhoods():
    h, w = 4, 6
    # feature of patch (r, c) is [r, c]: each merged token must hold (2i,2j),(2i,2j+1),(2i+1,2j),(2i+1,2j+1)
    feat = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1).float()
    merged = merge_patches(feat, 2)
    assert merged.shape == (h // 2 * w // 2, 8)
    for i in range(h // 2):
        for j in range(w // 2):
            want = [2 * i, 2 * j, 2 * i, 2 * j + 1, 2 * i + 1, 2 * j, 2 * i + 1, 2 * j + 1]
            assert merged[i * (w // 2) + j].tolist() == want


def test_splice_order_and_count_error():
    D, ph = 3, 7
    embeds = torch.zeros(2, 5, D)
    ids = torch.tensor([[1, 7, 7, 2, 7], [7, 4, 5, 6, 9]])
    toks = [torch.full((3, D), 1.0), torch.full((1, D), 2.0)]
    toks[0][1] = 1.5
    out = splice_image_tokens(embeds, ids, toks, ph)
    assert embeds.abs().sum() == 0  # out-of-place
    assert out[0, 1, 0] == 1.0 and out[0, 2, 0] == 1.5 and out[0, 4, 0] == 1.0 and out[1, 0, 0] == 2.0
    assert out[ids != ph].abs().sum() == 0
    with pytest.raises(ValueError, match=r"4 placeholder tokens.*3 tokens.*insert n_i placeholder"):
        splice_image_tokens(embeds, ids, toks[:1], ph)


def test_backward_reaches_vision_and_text(tiny):
    cfg, tower = tiny
    tower.zero_grad()
    emb = torch.nn.Embedding(16, cfg.hidden_size)
    img = torch.randn(3, 28, 56)
    n = tower.num_tokens(28, 56)
    ids = torch.tensor([[1] + [3] * n + [5, 6]])
    x = splice_image_tokens(emb(ids), ids, tower([img]), placeholder_id=3)
    (x * torch.randn_like(x)).sum().backward()
    assert tower.patch_embed.weight.grad.abs().sum() > 0
    assert tower.pos_embed.grad.abs().sum() > 0
    g = emb.weight.grad
    assert g[[1, 5, 6]].abs().sum(-1).min() > 0 and g[3].abs().sum() == 0  # placeholders overwritten
