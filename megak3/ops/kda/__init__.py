"""Kimi Delta Attention (KDA) in pure torch: gate, token recurrence (reference) and chunked WY form,
and the entry point that routes to fla's Triton kernels where they run.

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

Modules, by role (as fla-org/flash-linear-attention splits its KDA)
    gate.py         the lower-bounded decay gate :func:`kda_gate` and fla's safe-gate range
                    (:func:`fla_safe_gate`)
    checks.py       argument checks shared by the two torch forms
    recurrent.py    :func:`recurrent_kda`, the token-by-token reference twin
    chunk_intra.py  the state-independent terms of every chunk (decays, scores, the triangular
                    solve for W and U)
    chunked.py      :func:`chunk_kda`: layout, slabs, the state scan across chunks, documents
    dispatch.py     :func:`kda`: fla's ``chunk_kda`` where it runs, else :func:`chunk_kda`; the
                    offsets handed to fla

Shape suffixes: B batch, T tokens, H heads, K key dim, V value dim, N documents/states,
M chunks, C positions in a chunk, J sub-chunks in a chunk, S positions in a sub-chunk.
"""
from .chunked import chunk_kda
from .dispatch import kda
from .gate import FLA_SAFE_GATE_MIN, fla_safe_gate, kda_gate
from .recurrent import recurrent_kda

__all__ = ["FLA_SAFE_GATE_MIN", "chunk_kda", "fla_safe_gate", "kda", "kda_gate", "recurrent_kda"]
