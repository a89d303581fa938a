"""RMSNorm as K3 uses it: y = w * (x_fp32 * rsqrt(mean(x^2) + eps)).to(dtype) (K3_SPEC.md §3)."""
from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Functional RMSNorm over the last dim; statistics in fp32, result in x's dtype."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight


class RMSNorm(nn.Module):
    """Learnable-weight RMSNorm (weight initialised to 1)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def init_param(self, name, param, gen, std) -> bool:
        param.data.fill_(1.0)
        return True

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
