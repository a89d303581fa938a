"""KDA over context-parallel ranks (parallel/kda_cp.py) against single-process chunk_kda.

The CP ranks run as threads of this process on torch's threaded process group (real data exchange,
milliseconds); one case repeats the packed check and the conv halo on 2 gloo subprocesses (the
backend of CPU runs). Every rank holds a contiguous slice of one global sequence; outputs, final
states and the gradients w.r.t. q, k, v, g, beta (and the initial state) are compared with chunk_kda
over the whole sequence. Tolerance: 1e-5 relative (vector norm), fp32.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megak3.model.kda import ShortConv
from megak3.model.seqinfo import make_seq_info
from megak3.ops.kda import chunk_kda, recurrent_kda
from parallel.kda_cp import (
    comm_log,
    conv_halo_seq_info,
    cp_local_docs,
    exchange_conv_halo,
    kda_cp,
    segment_affine_map,
)
from parallel.testing import run_distributed, run_threaded

H, K, V = 2, 8, 6
C = 16  # chunk size: small segments, fast
T_TOTAL = 256
# crosses the cp=8 boundary at 32; crosses 64; short doc inside a segment; ends at / starts exactly at
# the 128 boundary (every cp); spans several whole cp=8 segments; a short last doc
DOCS = [0, 50, 70, 75, 128, 250, 256]


# --------------------------------------------------------------------------- harness


def assert_close(got, want, tol=1e-5, what=""):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def make_inputs(B, T, seed=0, slow_decay=True):
    """fp32 q, k (unit), v, g, beta; g in (-0.05, 0) so states carry far across CP boundaries."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -(0.05 if slow_decay else 5.0) * torch.rand(B, T, H, K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    return q, k, v, g, beta


NAMES = ("q", "k", "v", "g", "beta")


# --------------------------------------------------------------------------- the affine map itself
def test_summary_is_the_product_of_token_transitions():
    """M from the identity-started zero-value run is A_T ... A_1, A_t = (I - b k k^T) Diag(exp g);
    E is the zero-state run, and any incoming state maps to M S_in + E."""
    q, k, v, g, beta = (x.double() for x in make_inputs(2, 21, slow_decay=False))
    M, E = segment_affine_map(k, v, g, beta, chunk_size=C)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(2):
        for h in range(H):
            A = eye.clone()
            for t in range(21):
                kt = k[b, t, h]
                A = (eye - beta[b, t, h] * torch.outer(kt, kt)) @ torch.diag(g[b, t, h].exp()) @ A
            assert torch.allclose(M[b, h], A, rtol=1e-10, atol=1e-12)
    S_in = torch.randn(2, H, K, V, dtype=torch.float64)
    _, S0 = recurrent_kda(q, k, v, g, beta, output_final_state=True)
    _, S1 = recurrent_kda(q, k, v, g, beta, initial_state=S_in, output_final_state=True)
    assert torch.allclose(E, S0, rtol=1e-10, atol=1e-12)
    assert torch.allclose(S1, M @ S_in + E, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- kda_cp vs chunk_kda
def _reference(inputs, cu, S0, Wo, Wf):
    """chunk_kda over the whole sequence: (o, finals, grads dict) for loss = <o, Wo> + <finals, Wf>."""
    xs = [x.clone().requires_grad_() for x in inputs]
    s0 = S0.clone().requires_grad_() if S0 is not None else None
    init = None
    if s0 is not None:
        N = S0.shape[0] if cu is None else len(cu) - 1
        init = torch.cat([s0, s0.new_zeros(N - s0.shape[0], *s0.shape[1:])]) if cu is not None else s0
    o, fin = chunk_kda(*xs, initial_state=init, output_final_state=True, chunk_size=C,
                       cu_seqlens=None if cu is None else torch.tensor(cu))
    ((o * Wo).sum() + (fin * Wf).sum()).backward()
    grads = {n: x.grad for n, x in zip(NAMES, xs)}
    if s0 is not None:
        grads["initial_state"] = s0.grad
    return o.detach(), fin.detach(), grads


def _cp_rank(group, inputs, cu_global, S0, Wo, Wf):
    """One rank: slice the global inputs, run kda_cp, backward the rank's share of the loss."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    B, Tg = inputs[0].shape[:2]
    T = Tg // cp
    docs = cp_local_docs(None if cu_global is None else torch.tensor(cu_global), B, Tg, cp, r)
    xs = [x[:, r * T:(r + 1) * T].clone().requires_grad_() for x in inputs]
    s0 = S0.clone().requires_grad_() if (S0 is not None and r == 0) else None
    o, fin = kda_cp(*xs, group, cu_seqlens=docs.cu_seqlens, continues=docs.continues, initial_state=s0,
                    output_final_state=True, chunk_size=C)
    # final states of the documents that end on this rank (global doc index -> local doc index)
    ends = {}
    if cu_global is None:
        if r == cp - 1:
            ends = {b: b for b in range(B)}
    else:
        local = docs.cu_seqlens.tolist()
        for n in range(len(local) - 1):
            end = r * T + local[n + 1]
            if end in cu_global[1:] and local[n + 1] > local[n]:
                ends[cu_global.index(end) - 1] = n
    loss = (o * Wo[:, r * T:(r + 1) * T]).sum()
    for gi, n in ends.items():
        loss = loss + (fin[n] * Wf[gi]).sum()
    loss.backward()
    grads = {n: x.grad for n, x in zip(NAMES, xs)}
    if s0 is not None:
        grads["initial_state"] = s0.grad
    return o.detach(), {gi: fin[n].detach() for gi, n in ends.items()}, grads


def _check(results, ref, cp, T):
    o_ref, fin_ref, g_ref = ref
    for r, (o, fins, grads) in enumerate(results):
        sl = slice(r * T, (r + 1) * T)
        assert_close(o, o_ref[:, sl], what=f"rank {r} o")
        for gi, f in fins.items():
            assert_close(f, fin_ref[gi], what=f"rank {r} final state of doc {gi}")
        for n in NAMES:
            assert_close(grads[n], g_ref[n][:, sl], what=f"rank {r} d{n}")
        if "initial_state" in grads:
            assert_close(grads["initial_state"], g_ref["initial_state"], what="d initial_state")
    assert sum(len(f) for _, f, _ in results) == fin_ref.shape[0]  # every final state was checked


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_kda_cp_packed_matches_whole_sequence(cp):
    inputs = make_inputs(1, T_TOTAL, seed=cp)
    gen = torch.Generator().manual_seed(100 + cp)
    S0 = torch.randn(1, H, K, V, generator=gen)
    Wo = torch.randn(1, T_TOTAL, H, V, generator=gen)
    Wf = torch.randn(len(DOCS) - 1, H, K, V, generator=gen)
    ref = _reference(inputs, DOCS, S0, Wo, Wf)
    # the carried state matters: the zero-state run of the segment after a boundary differs visibly
    T = T_TOTAL // cp
    o_mid, _ = chunk_kda(*(x[:, 160:192] for x in inputs), chunk_size=C)
    assert (o_mid - ref[0][:, 160:192]).norm() > 0.1 * ref[0][:, 160:192].norm()
    results = run_threaded(cp, lambda grp: _cp_rank(grp, inputs, DOCS, S0, Wo, Wf))
    _check(results, ref, cp, T)


def test_kda_cp_unpacked_rows_with_initial_state():
    cp, B, Tg = 4, 2, 96
    inputs = make_inputs(B, Tg, seed=7)
    gen = torch.Generator().manual_seed(8)
    S0 = torch.randn(B, H, K, V, generator=gen)
    Wo, Wf = torch.randn(B, Tg, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    ref = _reference(inputs, None, S0, Wo, Wf)
    results = run_threaded(cp, lambda grp: _cp_rank(grp, inputs, None, S0, Wo, Wf))
    _check(results, ref, cp, Tg // cp)


def test_kda_cp_batch_rows_packed():
    """B = 2 rows, each packed: the local cu_seqlens hold both rows' documents and row ends."""
    cp, B, Tg = 4, 2, 64
    cu = [0, 20, 32, 64, 64 + 40, 128]   # row 0: docs cross 16; doc starts at 32; row 1: crosses 16, 32
    inputs = make_inputs(B, Tg, seed=9)
    gen = torch.Generator().manual_seed(10)
    Wo, Wf = torch.randn(B, Tg, H, V, generator=gen), torch.zeros(len(cu) - 1, H, K, V)  # o only
    flat_inputs = [x.reshape(1, B * Tg, *x.shape[2:]) for x in inputs]
    o_ref, fin_ref, g_ref = _reference(flat_inputs, cu, None, Wo.reshape(1, B * Tg, H, V), Wf)
    o_ref = o_ref.reshape(B, Tg, H, V)
    g_ref = {n: x.reshape(B, Tg, *x.shape[2:]) for n, x in g_ref.items()}

    def rank_fn(group):
        r = dist.get_rank(group)
        T = Tg // cp
        docs = cp_local_docs(torch.tensor(cu), B, Tg, cp, r)
        xs = [x[:, r * T:(r + 1) * T].clone().requires_grad_() for x in inputs]
        o, _ = kda_cp(*xs, group, cu_seqlens=docs.cu_seqlens, continues=docs.continues, chunk_size=C)
        (o * Wo[:, r * T:(r + 1) * T]).sum().backward()
        return o.detach(), [x.grad for x in xs]

    for r, (o, grads) in enumerate(run_threaded(cp, rank_fn)):
        sl = slice(r * 16, (r + 1) * 16)
        assert_close(o, o_ref[:, sl], what=f"rank {r} o")
        for n, gr in zip(NAMES, grads):
            assert_close(gr, g_ref[n][:, sl], what=f"rank {r} d{n}")


def test_summary_bytes_do_not_depend_on_T():
    """Forward all-gather + backward reduce-scatter move cp*B*H*K*(K+V) fp32 values, for any T."""
    cp = 2
    per_T = {}
    for Tg in (64, 512):
        inputs = make_inputs(1, Tg, seed=1)

        def rank_fn(group):
            r = dist.get_rank(group)
            T = Tg // cp
            xs = [x[:, r * T:(r + 1) * T].clone().requires_grad_() for x in inputs]
            with comm_log() as log:
                o, _ = kda_cp(*xs, group, chunk_size=C)
                o.sum().backward()
            return [(kind, h, s) for kind, h, s in log.events]

        per_T[Tg] = run_threaded(cp, rank_fn)
    assert per_T[64] == per_T[512]
    summary = H * K * (K + V) * 4
    for events in per_T[64]:
        assert events == [("all_gather", summary, (cp - 1) * summary),
                          ("reduce_scatter", cp * summary, (cp - 1) * summary)]


# --------------------------------------------------------------------------- short-conv halo
def _conv_case(cp, group, x, weight, cu, W):
    r = dist.get_rank(group)
    B, Tg, P = x.shape
    T = Tg // cp
    conv = ShortConv(P, W)
    with torch.no_grad():
        conv.weight.copy_(weight)
    docs = cp_local_docs(None if cu is None else torch.tensor(cu), B, Tg, cp, r)
    xl = x[:, r * T:(r + 1) * T].clone().requires_grad_()
    halo = exchange_conv_halo(xl, W, group)
    y = conv(torch.cat([halo, xl], 1), conv_halo_seq_info(docs.pos_in_doc_BT, W))[:, W - 1:]
    return y, xl, conv


@pytest.mark.parametrize("cp,cu", [(2, [0, 31, 64]), (4, [0, 15, 17, 33, 64]), (4, None)])
def test_conv_halo_matches_whole_sequence(cp, cu):
    """Docs ending 1 token before a boundary / 1 token after one: the halo holds another document's
    tokens, which must not contribute."""
    W, P, Tg = 4, 5, 64
    gen = torch.Generator().manual_seed(cp)
    x = torch.randn(1, Tg, P, generator=gen)
    G = torch.randn(1, Tg, P, generator=gen)
    weight = torch.randn(P, 1, W, generator=gen)
    ref_conv = ShortConv(P, W)
    with torch.no_grad():
        ref_conv.weight.copy_(weight)
    xr = x.clone().requires_grad_()
    y_ref = ref_conv(xr, make_seq_info(1, Tg, None if cu is None else torch.tensor(cu)))
    (y_ref * G).sum().backward()

    def rank_fn(group):
        y, xl, conv = _conv_case(cp, group, x, weight, cu, W)
        T = Tg // cp
        r = dist.get_rank(group)
        (y * G[:, r * T:(r + 1) * T]).sum().backward()
        return y.detach(), xl.grad, conv.weight.grad

    res = run_threaded(cp, rank_fn)
    T = Tg // cp
    for r, (y, gx, _) in enumerate(res):
        assert_close(y, y_ref[:, r * T:(r + 1) * T].detach(), tol=1e-6, what=f"rank {r} y")
        assert_close(gx, xr.grad[:, r * T:(r + 1) * T], tol=1e-6, what=f"rank {r} dx")
    assert_close(sum(gw for _, _, gw in res), ref_conv.weight.grad, tol=1e-6, what="d weight")


# --------------------------------------------------------------------------- gloo
def _gloo_rank(rank, world_size, inputs, cu, S0, Wo, Wf, x, weight, W):
    group = dist.group.WORLD
    out = _cp_rank(group, inputs, cu, S0, Wo, Wf)
    y, xl, _ = _conv_case(world_size, group, x, weight, cu, W)
    y.sum().backward()
    return out, y.detach(), xl.grad


def test_gloo_kda_cp_and_halo():
    cp, W = 2, 4
    inputs = make_inputs(1, T_TOTAL, seed=3)
    gen = torch.Generator().manual_seed(4)
    S0 = torch.randn(1, H, K, V, generator=gen)
    Wo, Wf = torch.randn(1, T_TOTAL, H, V, generator=gen), torch.randn(len(DOCS) - 1, H, K, V, generator=gen)
    x, weight = torch.randn(1, T_TOTAL, 3, generator=gen), torch.randn(3, 1, W, generator=gen)
    ref = _reference(inputs, DOCS, S0, Wo, Wf)
    conv = ShortConv(3, W)
    with torch.no_grad():
        conv.weight.copy_(weight)
    xr = x.clone().requires_grad_()
    y_ref = conv(xr, make_seq_info(1, T_TOTAL, torch.tensor(DOCS)))
    y_ref.sum().backward()
    res = run_distributed(_gloo_rank, cp, inputs, DOCS, S0, Wo, Wf, x, weight, W)
    _check([r[0] for r in res], ref, cp, T_TOTAL // cp)
    T = T_TOTAL // cp
    for r, (_, y, gx) in enumerate(res):
        assert_close(y, y_ref[:, r * T:(r + 1) * T].detach(), tol=1e-6, what=f"rank {r} y")
        assert_close(gx, xr.grad[:, r * T:(r + 1) * T], tol=1e-6, what=f"rank {r} dx")
