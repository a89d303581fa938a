"""Stable LatentMoE (K3_SPEC.md §7.1, §14 ``latent_moe``; NEMO ``KimiK3MoE``).

    route on full-width x:   w_TK, idx_TK, s_TE = Router(x_TD)
    z_TL  = routed_expert_down_proj(x_TD)                       D -> L (= D/2)
    u_TL  = sum_k w_TK * E_{idx_TK}(z_TL)                        SiTU-GLU experts L -> m -> L
    y_TD  = routed_expert_up_proj(RMSNorm_L(u_TL)) + shared_experts(x_TD)

Shape legend: T tokens, D model width, L latent width, E experts, K top-k slots, X = T*K routed
rows (one per (token, slot) pair), m expert width. The router weight multiplies each expert output
*after* the expert's down-projection, in fp32 (NEMO ``apply_router_weight_after_down``). There is
no auxiliary loss: balance comes from the router bias, updated by Quantile Balancing.

``permute`` / ``GroupedExperts`` / ``unpermute`` are independent of routing so expert parallelism
(moonep/) can put a dispatch between ``permute`` and the experts and a combine before ``unpermute``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from megak3.config import ModelConfig
from megak3.ops.grouped_gemm import grouped_linear
from megak3.ops.situ import situ_glu

from .ffn import SiTUGLUMLP
from .norm import RMSNorm
from .router import Router


@dataclass
class MoEStats:
    """Router statistics of one LatentMoE call, consumed by Quantile Balancing and logging."""

    scores_TE: torch.Tensor
    """sigmoid router scores, fp32, detached"""
    tokens_per_expert_E: torch.Tensor
    """int64 number of (token, slot) selections per expert"""


# ---- routing-independent helpers (reused by expert parallelism) ------------------------------

def permute(indices_TK: torch.Tensor, num_experts: int):
    """Sort the T*K (token, slot) pairs by expert.

    Returns ``order_X`` (int64: row r of the sorted layout is flat pair ``order_X[r]`` = t*K + k),
    ``token_of_row_X`` (int64 token id of each sorted row) and ``tokens_per_expert_E`` (int64).
    The argsort is stable, so rows of one expert keep token order (deterministic layout).
    """
    if indices_TK.dim() != 2:
        raise ValueError(f"permute: indices must be [T, K], got {tuple(indices_TK.shape)}")
    flat_X = indices_TK.reshape(-1)
    order_X = torch.argsort(flat_X, stable=True)
    token_of_row_X = order_X // indices_TK.shape[1]
    tokens_per_expert_E = count_per_expert(flat_X, num_experts)
    return order_X, token_of_row_X, tokens_per_expert_E


def unpermute(y_sorted_XL: torch.Tensor, order_X: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """u_TL = sum_k weights_TK[t, k] * (row of pair (t, k)), in fp32 (at least); inverse of ``permute``.

    Rows are put back in (token, slot) order and reduced over K with a fixed-order sum instead of
    an index_add: the result is then bitwise reproducible on GPUs, where index_add uses atomics.
    """
    T, K = weights_TK.shape
    assert y_sorted_XL.shape[0] == order_X.numel() == T * K, "one sorted row per (token, slot) pair"
    inverse_X = torch.empty_like(order_X)
    inverse_X[order_X] = torch.arange(order_X.numel(), device=order_X.device)
    dt = torch.promote_types(weights_TK.dtype, torch.float32)
    rows_TKL = y_sorted_XL[inverse_X].to(dt).view(T, K, y_sorted_XL.shape[1])
    return (rows_TKL * weights_TK.to(dt).unsqueeze(-1)).sum(1)


def count_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [num_experts] selections per expert: a fixed-length scatter-add (``bincount`` sizes its
    output from the data, which is a host sync on CUDA)."""
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))


# ---- experts (their grouped GEMMs: megak3/ops/grouped_gemm.py) -----------------------------

class GroupedExperts(nn.Module):
    """E SiTU-GLU experts applied to rows already sorted by expert.

    Parameters (stacked like nn.Linear weights, out x in): ``w1`` [E, m, L] gate, ``w3`` [E, m, L]
    up, ``w2`` [E, L, m] down. ``forward(z_sorted_XL, tokens_per_expert_E) -> y_XL``, where expert e
    gets the contiguous rows ``offsets[e-1]:offsets[e]``; y has z's dtype.

    Quantization-aware training hooks (megak3/quant/qat.py sets them; None = full precision):
    ``weight_quant(w) -> w_q`` is applied to w1, w3, w2 on every forward (masters stay high precision)
    and ``act_quant(a) -> a_q`` to both GEMM inputs (z rows and the SiTU-GLU hidden). Both see
    tensors whose last dim is the GEMM's reduction dim. They live on this module so quantization
    happens wherever the expert weights live (also under expert parallelism).
    """

    def __init__(self, num_experts: int, latent_size: int, intermediate_size: int,
                 beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.num_experts = num_experts
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.use_grouped_mm: bool | str | None = None
        """GEMM implementation: None = automatic, or 'grouped_mm' | 'tiled' | 'loop' (see grouped_linear)"""
        self.weight_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, latent_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, latent_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent_size, intermediate_size))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, z_sorted_XL: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        L = self.w1.shape[2]
        if z_sorted_XL.dim() != 2 or z_sorted_XL.shape[1] != L:
            raise ValueError(f"GroupedExperts: rows must be [X, latent_size={L}], got {tuple(z_sorted_XL.shape)}")
        if tokens_per_expert_E.shape != (self.num_experts,):
            raise ValueError(f"GroupedExperts: tokens_per_expert must be [{self.num_experts}], "
                             f"got {tuple(tokens_per_expert_E.shape)}")
        return self.compute(self.w1, self.w3, self.w2, z_sorted_XL, tokens_per_expert_E)

    def compute(self, w1_GmL, w3_GmL, w2_GLm, z_sorted_XL, rows_per_group_G) -> torch.Tensor:
        """The expert math on explicit stacked weights (G groups of rows, e.g. home experts plus
        MoonEP replica slots), with this module's SiTU-GLU betas and QAT hooks."""
        gmm = self.use_grouped_mm
        w1, w3, w2 = w1_GmL, w3_GmL, w2_GLm
        if self.weight_quant is not None:
            w1, w3, w2 = self.weight_quant(w1), self.weight_quant(w3), self.weight_quant(w2)
        if self.act_quant is not None:
            z_sorted_XL = self.act_quant(z_sorted_XL)
        gate_Xm = grouped_linear(z_sorted_XL, w1, rows_per_group_G, gmm)
        up_Xm = grouped_linear(z_sorted_XL, w3, rows_per_group_G, gmm)
        h_Xm = situ_glu(gate_Xm, up_Xm, self.beta1, self.beta2)
        if self.act_quant is not None:
            h_Xm = self.act_quant(h_Xm)
        return grouped_linear(h_Xm, w2, rows_per_group_G, gmm)

    def extra_repr(self) -> str:
        E, m, L = self.w1.shape
        q = "" if self.weight_quant is None and self.act_quant is None else \
            f", weight_quant={self.weight_quant}, act_quant={self.act_quant}"
        return f"experts={E}, latent={L}, intermediate={m}, beta1={self.beta1}, beta2={self.beta2}{q}"


# ---- the layer -------------------------------------------------------------------------------

class LatentMoE(nn.Module):
    """Stable LatentMoE block: ``forward(x_TD) -> (y_TD, MoEStats)``; x must be 2-D [T, D]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        D, L, m = cfg.hidden_size, moe.latent_size, moe.expert_intermediate_size
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.gate = Router(D, moe.num_experts, moe.top_k, moe.routed_scaling_factor)
        self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
        self.experts = GroupedExperts(moe.num_experts, L, m, cfg.situ_beta1, cfg.situ_beta2)
        self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps) if moe.use_latent_norm else None
        self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        self.shared_experts = (SiTUGLUMLP(D, moe.num_shared_experts * m, cfg.situ_beta1, cfg.situ_beta2)
                               if moe.num_shared_experts > 0 else None)
        # Expert parallelism hook (moonep/, installed by parallel/expert_parallel.py): when set,
        # ``u_TL = expert_dispatch(z_TL, route, self.experts)`` replaces permute -> experts -> unpermute;
        # a dispatcher with ``overlaps = True`` also takes ``overlap=`` (the shared experts) and
        # returns ``(u_TL, overlap())``, running it while its own communication is in flight.
        self.expert_dispatch: Callable | None = None

    def forward(self, x_TD: torch.Tensor):
        route = self.gate(x_TD)                                   # validates x is [T, D]
        z_TL = self.routed_expert_down_proj(x_TD)
        shared_TD = None
        if self.expert_dispatch is not None:
            if self.shared_experts is not None and getattr(self.expert_dispatch, "overlaps", False):
                # the dispatcher runs the shared experts while its replica-weight fetch is in flight
                u_TL, shared_TD = self.expert_dispatch(z_TL, route, self.experts,
                                                       overlap=lambda: self.shared_experts(x_TD))
            else:
                u_TL = self.expert_dispatch(z_TL, route, self.experts)
            u_TL = u_TL.to(x_TD.dtype)
            tokens_per_expert_E = count_per_expert(route.indices_TK, self.num_experts)
        else:
            order_X, token_of_row_X, tokens_per_expert_E = permute(route.indices_TK, self.num_experts)
            y_sorted_XL = self.experts(z_TL[token_of_row_X], tokens_per_expert_E)
            u_TL = unpermute(y_sorted_XL, order_X, route.weights_TK).to(x_TD.dtype)
        if self.routed_expert_norm is not None:
            u_TL = self.routed_expert_norm(u_TL)
        y_TD = self.routed_expert_up_proj(u_TL)
        if self.shared_experts is not None:
            y_TD = y_TD + (self.shared_experts(x_TD) if shared_TD is None else shared_TD)
        return y_TD, MoEStats(route.scores_TE.detach(), tokens_per_expert_E)
