"""Quantization settings of a training job (K3_SPEC.md §10): QAT of the routed experts and FP8 dense GEMMs.

Values live in ``conf/quant/<name>.yaml``; ``validate()`` raises ``ValueError`` naming
``quant.<field>`` and the fix, before any module is touched.
"""
from __future__ import annotations

from dataclasses import dataclass

QAT_MODES = ("none", "mxfp4_experts")
SCALE_MODES = ("floor", "rceil")
FP8_MODES = ("none", "te", "emulate")


@dataclass
class QuantConfig:
    """Which parts of the model train quantization-aware, and how."""

    qat: str = "none"
    """'none' or 'mxfp4_experts' (routed expert weights MXFP4, both expert GEMM inputs MXFP8; K3's split)"""
    scale_mode: str = "floor"
    """E8M0 scale rule: 'floor' (OCP, K3-compatible default) or 'rceil' (cuBLAS/NVIDIA, never saturates)"""
    fp8: str = "none"
    """dense linears in FP8: 'none', 'te' (Transformer Engine on a CUDA GPU) or 'emulate' (MXFP8 fake-quant, any device)"""

    def validate(self) -> "QuantConfig":
        for name, allowed in (("qat", QAT_MODES), ("scale_mode", SCALE_MODES), ("fp8", FP8_MODES)):
            val = getattr(self, name)
            if val not in allowed:
                raise ValueError(f"quant.{name}={val!r}: choose one of {', '.join(map(repr, allowed))}")
        return self
