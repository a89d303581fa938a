"""MXFP4 weights in the released K3 on-disk layout (compressed-tensors ``mxfp4-pack-quantized``).

One expert projection ``w [out, in]`` is stored as two uint8 tensors (K3_SPEC.md §10.1):

    weight_packed   uint8 [out, in/2]    two E2M1 codes per byte, element 2j in the LOW nibble
    weight_scale    uint8 [out, in/32]   E8M0 exponent byte (2^(byte-127)) per 32 input elements

The quantizer is :mod:`megak3.quant.mx`, the one the QAT forward uses (``quant.qat=mxfp4_experts``),
so ``unpack_mxfp4(*pack_mxfp4(w))`` equals ``mx.fake_quant_values(w, "fp4_e2m1")`` bit for bit
(tests/test_hf_interop.py also checks the bytes against torchao's ``to_mx``). This module only adds
what a file format needs on top of that: shape checks and the refusal of values the format cannot
carry (a NaN/Inf weight would need the E8M0 NaN byte 0xFF, which no inference engine expects).
"""
from __future__ import annotations

import torch

from megak3.quant import mx

BLOCK = 32
"""input elements per E8M0 scale (OCP MX block; the release's group_size)"""
FMT = "fp4_e2m1"


def pack_mxfp4(w_OI: torch.Tensor, scale_mode: str = "floor", name: str = "weight"):
    """``w [out, in]`` float -> (weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32]).

    ``scale_mode`` is the E8M0 rule the QAT run used (``quant.scale_mode``). Raises ValueError
    (naming ``name``) for a non-2-D tensor, ``in`` not a multiple of 32, or a non-finite value.
    """
    if w_OI.dim() != 2:
        raise ValueError(f"{name}: MXFP4 packing needs a 2-D [out, in] weight, got shape {tuple(w_OI.shape)}")
    if w_OI.shape[1] % BLOCK:
        raise ValueError(f"{name}: input dim {w_OI.shape[1]} is not a multiple of {BLOCK} (one E8M0 scale "
                         f"per {BLOCK} inputs); export the experts with --experts bf16")
    if not bool(torch.isfinite(w_OI).all()):
        raise ValueError(f"{name}: holds NaN/Inf values, which MXFP4 cannot store")
    scale, packed = mx.quantize(w_OI, FMT, BLOCK, scale_mode)
    return packed.contiguous(), scale.contiguous()


def unpack_mxfp4(weight_packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 name: str = "weight") -> torch.Tensor:
    """(weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32]) -> ``w [out, in]`` in ``dtype``.

    Exact in fp32 and bf16 (every E2M1 value times a power of two is representable; E8M0 bytes below
    ~2^-133 underflow bf16 to 0 like any bf16 value would). Raises ValueError (naming ``name``) on
    wrong dtypes or shapes, or a NaN scale byte (0xFF).
    """
    for what, t in (("weight_packed", weight_packed), ("weight_scale", weight_scale)):
        if t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"{name}.{what}: must be a 2-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
    O, half = weight_packed.shape
    if weight_scale.shape != (O, 2 * half // BLOCK) or (2 * half) % BLOCK:
        raise ValueError(f"{name}: weight_scale {tuple(weight_scale.shape)} does not match weight_packed "
                         f"{tuple(weight_packed.shape)} (expected [out, in/32] with in = 2 x {half})")
    if bool((weight_scale == mx.E8M0_NAN).any()):
        raise ValueError(f"{name}.weight_scale holds the E8M0 NaN byte 0xFF; the tensor is corrupt")
    return mx.dequantize(weight_scale, weight_packed, FMT, BLOCK, dtype)
