"""Argument checks and the compute dtype shared by :func:`recurrent_kda` and :func:`chunk_kda`."""
from __future__ import annotations

import torch


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 inside, except fp64 inputs stay fp64 (gradcheck)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> list[int] | None:
    """Validate shapes; returns the document offsets as a python list (or None without cu_seqlens)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B,T,H,K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"k {tuple(k.shape)} and g {tuple(g.shape)} must match q {tuple(q.shape)} [B,T,H,K]")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B,T,H,V]=[{B},{T},{H},V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B,T,H]=[{B},{T},{H}], got {tuple(beta.shape)}")
    offsets = None
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (flatten the batch to [1, B*T, ...]); got B={B}")
        offsets = [int(x) for x in cu_seqlens.tolist()]
        if (cu_seqlens.dim() != 1 or len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != T
                or any(b < a for a, b in zip(offsets, offsets[1:]))):
            raise ValueError(f"cu_seqlens must be non-decreasing offsets [0, ..., T={T}], got {offsets}")
    N = B if offsets is None else len(offsets) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [N,H,K,V]=[{N},{H},{K},{v.shape[-1]}] "
                         f"(N = B or number of documents), got {tuple(initial_state.shape)}")
    return offsets
