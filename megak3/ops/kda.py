"""Kimi Delta Attention (KDA) in pure torch: gate, token recurrence (reference) and chunked WY form.

Math (K3_SPEC §4.2), per head, state S in R^{K x V}, alpha_t = exp(g_t) per key channel:
    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (q_t * scale)

`recurrent_kda` runs that token by token (the reference twin). `chunk_kda` is the chunkwise-parallel
WY/UT form (K3_SPEC §4.3). Per chunk of C tokens with in-chunk cumulative decay G_r = sum_{i<=r} g_i:
    L[r,i] = beta_r sum_c k_r k_i exp(G_r - G_i)  (i < r),   A_qk[r,i] = sum_c q_r k_i exp(G_r - G_i)  (i <= r)
    T = (I + L)^-1 Diag(beta),   W = T (exp(G) * K),   U = T V
    per chunk, in order:  V_new = U - W S;  O = (exp(G) * Q) S + A_qk V_new;
                          S' = Diag(exp(G_C)) S + (exp(G_C - G) * K)^T V_new
Everything except the state is computed for all chunks and heads at once (batched matmuls); the only
Python loop runs over chunks (two batched matmuls each). (I + L)^-1 is a recursive 2x2 block
inverse (log2(C) levels of batched matmuls): batched torch.linalg.solve_triangular was ~5x slower;
without autograd it is built in place in one buffer (~2x faster, no stack/cat copies). Inputs
without cu_seqlens are laid out chunk-major by one strided copy each (a row gather was ~10x slower).

Overflow-free decays. g can be -5 in every channel, so G reaches -320 over a 64-token chunk and
exp(-G) overflows fp32; no factor that can overflow is ever formed. Chunks are split into sub-chunks
of 16 with reference P_a = G at the middle of sub-chunk a (position 7):
  * fast path (taken whenever every |G_i - P_a| <= 40, which g >= -5 guarantees: <= 7*5 before and
    8*5 after the middle): exp(G_r - G_i) = R_r * exp(P_b - P_a) * (1/R_i), R_i = exp(G_i - P_a) in
    [e^-40, e^40] (normal fp32, no overflow), exp(P_b - P_a) <= 1 for a <= b (may underflow only where
    the true value is negligible). Diagonal and off-diagonal tiles are then one matmul per sub-chunk
    row block; entries above the diagonal (<= e^80, finite) are discarded by tril_, never multiplied.
  * explicit path (any other g <= 0, e.g. g = -12): pairs in different sub-chunks a < b factor through
    G_ref_b = G just before sub-chunk b (both exponents <= 0); pairs in the same sub-chunk use an
    explicit [.., 16, 16, K] decay whose exponent is -inf above the diagonal BEFORE exp.
  * exp(G), exp(G_C - G), exp(G_C) are <= 1.
The cumulative sum, all exponent differences and the exponentials of 1x-size tensors are computed in
float64 and rounded once: in fp32 a difference of two cumsums near -300 carries ~3e-5 absolute
exponent error, and exp(x) of an fp32-rounded x with |x| = 40 is off by ~2e-6. Matmuls run in fp32
(fp64 when the inputs are fp64, e.g. for gradcheck).

Packed documents (`cu_seqlens`, B == 1): every document is laid out padded to a multiple of C so no
chunk straddles two documents (one row gather); the scan loads the document's initial state at its
first chunk. Padding is q = k = v = g = beta = 0, which leaves the state untouched (decay exp(0) = 1,
no write); outputs are gathered back to token order.

Shape suffixes: B batch, T tokens, H heads, K key dim, V value dim, N documents/states,
M chunks, C positions in a chunk, J sub-chunks in a chunk, S positions in a sub-chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SUB_CHUNK = 16  # diagonal-tile size: with g >= -5 its decays stay within e^-80 (K3_SPEC §4.1)
_FACTOR_BOUND = 40.0  # |G_i - P_a| limit of the factored path: e^40 factors, e^80 products stay finite


# ---------------------------------------------------------------------------------------------- gate
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


# ------------------------------------------------------------------------------------ input checks
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


# ------------------------------------------------------------------------------ recurrent reference
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


# ------------------------------------------------------------------------------------ chunked form
def _sub_chunk_size(C: int) -> int:
    if C % _SUB_CHUNK == 0:
        return _SUB_CHUNK
    if C <= _SUB_CHUNK:
        return C
    raise ValueError(f"chunk_size={C} must be <= {_SUB_CHUNK} or a multiple of {_SUB_CHUNK}")


def _scores(rows_XJRK, cols_XJCK, C):
    """Per sub-chunk row block, rows @ cols^T -> (A_qk incl. diagonal, A_kk strictly lower) `[..., C, C]`.

    rows_XJRK holds each sub-chunk's q rows then its k rows (R = 2S): one matmul twice as tall (faster
    on CPU). tril_ selects (never multiplies), so a non-finite value above the diagonal reaches neither
    the result nor the gradients; in place is safe because bmm's backward does not read its output.
    """
    *X, J, R, _ = rows_XJRK.shape
    A_XJ2SC = (rows_XJRK @ cols_XJCK.transpose(-1, -2)).view(*X, J, 2, R // 2, C)
    Aqk_XCC = A_XJ2SC[..., 0, :, :].reshape(*X, C, C).tril_()
    Akk_XCC = A_XJ2SC[..., 1, :, :].reshape(*X, C, C).tril_(-1)
    return Aqk_XCC, Akk_XCC


def _decays_factored(q_XCK, k_XCK, beta_XC, G_XCK, x_XJSK, s):
    """Fast path, valid when every |x_i| = |G_i - P_a| <= _FACTOR_BOUND (P_a = G mid sub-chunk a).

    exp(G_r - G_i) = R_r * exp(P_b - P_a) / R_i with R = exp(x): R and 1/R lie in [e^-40, e^40]
    (finite, normal fp32) and exp(P_b - P_a) <= 1 for a <= b, so the causal blocks are one matmul per
    sub-chunk row block. g >= -5 always qualifies (7 and 8 tokens either side of the middle).
    Returns (A_qk, L = Diag(beta) A_kk, exp(G), exp(G_C - G) * K, exp(G_C)).
    """
    *X, C, K = q_XCK.shape
    J, cdt = C // s, q_XCK.dtype
    P_XJK = G_XCK.view(*X, J, s, K)[..., max(s // 2 - 1, 0), :]
    R_XJSK = x_XJSK.exp().to(cdt)                      # fp64 exp then round: exact to 1 ulp
    Rinv_XJSK = R_XJSK.reciprocal()
    q_XJSK, k_XJSK = q_XCK.view(*X, J, s, K), k_XCK.view(*X, J, s, K)
    kRinv_XJSK = k_XJSK * Rinv_XJSK
    causal_JJ = torch.ones(J, J, dtype=torch.bool, device=q_XCK.device).tril()
    expo_XJJK = (P_XJK.unsqueeze(-2) - P_XJK.unsqueeze(-3)).masked_fill(~causal_JJ[:, :, None], float("-inf"))
    Dp_XJJK = expo_XJJK.exp().to(cdt)                  # exp(P_b - P_a) for a <= b, else 0
    qk_XJ2SK = torch.stack([q_XJSK, k_XJSK * beta_XC.view(*X, J, s, 1)], -3)    # beta folds into L's rows
    rows_XJRK = (qk_XJ2SK * R_XJSK.unsqueeze(-3)).view(*X, J, 2 * s, K)
    # row block a only meets column blocks b <= a (the causal ones): one matmul per row block
    Aqk_XCC, L_XCC = q_XCK.new_zeros(*X, C, C), q_XCK.new_zeros(*X, C, C)
    for a in range(J):
        w = (a + 1) * s
        cols_XWK = (kRinv_XJSK[..., :a + 1, :, :] * Dp_XJJK[..., a, :a + 1, None, :]).reshape(*X, w, K)
        A_XRW = rows_XJRK[..., a, :, :] @ cols_XWK.transpose(-1, -2)
        Aqk_XCC[..., a * s:w, :w] = A_XRW[..., :s, :]
        L_XCC[..., a * s:w, :w] = A_XRW[..., s:, :]
    Aqk_XCC.tril_()  # tril_ selects (never multiplies): the discarded entries above the diagonal
    L_XCC.tril_(-1)  # (<= e^80, finite) reach neither the result nor the gradients
    GC_XK = G_XCK[..., -1, :]
    expG_XCK = (P_XJK.exp().to(cdt).unsqueeze(-2) * R_XJSK).view(*X, C, K)                # exp(P_a) R_i
    kr_XCK = ((GC_XK.unsqueeze(-2) - P_XJK).exp().to(cdt).unsqueeze(-2) * kRinv_XJSK).view(*X, C, K)
    return Aqk_XCC, L_XCC, expG_XCK, kr_XCK, GC_XK.exp().to(cdt)


def _decays_explicit(q_XCK, k_XCK, beta_XC, G_XCK, s):
    """General path for any g <= 0 (when a gate leaves the fast path's range); same returns.

    Diagonal sub-chunk tiles use an explicit `[.., S, S, K]` decay whose exponent is set to -inf above
    the diagonal before exp. Pairs in different sub-chunks (a < b) use G_ref_b = G just before
    sub-chunk b: exp(G_r - G_i) = exp(G_r - G_ref_b) * exp(G_ref_b - G_i), both exponents <= 0.
    """
    *X, C, K = q_XCK.shape
    J, cdt, dev = C // s, q_XCK.dtype, q_XCK.device
    q_XJSK, k_XJSK, G_XJSK = (t.reshape(*X, J, s, K) for t in (q_XCK, k_XCK, G_XCK))
    tril_SS = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    expo_XJSSK = (G_XJSK.unsqueeze(-2) - G_XJSK.unsqueeze(-3)).to(cdt)       # [.., r, i, K] = G_r - G_i
    kdec_XJSSK = expo_XJSSK.masked_fill(~tril_SS[:, :, None], float("-inf")).exp() * k_XJSK.unsqueeze(-3)
    diag_XJSS2 = kdec_XJSSK @ torch.stack([q_XJSK, k_XJSK], -1)              # contract q_r and k_r at once
    eye_JJ = torch.eye(J, dtype=cdt, device=dev)
    place = lambda d_XJSS: (d_XJSS.unsqueeze(-2) * eye_JJ[:, None, :, None]).reshape(*X, C, C)
    Aqk_XCC, Akk_XCC = place(diag_XJSS2[..., 0]), place(diag_XJSS2[..., 1] * tril_SS.tril(-1))
    if J > 1:
        Gref_XJK = torch.cat([torch.zeros_like(G_XJSK[..., :1, -1, :]), G_XJSK[..., :-1, -1, :]], -2)
        rowdec_XJSK = (G_XJSK - Gref_XJK.unsqueeze(-2)).to(cdt).exp()
        before_JC = torch.arange(C, device=dev)[None, :] < (torch.arange(J, device=dev) * s)[:, None]
        colexp_XJCK = (Gref_XJK.unsqueeze(-2) - G_XCK.unsqueeze(-3)).to(cdt)
        cols_XJCK = colexp_XJCK.masked_fill(~before_JC[:, :, None], float("-inf")).exp() * k_XCK.unsqueeze(-3)
        rows_XJRK = torch.cat([q_XJSK * rowdec_XJSK, k_XJSK * rowdec_XJSK], -2)
        off_qk, off_kk = _scores(rows_XJRK, cols_XJCK, C)
        Aqk_XCC, Akk_XCC = Aqk_XCC + off_qk, Akk_XCC + off_kk
    GC_XK = G_XCK[..., -1, :]
    kr_XCK = (GC_XK.unsqueeze(-2) - G_XCK).to(cdt).exp() * k_XCK
    return Aqk_XCC, beta_XC.unsqueeze(-1) * Akk_XCC, G_XCK.to(cdt).exp(), kr_XCK, GC_XK.to(cdt).exp()


def _unit_lower_inverse(L_XCC):
    """(I + L)^-1 for strictly lower-triangular L `[..., C, C]` by recursive 2x2 block inversion.

    [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]; both diagonal halves are inverted in one
    batched call, so this is log2(C) levels of batched matmuls (4x faster than batched
    torch.linalg.solve_triangular on this CPU, which loops over the batch).
    """
    C = L_XCC.shape[-1]
    if C == 1:
        return torch.ones_like(L_XCC)
    if C % 2:  # pad with an identity row/column (L gets a zero row/column)
        return _unit_lower_inverse(F.pad(L_XCC, (0, 1, 0, 1)))[..., :C, :C]
    h = C // 2
    inv_2XHH = _unit_lower_inverse(torch.stack([L_XCC[..., :h, :h], L_XCC[..., h:, h:]]))
    Ainv_XHH, Dinv_XHH = inv_2XHH[0], inv_2XHH[1]
    low_XHH = Dinv_XHH @ L_XCC[..., h:, :h] @ Ainv_XHH
    top_XHC = torch.cat([Ainv_XHH, torch.zeros_like(Ainv_XHH)], -1)
    return torch.cat([top_XHC, torch.cat([-low_XHH, Dinv_XHH], -1)], -2)


def _unit_lower_inverse_inplace(L_XCC):
    """Same as `_unit_lower_inverse` without autograd (no-grad forward), ~2x faster on this CPU.

    Bottom-up: starting from I, level b fills the lower-left b x b block of every diagonal 2b x 2b
    block in place, -D^-1 B A^-1 with A^-1, D^-1 the (already final) diagonal b-blocks, read and
    written through strided views of one buffer (no stack/cat copies). Not autograd-safe: the
    in-place writes would invalidate the views saved by the matmuls.
    """
    *X, C, _ = L_XCC.shape
    if C & (C - 1):  # not a power of two: pad with identity rows/columns (zero rows/columns of L)
        P = 1 << (C - 1).bit_length()
        return _unit_lower_inverse_inplace(F.pad(L_XCC, (0, P - C, 0, P - C)))[..., :C, :C]
    out = torch.eye(C, dtype=L_XCC.dtype, device=L_XCC.device).expand(*X, C, C).contiguous()
    L_XCC = L_XCC.contiguous()
    lead = out.stride()[:-2]
    b = 1
    while b < C:
        size, stride = (*X, C // (2 * b), 2 * b, 2 * b), (*lead, 2 * b * (C + 1), C, 1)
        blk_o, blk_l = out.as_strided(size, stride), L_XCC.as_strided(size, stride)
        low = blk_l[..., b:, :b] if b == 1 else blk_o[..., b:, b:] @ blk_l[..., b:, :b] @ blk_o[..., :b, :b]
        blk_o[..., b:, :b] = -low
        b *= 2
    return out


def _chunk_terms(q_XCK, k_XCK, v_XCV, g_XCK, beta_XC, s):
    """Everything state-independent, for all chunks at once (X = leading batch dims).

    Returns (W, U, Qg = exp(G) * Q, A_qk, kr = exp(G_C - G) * K, decay = exp(G_C)) so that per chunk
    V_new = U - W S,  O = Qg S + A_qk V_new,  S' = decay * S + kr^T V_new.
    """
    G_XCK = torch.cumsum(g_XCK, -2, dtype=torch.float64)
    *X, C, K = G_XCK.shape
    G_XJSK = G_XCK.view(*X, C // s, s, K)
    x_XJSK = G_XJSK - G_XJSK[..., max(s // 2 - 1, 0), :].unsqueeze(-2)       # G_i - P_a
    lo, hi = torch.aminmax(x_XJSK.detach()) if x_XJSK.numel() else (x_XJSK.new_zeros(()),) * 2
    if max(-float(lo), float(hi)) <= _FACTOR_BOUND:
        terms = _decays_factored(q_XCK, k_XCK, beta_XC, G_XCK, x_XJSK, s)
    else:
        terms = _decays_explicit(q_XCK, k_XCK, beta_XC, G_XCK, s)
    Aqk_XCC, L_XCC, expG_XCK, kr_XCK, decay_XK = terms
    # T = (I + L)^-1 Diag(beta);  W = T (exp(G) * K),  U = T V
    needs_grad = torch.is_grad_enabled() and L_XCC.requires_grad
    inverse = _unit_lower_inverse if needs_grad else _unit_lower_inverse_inplace
    T_XCC = inverse(L_XCC) * beta_XC.unsqueeze(-2)
    W_XCK, U_XCV = T_XCC @ (expG_XCK * k_XCK), T_XCC @ v_XCV
    return W_XCK, U_XCV, expG_XCK * q_XCK, Aqk_XCC, kr_XCK, decay_XK


def _scan_chunks(W_MZCK, U_MZCV, kr_MZCK, decay_MZK, loads: dict, saves: dict):
    """The only sequential part: the state hand-off across chunks (Z = batch * heads).

    Args:
        loads: chunk index -> state `[Z,K,V]` to load before that chunk (sequence starts).
        saves: chunk index -> key under which to record the state after that chunk (sequence ends).
    Returns:
        (S_in_MZKV: state entering every chunk, V_new_MZCV, {key: saved state}).
    """
    S_ZKV, entering, vnew, saved = None, [], [], {}
    for m in range(W_MZCK.shape[0]):
        if m in loads:
            S_ZKV = loads[m]
        entering.append(S_ZKV)
        V_ZCV = torch.baddbmm(U_MZCV[m], W_MZCK[m], S_ZKV, alpha=-1.0)                   # U - W S
        S_ZKV = torch.baddbmm(decay_MZK[m].unsqueeze(-1) * S_ZKV, kr_MZCK[m].transpose(-1, -2), V_ZCV)
        vnew.append(V_ZCV)
        if m in saves:
            saved[saves[m]] = S_ZKV
    return torch.stack(entering), torch.stack(vnew), saved


def _chunk_layout(offsets, B: int, T: int, H: int, C: int, device):
    """Row maps between token rows (b, t, h) and chunk rows (m, b, h, c), M chunks per batch row.

    Without offsets every batch row is one sequence padded to M*C; with offsets (B == 1) every
    document starts a fresh chunk. Returns (gather_MZC: token row per chunk slot, B*T*H meaning the
    zero padding row; scatter_BTH: chunk slot per token row; M; first/last chunk per document).
    """
    if offsets is None:
        M = -(-T // C)
        src_P = torch.arange(M * C)
        src_P[T:] = -1
        dst_T = torch.arange(T)
        first, last = [0], [M - 1]
    else:
        src, first, last, base = [], [], [], 0
        dst_T = torch.empty(T, dtype=torch.long)
        for s, e in zip(offsets, offsets[1:]):
            n_chunks = -(-(e - s) // C)
            src.append(torch.cat([torch.arange(s, e), torch.full((n_chunks * C - (e - s),), -1)]))
            dst_T[s:e] = torch.arange(base, base + e - s)
            first.append(base // C if n_chunks else None)
            last.append(base // C + n_chunks - 1 if n_chunks else None)
            base += n_chunks * C
        src_P = torch.cat(src)
        M = base // C
    b_B, h_H = torch.arange(B), torch.arange(H)
    t_MC = src_P.view(M, C)
    rows_MBHC = (b_B[None, :, None, None] * T + t_MC[:, None, None, :]) * H + h_H[None, None, :, None]
    gather = torch.where(t_MC[:, None, None, :] >= 0, rows_MBHC, B * T * H)
    m_T, c_T = dst_T // C, dst_T % C
    scatter = ((m_T[None, :, None] * B + b_B[:, None, None]) * H + h_H[None, None, :]) * C + c_T[None, :, None]
    return gather.reshape(-1).to(device), scatter.reshape(-1).to(device), M, first, last


def _gather_chunks(xs, gather, n_rows, lead):
    """Token-major `[B, T, H, D_j]` tensors -> chunk-major `[*lead, D_j]` views, zeros in padded slots.

    One concatenation and one row gather for all inputs (each extra pass over the inputs costs more
    than the arithmetic here); padded slots (index n_rows) are zeroed in place on the fresh gather.
    """
    widths = [x.shape[-1] for x in xs]
    rows_RW = torch.cat(xs, -1).reshape(n_rows, sum(widths))
    pad = gather == n_rows
    out_PW = rows_RW.index_select(0, gather.clamp(max=n_rows - 1) if n_rows else gather)
    if bool(pad.any()):
        out_PW.masked_fill_(pad[:, None], 0.0)
    return [t.reshape(*lead, t.shape[-1]).contiguous() for t in out_PW.split(widths, -1)]


def _to_chunk_major(x, M: int, C: int):
    """Token-major `[B, T, H(, D)]` -> contiguous chunk-major `[M, B*H, C(, D)]`, zero-padded to M*C tokens."""
    B, T, H = x.shape[:3]
    if M * C != T:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, M * C - T))
    x = x.reshape(B, M, C, H, *x.shape[3:]).transpose(2, 3).transpose(0, 1)  # [M, B, H, C(, D)]
    return x.reshape(M, B * H, C, *x.shape[4:]).contiguous()


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, chunk_size=64):
    """Chunkwise-parallel KDA (WY/UT transform), same semantics and arguments as `recurrent_kda`.

    Args:
        q, k: `[B,T,H,K]`; v: `[B,T,H,V]`; g: `[B,T,H,K]` log-decay <= 0 (any magnitude is safe);
        beta: `[B,T,H]`; scale: default K**-0.5; initial_state: `[N,H,K,V]` or None;
        cu_seqlens: int `[N+1]` document offsets (B == 1); chunk_size: C, <= 16 or a multiple of 16.
    Returns:
        (o `[B,T,H,V]` in v.dtype, final_state `[N,H,K,V]` fp32 (fp64 for fp64 inputs) or None).
    """
    offsets = _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be positive")
    C, s = chunk_size, _sub_chunk_size(chunk_size)
    B, T, H, K = q.shape
    Vd, Z = v.shape[-1], B * H
    cdt, out_dtype = _compute_dtype(q, k, v, g, beta), v.dtype
    scale = K ** -0.5 if scale is None else scale

    # Chunk-major [M, Z, C, ...]: the chunk index leads so the scan reads contiguous slices, heads
    # precede positions so each per-chunk product is a batched matmul. Padding is all zeros.
    if offsets is None:  # one strided copy per input (padded to M*C); a row gather is ~10x slower
        M = -(-T // C)
        first, last = [0], [M - 1]
        q_MZCK, k_MZCK, g_MZCK, v_MZCV, beta_MZC = (_to_chunk_major(x.to(cdt), M, C) for x in (q, k, g, v, beta))
    else:
        gather, scatter, M, first, last = _chunk_layout(offsets, B, T, H, C, q.device)
        q_MZCK, k_MZCK, g_MZCK, v_MZCV, beta_MZC1 = _gather_chunks(
            [x.to(cdt) for x in (q, k, g, v, beta.unsqueeze(-1))], gather, B * T * H, (M, Z, C))
        beta_MZC = beta_MZC1.squeeze(-1)
    W, U, Qg_MZCK, Aqk_MZCC, kr, decay = _chunk_terms(q_MZCK, k_MZCK, v_MZCV, g_MZCK, beta_MZC, s)

    if offsets is None:
        S0_ZKV = q_MZCK.new_zeros(Z, K, Vd) if initial_state is None else initial_state.to(cdt).reshape(Z, K, Vd)
        starts = [S0_ZKV]
    else:
        starts = [q_MZCK.new_zeros(H, K, Vd) if initial_state is None else initial_state[n].to(cdt)
                  for n in range(len(offsets) - 1)]
    loads = {m: starts[n] for n, m in enumerate(first) if m is not None}
    saves = {m: n for n, m in enumerate(last) if m is not None}
    if M:
        S_in_MZKV, Vnew_MZCV, saved = _scan_chunks(W, U, kr, decay, loads, saves)
        # O = scale * (Qg S + A_qk V_new); q's scale is applied here, once, on the output
        o_MZCV = torch.baddbmm((Aqk_MZCC @ Vnew_MZCV).flatten(0, 1), Qg_MZCK.flatten(0, 1),
                               S_in_MZKV.flatten(0, 1), beta=scale, alpha=scale)
        if offsets is None:  # [M, B*H, C, V] -> [B, M*C, H, V], padding dropped
            o = o_MZCV.view(M, B, H, C, Vd).permute(1, 0, 3, 2, 4).reshape(B, M * C, H, Vd)[:, :T]
        else:
            o = o_MZCV.view(-1, Vd).index_select(0, scatter).view(B, T, H, Vd)
    else:
        saved, o = {}, v.new_zeros(B, T, H, Vd)
    final = None
    if output_final_state:  # documents without tokens keep their initial state
        final = torch.stack([saved.get(n, S0) for n, S0 in enumerate(starts)]).view(-1, H, K, Vd)
    return o.to(out_dtype), final


# ------------------------------------------------------------------------------------- dispatcher
_FLA_CHUNK_KDA = None
_FLA_TRIED = False


def _fla_chunk_kda():
    """fla's Triton chunk_kda, imported lazily once; None when fla (or Triton) is unavailable."""
    global _FLA_CHUNK_KDA, _FLA_TRIED
    if not _FLA_TRIED:
        _FLA_TRIED = True
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda
            _FLA_CHUNK_KDA = fla_chunk_kda
        except Exception:  # ImportError, or Triton failing to initialise on a CPU-only host
            _FLA_CHUNK_KDA = None
    return _FLA_CHUNK_KDA


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        chunk_size=64, use_fla=True, lower_bound=-5.0):
    """KDA entry point: fla's Triton `chunk_kda` on CUDA when importable, else `chunk_kda` here.

    Arguments as `chunk_kda`. q/k must already be L2-normalised and g precomputed by `kda_gate`
    (so fla runs with use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False). `lower_bound` is the
    gate bound g was built with; it enables fla's safe_gate tiles (K3_SPEC §4.4); None disables them.
    fla always uses chunk size 64 (chunk_size only affects the torch path).
    """
    fla_fn = _fla_chunk_kda() if (use_fla and q.is_cuda) else None
    if fla_fn is None:
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs B == 1 (flatten the batch to [1, B*T, ...]); got B={q.shape[0]}")
    return fla_fn(q, k, v, g, beta, scale=scale,
                  initial_state=None if initial_state is None else initial_state.float(),
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
                  use_gate_in_kernel=False, safe_gate=lower_bound is not None, lower_bound=lower_bound,
                  cu_seqlens=None if cu_seqlens is None else cu_seqlens.long())
