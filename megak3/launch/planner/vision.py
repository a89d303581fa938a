"""The vision tower's load in a plan.

Images (PlanConfig.vision_fraction = data.vision_fraction, image_side; 0 = text only: the plan is
exactly the text plan, no vision keys). vision_fraction of every row's tokens are <|media|> tokens
of square images of image_side px (default the position grid: 64 x 64 patches, 1024 tokens at K3);
vision_figures() has the load. The tower runs in stage 0's forward; under activation checkpointing
its blocks are recomputed like the decoder layers (VisionTower.recompute, set with K3Model.recompute),
so each keeps only its input. Stage 0 keeps, for every micro-batch in
flight, ceil(images per micro-batch / tp) whole images' saved tensors (TP round robin,
parallel/tensor_parallel/image_split.py) -- vision_activation_bytes(), linear in the patches (the
tower's attention runs a fused SDPA kernel: no [H, N, N] scores are kept) -- and its largest block
of one image as a backward transient. Step time: stage 0's compute
+ 3 x the tower's forward FLOPs of the step (+ the blocks' forward again when recomputed) over the stage's ranks; its TP traffic
+ the all-gather of the merged tokens ((tp-1)/tp x vision tokens x hidden x activation bytes per
micro-batch, forward only). MFU counts the tower's FLOPs. Images under CP are refused (as the
trainer does).
"""
from __future__ import annotations

import math

from ...config import ModelConfig
from .config import PlanConfig, _ring


def vision_image(cfg: ModelConfig, pc: PlanConfig) -> tuple:
    """(h, w) patches of the image a plan assumes: image_side / patch_size a side (square), or the
    position grid (pos_grid x pos_grid) when image_side is 0. Raises ValueError when images cannot
    be planned: the tower disabled, cp > 1 (K3Model.embed refuses images under CP), a side that is
    not a multiple of patch_size x merge, or an image with more LM tokens than a row holds (packing
    never splits an image across rows)."""
    v = cfg.vision
    if not v.enabled:
        raise ValueError(f"data.vision_fraction={pc.vision_fraction} needs model.vision.enabled=true")
    if pc.cp > 1:
        raise ValueError(f"data.vision_fraction={pc.vision_fraction} with parallel.cp={pc.cp}: images under context "
                         "parallelism are not supported (K3Model.embed refuses them); plan image-text data with cp=1")
    side = v.patch_size * v.merge
    if pc.image_side:
        if pc.image_side % side:
            raise ValueError(f"data.image_side={pc.image_side} must be a multiple of patch_size x merge = {side} "
                             "(the preprocessor snaps images to that grid)")
        h = w = pc.image_side // v.patch_size
    else:
        h = w = v.pos_grid
    tokens = (h // v.merge) * (w // v.merge)
    if tokens > pc.seq_len:
        raise ValueError(f"an image of {h} x {w} patches is {tokens} LM tokens, more than data.seq_len={pc.seq_len}; "
                         "use a smaller data.image_side")
    return h, w


def vision_block_flops_per_patch(cfg: ModelConfig, patches: int) -> float:
    """The blocks' share of :func:`vision_flops_per_patch` (what recomputation reruns):
    2 x (qkv, proj, fc1, fc2 weights) + 4 x qkv width x patches, per layer."""
    v = cfg.vision
    qkv = v.num_heads * v.head_dim
    return v.num_layers * (2.0 * (4 * v.hidden_size * qkv + 2 * v.hidden_size * v.intermediate_size)
                           + 4.0 * qkv * patches)


def vision_flops_per_patch(cfg: ModelConfig, patches: int) -> float:
    """Forward FLOPs of the tower per patch of an image of ``patches`` patches: 2 x its GEMM weights
    (patch embedding, qkv, proj, fc1, fc2; the merger once per merge^2 patches; no FLOPs for the
    position table) + QK^T and AV over the image's patches, 4 x layers x qkv width x patches.
    Equals torch's FLOP counter on the tower (tests/test_vision_parallel.py)."""
    v = cfg.vision
    D, qkv, m2 = v.hidden_size, v.num_heads * v.head_dim, v.merge ** 2
    gemm = (v.in_channels * v.patch_size ** 2 * D                    # patch embedding
            + v.num_layers * (4 * D * qkv + 2 * D * v.intermediate_size)  # qkv, proj, fc1, fc2
            + (m2 * D * v.projector_hidden + v.projector_hidden * cfg.hidden_size) / m2)  # merger: 1 per m^2
    return 2.0 * gemm + 4.0 * v.num_layers * qkv * patches


def vision_activation_bytes(cfg: ModelConfig, h: int, w: int, precision: str = "bf16",
                            param_dtype: str = "fp32", recompute: bool = False) -> dict:
    """Bytes the tower saves for backward for ONE image of h x w patches, as megak3/model/vision.py
    runs it (counted from its autograd graph; tests/test_plan_vision.py measures them). Per patch
    (N = h w, D width, Q = heads x head_dim, I MLP width, P projector width, m merge; r = residual
    stream bytes: 4 with fp32 params, since the fp32 pos_embed promotes it; l = bytes of Linear
    inputs and GELU in/out: 2 under bf16 autocast, else 4):
      patch embedding  C p^2 l             the patchified copy (Linear input)
      each block       2 x RMSNorm (4D fp32 input + rD normalised + 4 B rstd) + 2 x D l (qkv, fc1 inputs)
                       + Q l (proj input) + 2 I l (GELU input and output)
                       + attention: SDPA gets 4-D [1, H, N, K] q/k/v, so a fused kernel runs (CPU
                         flash; on CUDA flash / memory-efficient), which saves q, k, v (views of the
                         qkv output: 3Q l), the output (the proj input above: its [N, H, K] layout
                         makes the reshape a view) and the fp32 logsumexp (H x 4) -- linear in N.
                         (Before the tower passed 4-D inputs, the math path kept an fp32 [H, N, N]
                         softmax: 5.3 MB per patch of a 64 x 64-patch image at K3.)
      final norm       4D + rD + 4
      merger           (4D + rD + lD) per patch (its norm on the merged copy, fc1 input) + (4 + 2 P l) / m^2
    The merged tokens, the TP gather and the splice save nothing of size. ``recompute`` (the tower's
    blocks rerun in backward: megak3/model/vision.py under ``K3Model.recompute`` != 'none'): each
    block keeps only its input (r D per patch) instead of the terms above. Returns per_patch,
    per_block (one block, the whole image: the largest single module, also what one block's
    recomputation holds at once) and total."""
    v = cfg.vision
    N, D, Q, I = h * w, v.hidden_size, v.num_heads * v.head_dim, v.intermediate_size
    m2, P = v.merge ** 2, v.projector_hidden
    lin = 2 if precision == "bf16" or param_dtype == "bf16" else 4
    res = 4 if param_dtype == "fp32" else 2
    norm = 4 * D + res * D + 4
    block = 2 * (norm + D * lin) + Q * lin + 2 * I * lin + 3 * Q * lin + v.num_heads * 4
    per_patch = (v.in_channels * v.patch_size ** 2 * lin + v.num_layers * (res * D if recompute else block) + norm
                 + 4 * D + res * D + lin * D + (4 + 2 * P * lin) / m2)
    return {"per_patch": float(per_patch), "per_block": float(block * N), "total": float(per_patch * N)}


def vision_figures(cfg: ModelConfig, pc: PlanConfig) -> dict:
    """The vision tower's load, memory, FLOPs and traffic in a plan with pc.vision_fraction > 0
    ({} otherwise). The tower runs in the first pipeline stage's forward (K3Model.embed); with
    activation checkpointing its blocks are recomputed like the decoder layers (each keeps its input;
    training = 3 x forward + the blocks' forward again), without it they keep everything (3 x
    forward). Its saved tensors stay for every micro-batch in flight on stage 0. Under TP a
    rank encodes images r, r + tp, ... of its micro-batch and the merged tokens are all-gathered
    (parallel/tensor_parallel/image_split.py); DP ranks get their rows' images.

    images_per_micro_batch: vision_fraction x mbs x seq_len / tokens_per_image (a mean, may be < 1);
    images_per_rank: ceil(images_per_micro_batch / tp), whole images -- a micro-batch that holds an
    image holds all of it, and round robin gives the first TP ranks the extra one -- so the memory is
    that of the worst rank; activations_per_micro_batch: images_per_rank x vision_activation_bytes;
    train_flops_per_step: 3 x patches of the step x vision_flops_per_patch (spread over the stage's
    ranks in the step time: round robin balances by count); gather_bytes_per_micro_batch: what one
    rank sends in the token all-gather, (tp-1)/tp x vision tokens x text width x activation bytes."""
    if not pc.vision_fraction:
        return {}
    v = cfg.vision
    h, w = vision_image(cfg, pc)
    patches = h * w
    tokens_img = (h // v.merge) * (w // v.merge)
    vis_tokens_mb = pc.vision_fraction * pc.micro_batch_size * pc.seq_len
    images_mb = vis_tokens_mb / tokens_img
    images_rank = math.ceil(images_mb / pc.tp - 1e-9)
    act = vision_activation_bytes(cfg, h, w, pc.precision, pc.param_dtype, pc.activation_checkpointing)
    a = 2 if pc.precision == "bf16" else 4
    tokens_step = pc.global_batch_size * pc.seq_len
    fwd = vision_flops_per_patch(cfg, patches)
    train = 3.0 * fwd + (vision_block_flops_per_patch(cfg, patches) if pc.activation_checkpointing else 0.0)
    return {"fraction": pc.vision_fraction, "image_patches": [h, w], "image_side": h * v.patch_size,
            "patches_per_image": patches, "tokens_per_image": tokens_img,
            "vision_tokens_per_micro_batch": vis_tokens_mb, "images_per_micro_batch": images_mb,
            "images_per_rank": images_rank, "images_per_step": pc.vision_fraction * tokens_step / tokens_img,
            "vision_tokens_per_step": pc.vision_fraction * tokens_step,
            "flops_per_patch_forward": fwd,
            "train_flops_per_step": train * pc.vision_fraction * tokens_step * v.merge ** 2,
            "activation_bytes_per_image": act["total"],
            "activation_bytes_per_patch": act["total"] / patches, "block_bytes_per_image": act["per_block"],
            "activations_per_micro_batch": images_rank * act["total"],
            "gather_bytes_per_micro_batch": _ring(pc.tp) * vis_tokens_mb * cfg.hidden_size * a}
