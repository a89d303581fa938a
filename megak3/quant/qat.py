"""Quantization-aware training as K3 does it (K3_SPEC.md §10.1; mechanics are an ASSUMPTION, §17).

``apply_quantization(model, qcfg)`` with ``qcfg.qat == "mxfp4_experts"`` sets the hooks of every
``GroupedExperts`` (megak3/model/moe.py):

    weight_quant = MXFP4 fake-quant   on w1, w3 [E, m, L] and w2 [E, L, m]: blocks of 32 along the
                                      LAST (input) dim, exactly the released ``weight_scale`` layout
    act_quant    = MXFP8 fake-quant   on both GEMM inputs, z [X, L] and the SiTU-GLU hidden h [X, m]:
                                      blocks of 32 along the reduction dim

Forward uses ``dequant(quant(master))``; backward is straight-through (identity), so the optimizer
keeps updating the high-precision masters. Nothing else is quantized: attention, router, shared
experts, latent projections, embeddings and lm_head stay in high precision (K3's split). The hooks
change no parameter or buffer, so a full-precision checkpoint resumes into QAT (and back) as is;
``qat="none"`` removes them. ``qcfg.fp8`` is handed to megak3/quant/te.py.
"""
from __future__ import annotations

from typing import List

import torch
from torch import nn

from megak3.model.moe import GroupedExperts

from .config import QuantConfig
from .mx import fake_quant

BLOCK = 32  # OCP MX block; K3's weight_scale is [out, in/32]


class MXFakeQuant:
    """Picklable callable ``x -> fake_quant(x, fmt, block_size, scale_mode)`` with an STE gradient."""

    def __init__(self, fmt: str, block_size: int = BLOCK, scale_mode: str = "floor"):
        self.fmt, self.block_size, self.scale_mode = fmt, block_size, scale_mode

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant(x, self.fmt, self.block_size, self.scale_mode)

    def __eq__(self, other) -> bool:
        return isinstance(other, MXFakeQuant) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"MXFakeQuant({self.fmt}, block={self.block_size}, {self.scale_mode})"


def expert_modules(model: nn.Module) -> List[GroupedExperts]:
    """Every GroupedExperts in ``model`` (in module order)."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def set_expert_qat(experts: GroupedExperts, enabled: bool, scale_mode: str = "floor") -> None:
    """Switch MXFP4-weight / MXFP8-activation QAT on or off for one GroupedExperts."""
    if not enabled:
        experts.weight_quant = experts.act_quant = None
        return
    E, m, L = experts.w1.shape
    for field, val in (("latent_size", L), ("expert_intermediate_size", m)):
        if val % BLOCK:
            raise ValueError(f"quant.qat=mxfp4_experts needs model.moe.{field}={val} to be a multiple of "
                             f"{BLOCK} (one MX block per 32 input elements); change it or use quant.qat=none")
    experts.weight_quant = MXFakeQuant("fp4_e2m1", BLOCK, scale_mode)
    experts.act_quant = MXFakeQuant("fp8_e4m3", BLOCK, scale_mode)


def apply_quantization(model: nn.Module, qcfg: QuantConfig) -> nn.Module:
    """Apply ``qcfg`` to an already built (possibly already trained) model, in place; returns it.

    Call after loading weights is fine, but before building the optimizer when ``qcfg.fp8 == "te"``
    (TE modules own new Parameters). Idempotent; calling it with another config switches modes.
    """
    qcfg.validate()
    experts = expert_modules(model)
    if qcfg.qat == "mxfp4_experts" and not experts:
        raise ValueError("quant.qat=mxfp4_experts but the model has no routed experts "
                         "(model.first_k_dense covers every layer); use quant.qat=none")
    for ex in experts:
        set_expert_qat(ex, qcfg.qat == "mxfp4_experts", qcfg.scale_mode)
    if qcfg.fp8 != "none" or any(type(m).__name__ == "MXFP8Linear" for m in model.modules()):
        from .te import apply_fp8

        apply_fp8(model, qcfg)
    return model
