"""The K3 KDA decay gate (K3_SPEC §4.1) and the gate range in which fla may use its safe_gate tiles."""
from __future__ import annotations

import torch

FLA_SAFE_GATE_MIN = -5.0  # fla's safe_gate tiles assume g in [-5, 0) (fla's chunk_kda docstring)


def fla_safe_gate(lower_bound: float | None) -> bool:
    """Whether fla may use its safe_gate tiles for gates built with ``lower_bound``: only inside
    fla's safe range [-5, 0). Below it their in-tile decay factors overflow fp32 (NaN/inf output at
    a bound of -12), so fla runs its general path, which is exact for any g <= 0."""
    return lower_bound is not None and FLA_SAFE_GATE_MIN <= lower_bound < 0


def kda_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float = -5.0
             ) -> torch.Tensor:
    """K3 lower-bounded KDA decay gate (K3_SPEC §4.1, §14 `kda_gate`).

    Args:
        z: gate pre-activations `[..., H*K]` or `[..., H, K]` (`[..., H, K]` is checked first).
        A_log: `[H]` log decay rate per head.
        dt_bias: `[H*K]` bias per head and key channel.
        lower_bound: g_min < 0 (K3: -5.0).
    Returns:
        g `[..., H, K]` fp32 log-decay, `lower_bound * sigmoid(exp(A_log)[h] * (z + dt_bias))` in (lb, 0).
    """
    if lower_bound >= 0:
        raise ValueError(f"kda_gate: lower_bound={lower_bound} must be negative (K3 uses -5.0)")
    H = A_log.numel()
    if H == 0 or dt_bias.numel() % H != 0:
        raise ValueError(f"kda_gate: dt_bias has {dt_bias.numel()} elements, need H*K with H=A_log.numel()={H}")
    K = dt_bias.numel() // H
    if z.dim() >= 2 and tuple(z.shape[-2:]) == (H, K):
        z_HK = z.float()
    elif z.shape[-1] == H * K:
        z_HK = z.float().reshape(*z.shape[:-1], H, K)
    else:
        raise ValueError(f"kda_gate: z has shape {tuple(z.shape)}; expected [..., {H * K}] or [..., {H}, {K}]")
    rate_H1 = A_log.float().exp().view(H, 1)
    return lower_bound * torch.sigmoid(rate_H1 * (z_HK + dt_bias.float().view(H, K)))
