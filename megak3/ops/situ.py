"""SiTU and SiTU-GLU, K3's bounded replacement for SiLU / SwiGLU (K3_SPEC.md §7.2, REPORT Eq.12).

    SiTU(g)          = beta1 * tanh(g / beta1) * sigmoid(g)          in (-0.2698, beta1)
    cap(u)           = beta2 * tanh(u / beta2)                       in (-beta2, beta2)
    SiTU-GLU(g, u)   = SiTU(g) * cap(u)                              |.| < beta1 * beta2 = 100

beta * tanh(z / beta) = z + O(z^3 / beta^2), so SiTU-GLU is SwiGLU near 0 and becomes SwiGLU as
beta -> inf; the caps keep the hidden activation bounded, which is what lets K3 train its experts
in MXFP4/MXFP8 without outliers. The nonlinearities run in fp32 (NEMO ``SituAndMul``) because bf16
tanh/sigmoid near saturation loses the small slopes the backward needs; float64 inputs stay
float64 so the functions can be gradchecked. Results come back in the input dtype.
"""
from __future__ import annotations

import torch


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """At least fp32: bf16/fp16 are upcast, fp64 is kept (for gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def situ(g: torch.Tensor, beta1: float = 4.0) -> torch.Tensor:
    """SiTU(g) = beta1 * tanh(g / beta1) * sigmoid(g), elementwise; any shape, result in g's dtype."""
    gf = g.to(_compute_dtype(g))
    return (beta1 * torch.tanh(gf / beta1) * torch.sigmoid(gf)).to(g.dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """SiTU(gate) * beta2 * tanh(up / beta2); ``gate`` and ``up`` have the same shape [..., m].

    This is the hidden activation of every K3 FFN (dense, shared and routed experts); the caller
    applies the down-projection.
    """
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape "
                         "(pass the gate_proj and up_proj outputs of the same tokens)")
    dt = torch.promote_types(_compute_dtype(gate), _compute_dtype(up))
    g, u = gate.to(dt), up.to(dt)
    h = (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))
    return h.to(gate.dtype)
