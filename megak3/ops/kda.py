"""Kimi Delta Attention (KDA) in pure torch: gate, token recurrence (reference) and chunked WY form.

Math (K3_SPEC §4.2), per head, state S in R^{K x V}, alpha_t = exp(g_t) per key channel:
    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (q_t * scale)

`recurrent_kda` runs that token by token (the reference twin). `chunk_kda` is the chunkwise-parallel
WY/UT form (K3_SPEC §4.3). Per chunk of C tokens with in-chunk cumulative decay G_r = sum_{i<=r} g_i:
    L[r,i] = beta_r sum_c k_r k_i exp(G_r - G_i)  (i < r),   A_qk[r,i] = sum_c q_r k_i exp(G_r - G_i)  (i <= r)
    [W | U] = (I + L)^-1 Diag(beta) [exp(G) * K | V]
    per chunk, in order:  V_new = U - W S;  O = (exp(G) * Q) S + A_qk V_new;
                          S' = Diag(exp(G_C)) S + (exp(G_C - G) * K)^T V_new
Everything except the state is computed for many chunks and heads at once (batched matmuls); the only
Python loop over single chunks is the state scan (two batched matmuls each). Plain eager torch, any
device; the default C = 64 was measured fastest on a 2-core CPU (C = 32 within noise, C = 128 ~1.4x
slower: its C^2 work doubles while the scan only halves).

Layout. The chunk index leads ([M, B, H, C, D]), so the scan reads contiguous slices, and heads
precede positions, so every per-chunk product is a batched matmul. Without cu_seqlens the inputs are
not copied into that layout up front: they are strided views of the token-major tensors, and the
first product that touches each one (exp(x) * q, exp(x) * k, the fp64 cast of g, the cat that holds
v) writes a contiguous chunk-major result, with a fresh contiguous operand first so TensorIterator
picks that layout. Each slab's output is written straight into the token-major result.

Slabs. The chunks are processed in slabs of about _SLAB_ELEMENTS (2^18) elements per tensor (16 chunks
here), start to finish one after another (state-independent terms, scan, output), the state carried
from slab to slab. All temporaries are slab-sized (~1 MiB) instead of sequence-sized: they stay in
cache, glibc reuses the same freed blocks from slab to slab instead of mapping fresh pages (a 1 MiB
first touch costs ~0.3 ms in page faults here), and peak memory no longer grows with T. Every chunk
sees the same arithmetic, so the result does not depend on the slab size (bitwise, on CPU). 2^17 and
2^19 were both slower.

Overflow-free decays. g can be -5 in every channel, so G reaches -320 over a 64-token chunk and
exp(-G) overflows fp32; no factor that can overflow is ever formed. Chunks are split into sub-chunks
of 16 with reference P_a = G at the middle of sub-chunk a (position 7):
  * fast path (whenever every |G_i - P_a| <= 40; |g| <= 5 guarantees it, since G_i - P_a sums at
    most 8 gates, so one aminmax over g decides it for the whole call and only other gates check each
    slab): exp(G_r - G_i) = R_r * exp(P_a - P_b) * (1/R_i), R_i = exp(G_i - P_a) in [e^-40, e^40]
    (normal fp32, no overflow), exp(P_a - P_b) <= 1 for b <= a (may underflow only where the true
    value is negligible: < e^-28 once |P_a - P_b| > 103). Row block a of both score matrices is ONE
    matmul: q and beta*k rows of sub-chunk a are stacked ([2*16, K]) against the columns (k_i/R_i)
    exp(P_a - P_b) of blocks b <= a (built in one reused buffer); entries above the diagonal
    (<= e^80, finite) are discarded by tril_, never multiplied. Sub-chunks of 32 would not work:
    adjacent P's could then differ by 160, and exp(-160) underflows where the true entry is ~1.
  * explicit path (any other g <= 0, e.g. g = -12): pairs in different sub-chunks a < b factor through
    G_ref_b = G just before sub-chunk b (both exponents <= 0); pairs in the same sub-chunk use an
    explicit [.., 16, 16, K] decay whose exponent is -inf above the diagonal BEFORE exp.
  * exp(G), exp(G_C - G), exp(G_C) are <= 1; exp(G) * q and exp(G) * k reuse R (exp(P_a) R).
Precision: the cumulative sum, all exponent differences and the exponentials of 1x-size tensors are
computed in float64 and rounded once (cast -> cumsum_ -> sub_ -> exp_, in place). fp32 was
considered and rejected: within a sub-chunk the partial sums reach |40|, where one fp32 addition
rounds by up to 1.9e-6, so after a run of g = -5 followed by gates ~0 an entry exp(G_r - G_i) ~ 1
(r - i <= 15) can carry ~3e-5 relative error, above the 1e-5 the tests hold to; likewise exp of an
fp32-rounded x with |x| = 40 is off by ~2e-6, and exp(P_a - P_b) with |P_a - P_b| up to 80 by ~5e-6.
The fp64 passes cost ~2 ms of ~20 ms. Matmuls run in fp32 (fp64 when the inputs are fp64, gradcheck).

Triangular solve. [W | U] comes from one solve with a [C, K + V] right-hand side: block forward
substitution over the 16 x 16 diagonal tiles, X_a = D_a^-1 (rhs_a - L[a, :a] X[:a]) (one matmul
against everything solved so far plus one tile matmul per row block), about half the flops of
forming (I + L)^-1 and multiplying by it (~20% slower, and the old 6-level in-place 2x2 block
inverse spent most of its time on batches of 2x2 / 4x4 / 8x8 matmuls). The tile inverses D_a^-1
use the same 2x2 block recursion written as whole-tile products: with Y the inverse restricted to its
diagonal b-blocks and L_b = L masked to the lower-left b-block of every diagonal 2b-block,
Y <- Y - Y L_b Y is exactly -D^-1 B A^-1 there (the extra terms multiply exact zeros, so no rounding
is added), 2 batched 16 x 16 matmuls per level. Only the strictly lower triangle of L is read. A
Neumann-style product (I - L)(I + L^2)(I + L^4)(I + L^8) would be as fast but passes through entries
up to C(14, 7) ~ 3e3 for nearly identical keys and was off by ~8e-4 there (the doubling: ~1e-7);
batched torch.linalg.solve_triangular was ~5x slower.

Scan. Without autograd the scan writes V_new and the entering states in place into two preallocated
buffers (baddbmm(out=), mul(out=), baddbmm_), on per-chunk views made by one unbind each; with
autograd it builds lists (unbind also keeps the backward to one stack instead of one full-size zero
tensor per indexed chunk). Fusing the scan's two matmuls was tried: V_new = U - W S feeds
S' = D S + kr^T V_new, so they cannot be merged; moving the query product into the scan
([W; Qg] @ S in one bmm) made the scan ~1.6x slower than leaving Qg @ S_in batched after it.

No-grad vs autograd. When nothing requires grad (inference, the benchmark's forward) temporaries are
consumed in place (exp_, mul_, cumsum_, out=) so fewer fresh pages are touched; with autograd the same
arithmetic runs out of place. Both paths are checked against the recurrence in the tests.

Packed documents (`cu_seqlens`, B == 1): every document is laid out padded to a multiple of C so no
chunk straddles two documents (one row gather); the scan loads the document's initial state at its
first chunk (slab boundaries are independent of document boundaries). Padding is q = k = v = g =
beta = 0, which leaves the state untouched (decay exp(0) = 1, no write); outputs are gathered back to
token order.

Shape suffixes: B batch, T tokens, H heads, K key dim, V value dim, N documents/states,
M chunks, C positions in a chunk, J sub-chunks in a chunk, S positions in a sub-chunk.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
import torch.nn.functional as F

_SUB_CHUNK = 16  # diagonal-tile size: with g >= -5 its decays stay within e^-80 (K3_SPEC §4.1)
_FACTOR_BOUND = 40.0  # |G_i - P_a| limit of the factored path: e^40 factors, e^80 products stay finite
_SLAB_ELEMENTS = 1 << 18  # chunk_kda works through slabs of chunks of about this many elements per tensor


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


def _imul(a, b, inplace: bool):
    """a * b, written into a (a fresh temporary nobody else reads) when autograd is off."""
    return a.mul_(b) if inplace else a * b


def _decays_factored(q_XJSK, k_XJSK, beta_XJS, x_XJSK, P_XJK, GC_XK, inplace):
    """Fast path, valid when every |x_i| = |G_i - P_a| <= _FACTOR_BOUND (P_a = G mid sub-chunk a).

    exp(G_r - G_i) = R_r * exp(P_a - P_b) / R_i (r in sub-chunk a, i in b <= a) with R = exp(x): R and
    1/R lie in [e^-40, e^40] (finite, normal fp32) and exp(P_a - P_b) <= 1, so row block a of the
    scores is one matmul per operand against a column block built for it. g >= -5 always qualifies.
    Inputs may be strided views (the token-major inputs seen chunk-major); every product puts a fresh
    contiguous operand first, so its result is contiguous chunk-major and the layout copy is free.
    inplace (no autograd): x is consumed and temporaries are reused, so fewer fresh pages are touched.
    Returns (A_qk, L = Diag(beta) A_kk, Qg = exp(G) * Q, exp(G) * K, exp(G_C - G) * K, exp(G_C)).
    """
    *X, J, s, K = q_XJSK.shape
    C, cdt = J * s, q_XJSK.dtype
    R_XJSK = (x_XJSK.exp_() if inplace else x_XJSK.exp()).to(cdt)   # fp64 exp then round: exact to 1 ulp
    del x_XJSK
    kRinv_XJSK = _imul(R_XJSK.reciprocal(), k_XJSK, inplace)         # k_i / R_i
    # rows of sub-chunk a, q_r R_r then beta_r k_r R_r (beta folds into L's rows): one matmul gives both
    if inplace:
        rows_XJ2SK = q_XJSK.new_empty(*X, J, 2, s, K)
        torch.mul(R_XJSK, q_XJSK, out=rows_XJ2SK[..., 0, :, :])
        kR_XJSK = R_XJSK.mul_(k_XJSK)
        torch.mul(kR_XJSK, beta_XJS.unsqueeze(-1), out=rows_XJ2SK[..., 1, :, :])
    else:
        kR_XJSK = R_XJSK * k_XJSK
        rows_XJ2SK = torch.stack([R_XJSK * q_XJSK, kR_XJSK * beta_XJS.unsqueeze(-1)], -3)
    del R_XJSK
    expo_XJJK = P_XJK.unsqueeze(-2) - P_XJK.unsqueeze(-3)   # [.., a, b, K] = P_a - P_b, <= 0 for b <= a
    if not inplace:  # b > a is never read; -inf keeps its exp (and gradient) at 0 instead of inf * 0
        causal_JJ = torch.ones(J, J, dtype=torch.bool, device=q_XJSK.device).tril()
        expo_XJJK = expo_XJJK.masked_fill(~causal_JJ[:, :, None], float("-inf"))
    Dp_XJJK = expo_XJJK.exp_().to(cdt)                 # exp(P_a - P_b), fp64 exp then round
    # row block a only meets column blocks b <= a (the causal ones): one matmul per row block
    Aqk_XCC, L_XCC = q_XJSK.new_zeros(*X, C, C), q_XJSK.new_zeros(*X, C, C)
    cols_XJSK = kRinv_XJSK.new_empty(kRinv_XJSK.shape) if inplace and J > 1 else None
    for a in range(J):
        w = (a + 1) * s
        if a == 0:
            cols_XWK = kRinv_XJSK[..., 0, :, :]
        elif inplace:  # one reused buffer: column block b of row block a is (k_i / R_i) exp(P_a - P_b)
            cols_XWK = torch.mul(kRinv_XJSK[..., :a + 1, :, :], Dp_XJJK[..., a, :a + 1, None, :],
                                 out=cols_XJSK[..., :a + 1, :, :]).flatten(-3, -2)
        else:
            cols_XWK = (kRinv_XJSK[..., :a + 1, :, :] * Dp_XJJK[..., a, :a + 1, None, :]).flatten(-3, -2)
        A_XRW = rows_XJ2SK[..., a, :, :, :].flatten(-3, -2) @ cols_XWK.transpose(-1, -2)
        Aqk_XCC[..., a * s:w, :w] = A_XRW[..., :s, :]
        L_XCC[..., a * s:w, :w] = A_XRW[..., s:, :]
    Aqk_XCC.tril_()  # tril_ selects (never multiplies): the discarded entries above the diagonal
    L_XCC.tril_(-1)  # (<= e^80, finite) reach neither the result nor the gradients
    expP_XJ1K = P_XJK.exp().to(cdt).unsqueeze(-2)                                  # exp(G) = exp(P_a) R
    Qg_XCK = (rows_XJ2SK[..., 0, :, :] * expP_XJ1K).flatten(-3, -2)
    del rows_XJ2SK
    kg_XCK = _imul(kR_XJSK, expP_XJ1K, inplace).flatten(-3, -2)
    kr_XCK = _imul(kRinv_XJSK, (GC_XK.unsqueeze(-2) - P_XJK).exp().to(cdt).unsqueeze(-2), inplace).flatten(-3, -2)
    return Aqk_XCC, L_XCC, Qg_XCK, kg_XCK, kr_XCK, GC_XK.exp().to(cdt)


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
    expG_XCK = G_XCK.to(cdt).exp()
    return (Aqk_XCC, beta_XC.unsqueeze(-1) * Akk_XCC, expG_XCK * q_XCK, expG_XCK * k_XCK, kr_XCK,
            GC_XK.to(cdt).exp())


@functools.lru_cache(maxsize=None)
def _doubling_masks(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[levels, n, n]` 0/1 masks: level l (b = 2^l) keeps (i, j) with i, j in one diagonal 2b-block,
    i in its lower and j in its upper half (the block that level fills in)."""
    i = torch.arange(n, device=device)
    masks, b = [], 1
    while b < n:
        same = (i[:, None] // (2 * b)) == (i[None, :] // (2 * b))
        masks.append(same & ((i[:, None] // b) % 2 == 1) & ((i[None, :] // b) % 2 == 0))
        b *= 2
    return torch.stack(masks).to(dtype) if masks else torch.zeros(0, n, n, dtype=dtype, device=device)


def _small_unit_lower_inverse(L_XNN):
    """(I + L)^-1 for small n (the diagonal sub-chunk tiles), autograd-safe: recursive doubling as
    whole-tile products. Before level b, Y = (I + L)^-1 restricted to its diagonal b-blocks (block
    diagonal, zero elsewhere); with L_b = L masked to the lower-left b-block of every diagonal 2b-block,
    Y <- Y - Y L_b Y fills exactly those blocks with -D^-1 B A^-1. That is the 2x2 block-inverse
    recursion itself (the extra terms are products with exact zeros, so no rounding is added), done
    as 2 batched n x n matmuls per level instead of many tiny 2x2 / 4x4 / 8x8 ones.
    """
    n = L_XNN.shape[-1]
    masks = _doubling_masks(n, L_XNN.dtype, L_XNN.device)
    Y_XNN = torch.eye(n, dtype=L_XNN.dtype, device=L_XNN.device) - L_XNN * masks[0] if n > 1 \
        else torch.ones_like(L_XNN)                                            # level 1: Y = I - L_1
    for mask_NN in masks[1:]:
        Y_XNN = Y_XNN - Y_XNN @ ((L_XNN * mask_NN) @ Y_XNN)
    return Y_XNN


def _solve_unit_lower(L_XCC, rhs_XCD, s: int, grad: bool):
    """(I + L)^-1 rhs for strictly lower-triangular L `[..., C, C]` (C a multiple of s, or C <= s):
    block forward substitution over the s x s diagonal tiles,
        X_a = D_a^-1 (rhs_a - L[a, :a] X[:a]),   D_a^-1 = (I + L_aa)^-1 from `_small_unit_lower_inverse`,
    i.e. one matmul against everything solved so far plus one tile matmul per row block: about half the
    flops of forming the full C x C inverse and multiplying by it (what this replaced, ~20% slower).
    Only the strictly lower triangle of L is read. grad=False writes the row blocks in place into one
    buffer; grad=True collects them for autograd.
    """
    *X, C, _ = L_XCC.shape
    D = rhs_XCD.shape[-1]
    J = max(C // s, 1)
    s = C // J
    tiles_XJSS = L_XCC.unflatten(-2, (J, s)).unflatten(-1, (J, s)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
    Dinv_NJSS = _small_unit_lower_inverse(tiles_XJSS).reshape(-1, J, s, s)
    L_NCC, rhs_NCD = L_XCC.reshape(-1, C, C), rhs_XCD.reshape(-1, C, D)
    out_NCD = None if grad else rhs_NCD.new_empty(rhs_NCD.shape)
    done = []
    for a in range(J):
        rows = slice(a * s, (a + 1) * s)
        r_NSD = rhs_NCD[:, rows]
        if a:
            prev_NRD = torch.cat(done, 1) if grad else out_NCD[:, :a * s]
            r_NSD = torch.baddbmm(r_NSD, L_NCC[:, rows, :a * s], prev_NRD, alpha=-1.0)
        x_NSD = torch.bmm(Dinv_NJSS[:, a], r_NSD)
        if grad:
            done.append(x_NSD)
        else:
            out_NCD[:, rows] = x_NSD
    out_NCD = torch.cat(done, 1) if grad else out_NCD
    return out_NCD.view(*X, C, D)


def _chunk_terms(q_XCK, k_XCK, v_XCV, g_XCK, beta_XC, s, grad, factored_ok=False):
    """Everything state-independent, for all chunks at once (X = leading batch dims; inputs may be views).

    Returns (W, U, Qg = exp(G) * Q, A_qk, kr = exp(G_C - G) * K, decay = exp(G_C)) so that per chunk
    V_new = U - W S,  O = Qg S + A_qk V_new,  S' = decay * S + kr^T V_new.
    """
    *X, C, K = q_XCK.shape
    J, inplace = C // s, not grad
    # fp64 cumsum, in place on the cast, which is also the (free) chunk-major layout copy of g
    G_XCK = g_XCK.to(torch.float64, memory_format=torch.contiguous_format, copy=True).cumsum_(-2)
    G_XJSK = G_XCK.view(*X, J, s, K)
    P_XJK = G_XJSK[..., max(s // 2 - 1, 0), :].clone()
    GC_XK = G_XJSK[..., -1, -1, :].clone()
    x_XJSK = G_XJSK.sub_(P_XJK.unsqueeze(-2)) if inplace else G_XJSK - P_XJK.unsqueeze(-2)   # G_i - P_a
    del G_XCK, G_XJSK
    if not factored_ok:  # the gate's range did not settle it: check |G_i - P_a| itself
        lo, hi = torch.aminmax(x_XJSK.detach()) if x_XJSK.numel() else (x_XJSK.new_zeros(()),) * 2
        factored_ok = max(-float(lo), float(hi)) <= _FACTOR_BOUND
    if factored_ok:
        terms = _decays_factored(q_XCK.unflatten(-2, (J, s)), k_XCK.unflatten(-2, (J, s)),
                                 beta_XC.unflatten(-1, (J, s)), x_XJSK, P_XJK, GC_XK, inplace)
    else:
        G_XCK = (x_XJSK + P_XJK.unsqueeze(-2)).view(*X, C, K)   # (G - P) + P in fp64: exact to ~1e-16
        terms = _decays_explicit(q_XCK, k_XCK, beta_XC, G_XCK, s)
    del x_XJSK
    Aqk_XCC, L_XCC, Qg_XCK, kg_XCK, kr_XCK, decay_XK = terms
    del terms
    # [W | U] = (I + L)^-1 Diag(beta) [exp(G) * K | V], one solve for both (the cat also lays v out)
    rhs_XCD = _imul(torch.cat([kg_XCK, v_XCV], -1), beta_XC.unsqueeze(-1), inplace)
    del kg_XCK
    WU_XCD = _solve_unit_lower(L_XCC, rhs_XCD, s, grad)
    del L_XCC, rhs_XCD
    return WU_XCD[..., :K], WU_XCD[..., K:], Qg_XCK, Aqk_XCC, kr_XCK, decay_XK


def _scan_chunks(W_MZCK, U_MZCV, kr_MZCK, decay_MZK, loads: dict, saves: dict, grad: bool):
    """The only sequential part: the state hand-off across chunks (Z = batch * heads).

    Args:
        loads: chunk index -> state `[Z,K,V]` to load before that chunk (sequence starts; chunk 0 is one).
        saves: chunk index -> key under which to record the state after that chunk (sequence ends).
        grad: build lists for autograd; otherwise write every result in place into two preallocated
            buffers (no per-chunk allocations, no final stack copies).
    Returns:
        (S_in_MZKV: state entering every chunk, V_new_MZCV, {key: saved state}, state after the last chunk).
    """
    M, Z, C, K = W_MZCK.shape
    # per-chunk views made in one call each (unbind: fewer Python-level ops per step, and one stack in
    # the backward instead of a full-size zero tensor per indexed chunk)
    W_m, U_m = W_MZCK.unbind(0), U_MZCV.unbind(0)
    krT_m, decay_m = kr_MZCK.transpose(-1, -2).unbind(0), decay_MZK.unsqueeze(-1).unbind(0)
    saved = {}
    if grad:
        S_ZKV, entering, vnew = None, [], []
        for m in range(M):
            if m in loads:
                S_ZKV = loads[m]
            entering.append(S_ZKV)
            V_ZCV = torch.baddbmm(U_m[m], W_m[m], S_ZKV, alpha=-1.0)                     # U - W S
            S_ZKV = torch.baddbmm(decay_m[m] * S_ZKV, krT_m[m], V_ZCV)
            vnew.append(V_ZCV)
            if m in saves:
                saved[saves[m]] = S_ZKV
        return torch.stack(entering), torch.stack(vnew), saved, S_ZKV
    S_all = W_MZCK.new_empty(M + 1, Z, K, U_MZCV.shape[-1])
    Vnew_MZCV = W_MZCK.new_empty(M, Z, C, U_MZCV.shape[-1])
    S_m, V_m = S_all.unbind(0), Vnew_MZCV.unbind(0)
    for m in range(M):
        if m in loads:
            S_m[m].copy_(loads[m])
        torch.baddbmm(U_m[m], W_m[m], S_m[m], alpha=-1.0, out=V_m[m])                     # U - W S
        torch.mul(S_m[m], decay_m[m], out=S_m[m + 1])
        S_m[m + 1].baddbmm_(krT_m[m], V_m[m])
        if m in saves:  # a clone: the next document's load overwrites this slot
            saved[saves[m]] = S_m[m + 1].clone()
    return S_all[:M], Vnew_MZCV, saved, S_m[M]


def _chunk_layout(offsets, B: int, T: int, H: int, C: int, device):
    """Row maps between token rows (b, t, h) and chunk rows (m, b, h, c), M chunks per batch row.

    Without offsets every batch row is one sequence padded to M*C; with offsets (B == 1) every
    document starts a fresh chunk. Returns (gather_MZC: token row per chunk slot, B*T*H meaning the
    zero padding row; scatter_BTH: chunk slot per token row; M; first/last chunk per document).
    """
    if offsets is None:
        M = -(-T // C)
        src_P = torch.arange(M * C, device="cpu")
        src_P[T:] = -1
        dst_T = torch.arange(T, device="cpu")
        first, last = [0], [M - 1]
    else:
        src, first, last, base = [], [], [], 0
        dst_T = torch.empty(T, dtype=torch.long, device="cpu")
        for s, e in zip(offsets, offsets[1:]):
            n_chunks = -(-(e - s) // C)
            src.append(torch.cat([torch.arange(s, e, device="cpu"), torch.full((n_chunks * C - (e - s),), -1, device="cpu")]))
            dst_T[s:e] = torch.arange(base, base + e - s, device="cpu")
            first.append(base // C if n_chunks else None)
            last.append(base // C + n_chunks - 1 if n_chunks else None)
            base += n_chunks * C
        src_P = torch.cat(src)
        M = base // C
    b_B, h_H = torch.arange(B, device="cpu"), torch.arange(H, device="cpu")
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


def _chunk_view(x, M: int, C: int):
    """Token-major `[B, T, H(, D)]` -> chunk-major `[M, B, H, C(, D)]` strided VIEW (zero-padded copy
    to M*C tokens first when needed); the first elementwise op on it writes contiguous chunk-major."""
    if M * C != x.shape[1]:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, M * C - x.shape[1]))
    return x.unflatten(1, (M, C)).transpose(2, 3).transpose(0, 1)


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
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))

    # Chunk-major [M, (B, H) = Z, C, ...]: the chunk index leads so the scan reads contiguous slices,
    # heads precede positions so each per-chunk product is a batched matmul. Padding is all zeros.
    if offsets is None:  # strided views; the first product on each one does the layout copy
        M = -(-T // C)
        first, last = [0], [M - 1]
        q_X, k_X, g_X, v_X, beta_X = (_chunk_view(x.to(cdt), M, C) for x in (q, k, g, v, beta))
        beta_X = beta_X.contiguous()  # tiny; keeps every result that starts from it contiguous
    else:
        gather, scatter, M, first, last = _chunk_layout(offsets, B, T, H, C, q.device)
        q_X, k_X, g_X, v_X, beta_X1 = _gather_chunks(
            [x.to(cdt) for x in (q, k, g, v, beta.unsqueeze(-1))], gather, B * T * H, (M, Z, C))
        beta_X = beta_X1.squeeze(-1)
    if offsets is None:
        S0_ZKV = q.new_zeros(Z, K, Vd, dtype=cdt) if initial_state is None else initial_state.to(cdt).reshape(Z, K, Vd)
        starts = [S0_ZKV]
    else:
        starts = [q.new_zeros(H, K, Vd, dtype=cdt) if initial_state is None else initial_state[n].to(cdt)
                  for n in range(len(offsets) - 1)]
    loads = {m: starts[n] for n, m in enumerate(first) if m is not None}
    saves = {m: n for n, m in enumerate(last) if m is not None}

    # Slabs of chunks run start to finish one after another (terms, scan, output), the state carried
    # across: every temporary is slab-sized (a few MiB, cache-resident and reused by the allocator)
    # instead of sequence-sized; results are identical for any slab size.
    slab = max(1, _SLAB_ELEMENTS // (Z * C * max(K, Vd)))
    # |G_i - P_a| sums at most s - s // 2 gates, so |g| <= _FACTOR_BOUND / (s - s // 2) (= 5 for s = 16,
    # the K3 gate range) settles the fast path for every slab with one pass over g
    g_lo, g_hi = torch.aminmax(g.detach()) if g.numel() else (g.new_zeros(()),) * 2
    factored_ok = max(-float(g_lo), float(g_hi)) * (s - s // 2) <= _FACTOR_BOUND
    direct = offsets is None and not grad  # write each slab straight into the token-major output
    if direct:
        o = q.new_empty(B, M * C, H, Vd, dtype=cdt)
        o_dst = o.view(B, M, C, H, Vd).permute(1, 0, 3, 2, 4)                 # [M, B, H, C, V] view
    o_slabs, saved, S_carry = [], {}, None
    for m0 in range(0, M, slab):
        m1 = min(M, m0 + slab)
        n = m1 - m0
        terms = _chunk_terms(q_X[m0:m1], k_X[m0:m1], v_X[m0:m1], g_X[m0:m1], beta_X[m0:m1], s, grad,
                             factored_ok)
        W, U, Qg, Aqk, kr = (t.reshape(n, Z, C, t.shape[-1]) for t in terms[:5])   # views
        decay = terms[5].reshape(n, Z, K)
        del terms
        loads_n = {m - m0: S for m, S in loads.items() if m0 <= m < m1}
        loads_n.setdefault(0, S_carry)
        saves_n = {m - m0: i for m, i in saves.items() if m0 <= m < m1}
        S_in_MZKV, Vnew_MZCV, saved_n, S_carry = _scan_chunks(W, U, kr, decay, loads_n, saves_n, grad)
        saved.update(saved_n)
        del W, U, kr
        # O = scale * (Qg S + A_qk V_new); q's scale is applied here, once, on the output
        o_MZCV = torch.bmm(Aqk.flatten(0, 1), Vnew_MZCV.flatten(0, 1))
        del Aqk, Vnew_MZCV
        o_MZCV = (torch.baddbmm if grad else torch.Tensor.baddbmm_)(
            o_MZCV, Qg.flatten(0, 1), S_in_MZKV.flatten(0, 1), beta=scale, alpha=scale)
        del Qg, S_in_MZKV
        if direct:
            o_dst[m0:m1].copy_(o_MZCV.view(n, B, H, C, Vd))
        else:
            o_slabs.append(o_MZCV.view(n, Z, C, Vd))
        del o_MZCV
    if direct:
        o = o[:, :T]
    elif not M:
        o = v.new_zeros(B, T, H, Vd)
    else:
        o_MZCV = torch.cat(o_slabs) if len(o_slabs) > 1 else o_slabs[0]
        if offsets is None:  # [M, B*H, C, V] -> [B, M*C, H, V], padding dropped
            o = o_MZCV.view(M, B, H, C, Vd).permute(1, 0, 3, 2, 4).reshape(B, M * C, H, Vd)[:, :T]
        else:
            o = o_MZCV.view(-1, Vd).index_select(0, scatter).view(B, T, H, Vd)
    final = None
    if output_final_state:  # documents without tokens keep their initial state
        final = torch.stack([saved.get(n, S0) for n, S0 in enumerate(starts)]).view(-1, H, K, Vd)
    return o.to(out_dtype), final


# ------------------------------------------------------------------------------------- dispatcher
_FLA_CHUNK_KDA = None
_FLA_TRIED = False
FLA_SAFE_GATE_MIN = -5.0  # fla's safe_gate tiles assume g in [-5, 0) (fla's chunk_kda docstring)
_FLA_OFFSETS: dict = {}  # id(offsets given) -> (weakref to it, its int64 copy handed to fla)


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


def _fla_runs_on(x: torch.Tensor) -> bool:
    """fla's kernels take CUDA tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
    the CI check of tools/ci_triton.sh)."""
    return x.is_cuda or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def fla_safe_gate(lower_bound: float | None) -> bool:
    """Whether fla may use its safe_gate tiles for gates built with ``lower_bound``: only inside
    fla's safe range [-5, 0). Below it their in-tile decay factors overflow fp32 (NaN/inf output at
    a bound of -12), so fla runs its general path, which is exact for any g <= 0."""
    return lower_bound is not None and FLA_SAFE_GATE_MIN <= lower_bound < 0


def _fla_offsets(cu: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``cu`` as int64 on ``device``, the same tensor object for the same ``cu`` on every call (fla
    caches its chunk indices by the identity of the offsets it is given; a fresh ``.long()`` per
    call would rebuild them, and read them back from the device, in every layer)."""
    if cu is None or (cu.dtype == torch.int64 and cu.device == device):
        return cu
    hit = _FLA_OFFSETS.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1].device == device:
        return hit[1]
    key = id(cu)
    ref = weakref.ref(cu, lambda _, key=key: _FLA_OFFSETS.pop(key, None))
    _FLA_OFFSETS[key] = (ref, cu.to(device=device, dtype=torch.int64))
    return _FLA_OFFSETS[key][1]


def kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        chunk_size=64, use_fla=True, lower_bound=-5.0, cu_seqlens_cpu=None):
    """KDA entry point: fla's Triton `chunk_kda` where it runs (`_fla_runs_on`) and is importable,
    else `chunk_kda` here.

    Arguments as `chunk_kda`. q/k must already be L2-normalised and g precomputed by `kda_gate`
    (so fla runs with use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False). `lower_bound` is the
    gate bound g was built with (the layer passes model.kda.gate_lower_bound): fla's safe_gate tiles
    (K3_SPEC §4.4) are used when it lies in [-5, 0) (`fla_safe_gate`), fla's general path otherwise
    or when it is None. fla always uses chunk size 64 (chunk_size only affects the torch path).
    `cu_seqlens_cpu`: the same offsets on the host (fla sizes its chunk index from it without
    reading the device; the torch path takes its document layout from it). Offsets are handed to
    fla as int64 tensors (cu_seqlens on q's device) that keep their identity from call to call for
    the same input tensor (`_fla_offsets`). fla (``fla-core>=0.4.2``: safe_gate, lower_bound and
    cu_seqlens_cpu) gets q, k, v and beta in the CUDA autocast dtype (bf16 in training), g and the
    state in fp32.
    """
    fla_fn = _fla_chunk_kda() if (use_fla and _fla_runs_on(q)) else None
    if fla_fn is None:
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens,
                         chunk_size=chunk_size)
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs B == 1 (flatten the batch to [1, B*T, ...]); got B={q.shape[0]}")
    if torch.is_autocast_enabled("cuda"):   # fla's kernels take the low-precision operands as given
        dt = torch.get_autocast_dtype("cuda")
        q, k, v, beta = (x.to(dt) for x in (q, k, v, beta))
    with torch.autocast("cuda", enabled=False):
        return fla_fn(q, k, v, g.float(), beta, scale=scale,
                      initial_state=None if initial_state is None else initial_state.float(),
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
                      use_gate_in_kernel=False, safe_gate=fla_safe_gate(lower_bound), lower_bound=lower_bound,
                      cu_seqlens=_fla_offsets(cu_seqlens, q.device),
                      cu_seqlens_cpu=_fla_offsets(cu_seqlens_cpu, torch.device("cpu")))
