"""K3 router: sigmoid scores on the full-width x, biased top-k selection, unbiased weights.

K3_SPEC.md §7.1 / §14 ``k3_route`` (NEMO ``KimiK3Gate``, ``topk_method=noaux_tc`` with one group):

    s_TE      = sigmoid(x_TD @ W_ED^T)                    fp32 (at least), no bias term
    idx_TK    = argtopk_k(s_TE + b_E)                      b = e_score_correction_bias, selection only
    w_TK      = s.gather(idx) / (sum_k s.gather(idx) + 1e-20) * routed_scaling_factor

The correction bias ``b`` is set by Quantile Balancing (megak3/model/balancing.py), receives no
gradient and is not an optimizer parameter; it is a persistent fp32 buffer so it is saved in
checkpoints (the released model freezes it for inference). Because ``w`` is computed from ``s``
alone, b changes which experts a token uses but never how much each contributes.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class RouterOutput(NamedTuple):
    weights_TK: torch.Tensor
    """renormalised mixture weights of the selected experts, fp32 (fp64 for fp64 inputs); carries grad"""
    indices_TK: torch.Tensor
    """selected expert ids, int64, unsorted within a token"""
    scores_TE: torch.Tensor
    """sigmoid scores of all experts, fp32; these feed Quantile Balancing"""


class Router(nn.Module):
    """x_TD -> RouterOutput. Parameter ``weight`` [E, D]; buffer ``e_score_correction_bias`` [E] fp32."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"Router: top_k={top_k} must lie in [1, num_experts={num_experts}] "
                             "(model.moe.top_k / model.moe.num_experts)")
        self.num_experts, self.top_k = num_experts, top_k
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32),
                             persistent=True)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) would also cast the bias; QB moves it by amounts far below bf16
        # resolution near 0.5-scale scores, so it must stay fp32 (NEMO keeps it fp32 as well).
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if moved.dtype != torch.float32:
            self.e_score_correction_bias = bias.to(device=moved.device, dtype=torch.float32)
        return self

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        if x_TD.dim() != 2 or x_TD.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"Router: x must be [T, {self.weight.shape[1]}], got {tuple(x_TD.shape)} "
                             "(flatten batch and sequence first)")
        dt = torch.promote_types(x_TD.dtype, torch.float32)
        scores_TE = torch.sigmoid(x_TD.to(dt) @ self.weight.to(dt).T)
        with torch.no_grad():  # selection is discrete; the bias must not enter the autograd graph
            biased_TE = scores_TE + self.e_score_correction_bias.to(dt)
            indices_TK = biased_TE.topk(self.top_k, dim=-1, sorted=False).indices
        picked_TK = scores_TE.gather(1, indices_TK)
        weights_TK = picked_TK / (picked_TK.sum(-1, keepdim=True) + 1e-20) * self.routed_scaling_factor
        return RouterOutput(weights_TK, indices_TK, scores_TE)

    def extra_repr(self) -> str:
        return (f"hidden={self.weight.shape[1]}, experts={self.num_experts}, top_k={self.top_k}, "
                f"scale={self.routed_scaling_factor}")
