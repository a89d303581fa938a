"""Scaled MoonViT-V2-style native image encoder + projector (K3_SPEC.md §1.2, §8).

Pipeline for one image ``[C, H, W]`` with patch side ``p`` and merge factor ``m``::

    patchify -> [h*w, C*p*p]           h = H/p, w = W/p (row-major patch order)
    patch_embed (Linear, no bias)      == a stride-p Conv2d, as a GEMM
    + pos_embed [G, G, D] bilinearly resized to [h, w, D] (identity when h == w == G)
    blocks x L: x + MHA(RMSNorm(x)); x + MLP(RMSNorm(x))   full bidirectional attention within the image
    final_norm
    merger: m x m neighbourhoods -> [h/m * w/m, m*m*D] -> RMSNorm -> Linear -> GELU -> Linear -> text width

Shape suffixes: ``N`` patches of one image, ``D`` encoder width, ``P`` flattened patch C*p*p,
``M`` merged tokens of one image, ``E`` text width, ``B``/``T`` text batch/tokens.

Scope: images only (a single frame). K3 also adds a fixed sin-cos temporal embedding and pools
over time for video (``sd2_tpool``); that is not implemented. The NEMO reference also defines a
2-D vision RoPE whose per-layer use is unverified (K3_SPEC.md §17); only the learned 2-D grid is
used here. Images of different sizes are encoded one at a time: at this scale a per-image loop
is simplest and needs no attention mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megak3.config import VisionConfig
from megak3.model.norm import RMSNorm
from megak3.model.recompute import recompute_whole


def num_image_tokens(H, W, patch_size: int, merge: int):
    """LM tokens of one H x W image: (H / (p*m)) * (W / (p*m)) merged patches; the data pipeline
    reserves exactly this many ``<|media|>`` slots (works element-wise on integer arrays too)."""
    side = patch_size * merge
    return (H // side) * (W // side)


def patchify(image_CHW: torch.Tensor, p: int) -> torch.Tensor:
    """[C, H, W] -> [h*w, C*p*p], patches row-major; each patch flattened (C, py, px) like a
    Conv2d weight ``[D, C, p, p]`` so ``patch_embed`` equals a stride-p convolution."""
    C, H, W = image_CHW.shape
    h, w = H // p, W // p
    x = image_CHW.reshape(C, h, p, w, p).permute(1, 3, 0, 2, 4)  # [h, w, C, p, p]
    return x.reshape(h * w, C * p * p)


def interp_pos_embed(pos_GGD: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Bilinearly resize the learned grid [G, G, D] to [h, w, D] (align_corners=False).

    Returned unchanged when the grid already matches, so a G x G-patch image sees the raw table.
    """
    if pos_GGD.shape[0] == h and pos_GGD.shape[1] == w:
        return pos_GGD
    x = pos_GGD.permute(2, 0, 1).unsqueeze(0)  # [1, D, G, G]
    # interpolate in fp32: bilinear weights in bf16 would quantise the table visibly
    x = F.interpolate(x.float(), size=(h, w), mode="bilinear", align_corners=False)
    return x[0].permute(1, 2, 0).to(pos_GGD.dtype)


def merge_patches(x_hwD: torch.Tensor, m: int) -> torch.Tensor:
    """[h, w, D] -> [(h/m)*(w/m), m*m*D]: each m x m neighbourhood concatenated in (dy, dx) order,
    merged tokens row-major over the (h/m, w/m) grid (the 2x2 "pixel shuffle" of §1.2)."""
    h, w, D = x_hwD.shape
    x = x_hwD.reshape(h // m, m, w // m, m, D).permute(0, 2, 1, 3, 4)  # [h/m, w/m, dy, dx, D]
    return x.reshape((h // m) * (w // m), m * m * D)


class VisionAttention(nn.Module):
    """Multi-head self-attention over one image's patches, fused qkv, no biases."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv = nn.Linear(hidden, 3 * num_heads * head_dim, bias=False)  # rows: [q | k | v], head-major
        self.proj = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        N = x_ND.shape[0]
        qkv = self.qkv(x_ND).view(N, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3)  # [3, H, N, K]
        # 4-D [1, H, N, K]: the fused (flash / memory-efficient) SDPA kernels take only 4-D inputs;
        # 3-D falls back to the math path, which keeps a full [H, N, N] fp32 softmax per layer
        q, k, v = (t.unsqueeze(0) for t in qkv)
        o_HNK = F.scaled_dot_product_attention(q, k, v)[0]  # bidirectional: no mask
        return self.proj(o_HNK.transpose(0, 1).reshape(N, self.num_heads * self.head_dim))


class VisionMLP(nn.Module):
    """fc1 -> GELU(tanh) -> fc2, no biases (MoonViT ``mlp2`` / ``gelu_pytorch_tanh``)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, bias=False)
        self.fc2 = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)); x + mlp(norm2(x))."""

    def __init__(self, vcfg: VisionConfig, eps: float):
        super().__init__()
        self.norm1 = RMSNorm(vcfg.hidden_size, eps)
        self.attn = VisionAttention(vcfg.hidden_size, vcfg.num_heads, vcfg.head_dim)
        self.norm2 = RMSNorm(vcfg.hidden_size, eps)
        self.mlp = VisionMLP(vcfg.hidden_size, vcfg.intermediate_size)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        x_ND = x_ND + self.attn(self.norm1(x_ND))
        return x_ND + self.mlp(self.norm2(x_ND))


class PatchMerger(nn.Module):
    """m x m spatial merge + projector: RMSNorm(m*m*D) -> Linear -> GELU -> Linear -> text width.

    The projector layout follows K3_SPEC.md §2.2's assumption (norm, 4096 -> 4096 GELU -> 7168,
    ~46M at full size); ``patchmergerv2`` internals are unverified. Exact (erf) GELU as in the
    Kimi-VL MoonViT merger; the encoder MLP uses the tanh form.
    """

    def __init__(self, hidden: int, merge: int, projector_hidden: int, text_hidden: int, eps: float):
        super().__init__()
        self.merge = merge
        self.norm = RMSNorm(merge * merge * hidden, eps)
        self.fc1 = nn.Linear(merge * merge * hidden, projector_hidden, bias=False)
        self.fc2 = nn.Linear(projector_hidden, text_hidden, bias=False)

    def forward(self, x_hwD: torch.Tensor) -> torch.Tensor:
        """[h, w, D] -> [M, E] with M = (h/m)*(w/m)."""
        return self.fc2(F.gelu(self.fc1(self.norm(merge_patches(x_hwD, self.merge)))))


class VisionTower(nn.Module):
    """MoonViT-V2-style encoder + projector; ``forward(images) -> [n_i, text_hidden_size]`` each.

    Parameter names (under ``vision.``): ``patch_embed.weight [D, C*p*p]``, ``pos_embed [G, G, D]``,
    ``blocks.{i}.{norm1,norm2}.weight``, ``blocks.{i}.attn.{qkv,proj}.weight``,
    ``blocks.{i}.mlp.{fc1,fc2}.weight``, ``final_norm.weight``, ``merger.{norm,fc1,fc2}.weight``.
    ``pos_embed`` is left to the default N(0, std) initialisation.
    """

    def __init__(self, vcfg: VisionConfig, text_hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.vcfg = vcfg
        p, D = vcfg.patch_size, vcfg.hidden_size
        # A Linear over flattened patches is a stride-p Conv2d without bias, as one GEMM.
        self.patch_embed = nn.Linear(vcfg.in_channels * p * p, D, bias=False)
        self.pos_embed = nn.Parameter(torch.empty(vcfg.pos_grid, vcfg.pos_grid, D))
        nn.init.normal_(self.pos_embed, std=0.02)  # overwritten by init_model; avoids garbage if unused
        self.blocks = nn.ModuleList(VisionBlock(vcfg, eps) for _ in range(vcfg.num_layers))
        self.final_norm = RMSNorm(D, eps)
        self.merger = PatchMerger(D, vcfg.merge, vcfg.projector_hidden, text_hidden_size, eps)
        self.recompute = "none"
        """``K3Model.recompute`` ('none' | 'full' | 'selective'; set through it): unless 'none', each
        block keeps only its input while training and is rerun whole in backward ('selective' too:
        the tower's blocks have no selective segments; one more forward of the blocks, which the
        planner's vision figures count)."""

    def num_tokens(self, H: int, W: int) -> int:
        """LM tokens produced for one H x W image: (H/p/m) * (W/p/m)."""
        return num_image_tokens(H, W, self.vcfg.patch_size, self.vcfg.merge)

    def _check(self, i: int, image: torch.Tensor) -> None:
        C, side = self.vcfg.in_channels, self.vcfg.patch_size * self.vcfg.merge
        if image.dim() != 3 or image.shape[0] != C:
            raise ValueError(f"images[{i}] has shape {tuple(image.shape)}; expected [C={C}, H, W] "
                             f"(model.vision.in_channels={C})")
        H, W = image.shape[1:]
        if H == 0 or W == 0 or H % side or W % side:
            raise ValueError(
                f"images[{i}] has shape {tuple(image.shape)}: H and W must be positive multiples of "
                f"patch_size*merge={side}; resize or pad the image (e.g. to "
                f"{max(side, -(-H // side) * side)}x{max(side, -(-W // side) * side)})")

    def encode(self, image_CHW: torch.Tensor) -> torch.Tensor:
        """One image [C, H, W] -> final-normed patch features [h, w, D] (before the merger)."""
        p = self.vcfg.patch_size
        h, w = image_CHW.shape[1] // p, image_CHW.shape[2] // p
        x_ND = self.patch_embed(patchify(image_CHW.to(self.patch_embed.weight.dtype), p))
        x_ND = x_ND + interp_pos_embed(self.pos_embed, h, w).reshape(h * w, -1)
        rerun = self.recompute != "none" and self.training
        for blk in self.blocks:
            x_ND = recompute_whole(blk, x_ND) if rerun else blk(x_ND)
        return self.final_norm(x_ND).view(h, w, -1)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """list of [C, H_i, W_i] -> list of [n_i, text_hidden_size], n_i = num_tokens(H_i, W_i)."""
        for i, img in enumerate(images):
            self._check(i, img)
        return [self.merger(self.encode(img)) for img in images]


def splice_image_tokens(embeds_BTD: torch.Tensor, input_ids_BT: torch.Tensor,
                        image_tokens: list[torch.Tensor], placeholder_id: int) -> torch.Tensor:
    """Out-of-place: rows of ``embeds_BTD`` where ``input_ids_BT == placeholder_id`` are replaced,
    in row-major (b, t) order, by ``torch.cat(image_tokens)`` ([sum n_i, D]).

    Gradients reach both the kept text rows and the image tokens.
    """
    mask_BT = input_ids_BT == placeholder_id
    n_slots = int(mask_BT.sum())
    counts = [int(t.shape[0]) for t in image_tokens]
    if n_slots != sum(counts):
        raise ValueError(
            f"input_ids hold {n_slots} placeholder tokens (id {placeholder_id}) but the images give "
            f"{sum(counts)} tokens (per image {counts}); insert n_i placeholder tokens per image")
    if n_slots == 0:
        return embeds_BTD
    tokens_ND = torch.cat(image_tokens).to(embeds_BTD.dtype)
    if tokens_ND.shape[-1] != embeds_BTD.shape[-1]:
        raise ValueError(f"image tokens have width {tokens_ND.shape[-1]} but text embeddings have "
                         f"{embeds_BTD.shape[-1]}; build VisionTower with text_hidden_size=model.hidden_size")
    out = embeds_BTD.clone()
    out[mask_BT] = tokens_ND  # boolean-mask assignment walks positions in row-major order
    return out
