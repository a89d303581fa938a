"""The token-by-token KDA recurrence (K3_SPEC §4.2): the reference twin of the chunked form and of
fla's kernels, and the exact one-token step of generation.

Per head, state S in R^{K x V}, alpha_t = exp(g_t) per key channel:
    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (q_t * scale)

Shape suffixes: B batch, T tokens, H heads, K key dim, V value dim, N documents/states.
"""
from __future__ import annotations

import torch

from .checks import _check_inputs, _compute_dtype


def _recurrent_scan(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV):
    """Token-by-token recurrence on pre-scaled q in the compute dtype; returns (o_BTHV, S_BHKV)."""
    alpha_BTHK = g_BTHK.exp()
    outs = []
    for t in range(q_BTHK.shape[1]):
        S_BHKV = S_BHKV * alpha_BTHK[:, t, :, :, None]                       # decay key rows
        k_BHK = k_BTHK[:, t]
        pred_BHV = (k_BHK.unsqueeze(-2) @ S_BHKV).squeeze(-2)               # S^T k
        delta_BHV = v_BTHV[:, t] - pred_BHV
        S_BHKV = S_BHKV + (beta_BTH[:, t, :, None] * k_BHK).unsqueeze(-1) * delta_BHV.unsqueeze(-2)
        outs.append((q_BTHK[:, t].unsqueeze(-2) @ S_BHKV).squeeze(-2))
    o_BTHV = torch.stack(outs, 1) if outs else v_BTHV.new_zeros(v_BTHV.shape)
    return o_BTHV, S_BHKV


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    """Exact token-by-token KDA (K3_SPEC §4.2, FLA `naive_recurrent_kda` operational order).

    Args:
        q, k: `[B,T,H,K]` (already L2-normalised by the layer; not normalised here).
        v: `[B,T,H,V]`.  g: `[B,T,H,K]` log-decay <= 0.  beta: `[B,T,H]`.
        scale: query scale, default K**-0.5.
        initial_state: `[N,H,K,V]`, N = B (or number of documents with cu_seqlens); None = zeros.
        output_final_state: also return the state after the last token of every sequence.
        cu_seqlens: int `[N+1]` document offsets into T (requires B == 1); the state resets per document.
    Returns:
        (o `[B,T,H,V]` in v.dtype, final_state `[N,H,K,V]` fp32 (fp64 for fp64 inputs) or None).
    """
    offsets = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    cdt, out_dtype = _compute_dtype(q, k, v, g, beta), v.dtype
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(cdt) for x in (q, k, v, g, beta))
    q = q * scale
    spans = [(0, T)] if offsets is None else list(zip(offsets, offsets[1:]))
    n_rows = B if offsets is None else 1
    outs, finals = [], []
    for n, (s, e) in enumerate(spans):
        if initial_state is None:
            S0 = q.new_zeros(n_rows, H, K, Vd)
        else:
            S0 = initial_state.to(cdt) if offsets is None else initial_state[n:n + 1].to(cdt)
        o_n, S_n = _recurrent_scan(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], S0)
        outs.append(o_n)
        finals.append(S_n)
    o = torch.cat(outs, 1).to(out_dtype)
    return o, (torch.cat(finals, 0) if output_final_state else None)
