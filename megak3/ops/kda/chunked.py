"""Chunkwise-parallel KDA in pure torch (:func:`chunk_kda`, the WY/UT form of K3_SPEC §4.3): chunk
layout, slabs, the state scan across chunks, packed documents. The per-chunk terms are computed in
chunk_intra.py; see the package docstring for the math.

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

import torch
import torch.nn.functional as F

from .checks import _check_inputs, _compute_dtype
from .chunk_intra import _FACTOR_BOUND, _chunk_terms, _sub_chunk_size

_SLAB_ELEMENTS = 1 << 18  # chunk_kda works through slabs of chunks of about this many elements per tensor


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
