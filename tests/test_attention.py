"""Chunked causal same-document attention (megak3/ops/attention.py) and its use in Gated MLA."""
import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megak3.config import load_model_config
from megak3.model.k3 import build_model
from megak3.model.mla import GatedMLA
from megak3.model.seqinfo import make_seq_info
from megak3.ops.attention import _Plan, attention, chunked_attention, reference_attention


def rel_err(a, b):
    """max |a - b| relative to max |b| (0 when both are all zeros)."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


def docs_from_lengths(rows):
    """[B, T] document ids from per-row document lengths (ids increase along the flattened stream)."""
    out, nxt = [], 0
    for lengths in rows:
        ids = []
        for n in lengths:
            ids += [nxt] * n
            nxt += 1
        out.append(ids)
    return torch.tensor(out)


CASES = [  # (row document lengths, H, K, V, q_chunk, k_chunk)
    ([[17, 40, 43], [60, 1, 39]], 3, 12, 8, 13, 7),      # boundaries off the chunk grid, 1-token document
    ([[77], [5, 5, 5, 62], [30, 47]], 2, 20, 16, 16, 32),  # B = 3, chunks that do not divide T = 77
    ([[1] * 9 + [24]], 1, 8, 8, 5, 5),                    # many one-token documents
    ([[100]], 2, 16, 12, 33, 64),                         # a single document
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("with_docs", [True, False])
def test_chunked_matches_reference_forward_and_grads(case, with_docs):
    rows, H, K, V, qc, kc = CASES[case]
    doc = docs_from_lengths(rows)
    B, T = doc.shape
    g = torch.Generator().manual_seed(case)
    q, k, v = (torch.randn(B, H, T, d, generator=g) for d in (K, K, V))
    dout = torch.randn(B, H, T, V, generator=g)
    scale = K ** -0.5 * 2.0  # sharper softmax than 1/sqrt(K)
    d = doc if with_docs else None
    qc_, kc_, vc_ = (t.clone().requires_grad_() for t in (q, k, v))
    out = chunked_attention(qc_, kc_, vc_, scale, d, q_chunk=qc, k_chunk=kc)
    out.backward(dout)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))  # fp64 twin
    ref = reference_attention(q64, k64, v64, scale, d)
    ref.backward(dout.double())
    assert out.dtype == torch.float32 and out.shape == (B, H, T, V)
    assert rel_err(out, ref) < 1e-5
    for got, want in ((qc_.grad, q64.grad), (kc_.grad, k64.grad), (vc_.grad, v64.grad)):
        assert rel_err(got, want) < 1e-5
    # the dispatcher (CPU: chunked with documents, SDPA without) and the fp32 reference agree as well
    torch.testing.assert_close(attention(q, k, v, scale, d, q_chunk=qc, k_chunk=kc),
                               reference_attention(q, k, v, scale, d), rtol=1e-5, atol=1e-6)


def test_plan_skips_future_and_other_document_chunks():
    doc = docs_from_lengths([[64, 64]])
    plan = _Plan(128, 32, 32, doc)
    assert [[j for j, _, _ in r] for r in plan.rows] == [[0], [0, 1], [2], [2, 3]]
    assert [[i for i, _, _ in c] for c in plan.cols] == [[0, 1], [1], [2, 3], [3]]
    # (q1, k0) lies below the diagonal in one document: no mask at all; diagonal pairs: causal only
    assert plan.rows[1] == [(0, False, False), (1, True, False)]
    plain = _Plan(128, 32, 32, None)
    assert sum(len(r) for r in plain.rows) == 10


def test_bf16_inputs_keep_dtype_and_match():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 50, 16, generator=g).bfloat16() for _ in range(3))
    doc = docs_from_lengths([[20, 30], [49, 1]])
    out = chunked_attention(q, k, v, 0.25, doc, q_chunk=16, k_chunk=16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference_attention(q.float(), k.float(), v.float(), 0.25, doc),
                               atol=1e-2, rtol=1e-2)


def test_bad_shapes_rejected():
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="doc_ids_BT"):
        chunked_attention(q, q, q, 1.0, torch.zeros(1, 7, dtype=torch.long))
    with pytest.raises(ValueError, match="expected q, k"):
        chunked_attention(q, q[..., :3], q, 1.0)


# ---- Gated MLA against the previous dense-mask implementation ----------------------------------
def old_mla_forward(m: GatedMLA, x_BTD, seq):
    """GatedMLA.forward as it was before chunked attention: a dense [B, 1, T, T] mask and SDPA."""
    B, T, _ = x_BTD.shape
    H = m.num_heads
    q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x_BTD))).view(B, T, H, m.q_head_dim)
    c_kv, k_pe = m.kv_a_proj_with_mqa(x_BTD).split([m.kv_rank, m.rope], dim=-1)
    kv = m.kv_b_proj(m.kv_a_layernorm(c_kv)).view(B, T, H, m.nope + m.v_dim)
    k_nope, v = kv.split([m.nope, m.v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, T, H, m.rope)], dim=-1)
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))
    if seq.packed:
        doc = seq.doc_ids_BT
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = (doc[:, :, None] == doc[:, None, :]).logical_and(causal).unsqueeze(1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=m.softmax_scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=m.softmax_scale)
    o = o.transpose(1, 2).reshape(B, T, H * m.v_dim)
    o = o * torch.sigmoid(m.g_proj(x_BTD).float())
    return m.o_proj(o.to(x_BTD.dtype))


@pytest.mark.parametrize("cu", [[0, 23, 70, 71, 110, 140], [0, 140], None])
def test_gated_mla_matches_dense_mask_implementation(cu):
    torch.manual_seed(0)
    m = GatedMLA(load_model_config("k3_tiny"))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    m.q_chunk, m.k_chunk = 16, 24
    B, T = 2, 70
    x = torch.randn(B, T, 256)
    dy = torch.randn(B, T, 256)
    seq = make_seq_info(B, T, None if cu is None else torch.tensor(cu))
    outs, grads = [], []
    for fn in (lambda: m(x, seq), lambda: old_mla_forward(m, x, seq)):
        m.zero_grad(set_to_none=True)
        y = fn()
        y.backward(dy)
        outs.append(y)
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    assert rel_err(outs[0], outs[1]) < 1e-5
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 8
    for n in grads[0]:
        assert rel_err(grads[0][n], grads[1][n]) < 1e-5, n


def test_k3_tiny_packed_forward_backward_equals_dense_mask_path(monkeypatch):
    cfg = load_model_config("k3_tiny", **{"vision.enabled": False})
    model = build_model(cfg, seed=2)
    for layer in model.layers:
        if layer.kind == "mla":
            layer.self_attn.q_chunk, layer.self_attn.k_chunk = 16, 24
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(4, cfg.vocab_size, (2, 64), generator=g)
    cu = torch.tensor([0, 19, 64, 100, 128])
    results = []
    for old in (False, True):
        if old:
            monkeypatch.setattr(GatedMLA, "forward", lambda self, x, seq: old_mla_forward(self, x, seq))
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=torch.roll(ids, -1, 1), cu_seqlens=cu)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}))
    (loss_new, g_new), (loss_old, g_old) = results
    assert abs(loss_new.item() - loss_old.item()) < 1e-6 * loss_old.item()
    assert g_new.keys() == g_old.keys()
    for n in g_new:  # measured: at most ~5e-6 (fp32 rounding through 9 layers)
        assert rel_err(g_new[n], g_old[n]) < 2e-5, n


# ---- memory: nothing O(T^2) is ever allocated ----------------------------------------------------
def allocation_profile(fn):
    """(peak live bytes, largest net allocation of one op) over fn(), from torch.profiler's CPU
    memory accounting (tensors allocated before the call do not count)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = largest = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
        largest = max(largest, e.self_cpu_memory_usage)
    return peak, largest


def _fwd_bwd(fn, T, H=1, K=16, V=16, docs=None, **kw):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, d, generator=g).requires_grad_() for d in (K, K, V))
    return lambda: fn(q, k, v, K ** -0.5, docs, **kw).sum().backward()


def test_memory_profile_sees_the_dense_reference_quadratic():
    T = 1024
    peak, largest = allocation_profile(_fwd_bwd(reference_attention, T))
    assert largest >= T * T * 4 and peak >= 2 * T * T * 4


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_attention_memory_is_linear_in_T(packed):
    T = 16384
    docs = docs_from_lengths([[5000, 3, 11381]]) if packed else None
    # 1024-token chunks keep the profiled op count (and the test time) small; the largest temporary
    # is one [1, 1, 1024, 1024] fp32 chunk pair (4 MiB)
    peak, largest = allocation_profile(_fwd_bwd(chunked_attention, T, docs=docs, q_chunk=1024, k_chunk=1024))
    quadratic = T * T * 4  # one fp32 [T, T] score matrix: 1 GiB
    assert peak < quadratic / 64, peak   # measured 6 MiB: O(T) buffers plus chunk-pair temporaries
    assert largest <= quadratic / 256, largest


# ---- query offset: local queries of a context-parallel segment against the keys before them ----
@pytest.mark.parametrize("with_docs", [True, False])
@pytest.mark.parametrize("q_offset,Tq,extra", [(0, 30, 0), (23, 30, 0), (40, 17, 0), (13, 20, 9)])
def test_query_offset_matches_reference(with_docs, q_offset, Tq, extra):
    """Queries at positions [q_offset, q_offset + Tq) against keys [0, Tk): the chunked path (and the
    dispatcher) equal the dense fp64 twin, forward and gradients, and equal the rows of the full
    self-attention they are a slice of."""
    Tk = q_offset + Tq + extra
    cuts = [c for c in (11, 29, 41) if c < Tk]  # documents crossing the query offset in row 0
    doc = docs_from_lengths([[b - a for a, b in zip([0] + cuts, cuts + [Tk])], [Tk]]) if with_docs else None
    B, H, K, V = 2, 2, 12, 8
    g = torch.Generator().manual_seed(q_offset + Tq)
    k, v = torch.randn(B, H, Tk, K, generator=g), torch.randn(B, H, Tk, V, generator=g)
    q_full = torch.randn(B, H, Tk, K, generator=g)
    q = q_full[:, :, q_offset:q_offset + Tq].contiguous()
    dout = torch.randn(B, H, Tq, V, generator=g)
    scale = K ** -0.5 * 2.0
    qc_, kc_, vc_ = (t.clone().requires_grad_() for t in (q, k, v))
    out = chunked_attention(qc_, kc_, vc_, scale, doc, q_chunk=7, k_chunk=9, q_offset=q_offset)
    out.backward(dout)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, scale, doc, q_offset=q_offset)
    ref.backward(dout.double())
    assert rel_err(out, ref) < 1e-5
    for got, want in ((qc_.grad, q64.grad), (kc_.grad, k64.grad), (vc_.grad, v64.grad)):
        assert rel_err(got, want) < 1e-5
    full = reference_attention(q_full[:, :, :Tk].double(), k.double(), v.double(), scale, doc)
    assert rel_err(out, full[:, :, q_offset:q_offset + Tq]) < 1e-5
    torch.testing.assert_close(attention(q, k, v, scale, doc, q_chunk=7, k_chunk=9, q_offset=q_offset),
                               out.detach(), rtol=1e-5, atol=1e-6)  # SDPA when q_offset = 0


def test_query_offset_plan_skips_chunks_of_earlier_documents():
    doc = docs_from_lengths([[64, 64]])
    plan = _Plan(64, 32, 32, doc, q_offset=64)   # the second half's queries: document 1 only
    assert [[j for j, _, _ in r] for r in plan.rows] == [[2], [2, 3]]
    with pytest.raises(ValueError, match="q_offset"):
        chunked_attention(torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4), 1.0,
                          q_offset=3)


# ---- FlexAttention (the CUDA path): its block mask, checked with torch's eager FlexAttention ------
@pytest.mark.parametrize("with_docs", [True, False])
@pytest.mark.parametrize("q_offset", [0, 40, 96])
def test_flex_block_mask_matches_reference(with_docs, q_offset):
    """flex_document_attention (what attention() runs on CUDA with documents or a CP offset) against the
    dense and chunked twins. Eager FlexAttention on CPU: forward only (torch 2.13 has no CPU
    FlexAttention backward); the compiled CUDA kernel and its gradients run in tools/gpu_check.py."""
    from megak3.ops import attention as A

    if A._flex_functions() is None:
        pytest.skip("torch.nn.attention.flex_attention does not import")
    torch.manual_seed(5)
    B, H, Tk, K, V = 2, 2, 160, 24, 16
    Tq = Tk - q_offset
    q, k, v = torch.randn(B, H, Tq, K), torch.randn(B, H, Tk, K), torch.randn(B, H, Tk, V)
    doc = None
    if with_docs:  # documents cross the offset; row 1 has a short one right after it
        doc = torch.zeros(B, Tk, dtype=torch.long)
        doc[:, 70:] = 1
        doc[1, 100:] = 2
        doc[1, 110:] = 3
    with torch.no_grad():
        got = A.flex_document_attention(q, k, v, 0.2, doc, q_offset, compiled=False)
        ref = reference_attention(q, k, v, 0.2, doc, q_offset)
        chunked = chunked_attention(q, k, v, 0.2, doc, 32, 32, q_offset)
    assert (got - ref).abs().max() < 1e-5
    assert (got - chunked).abs().max() < 1e-5
    if with_docs:  # the check can fail: the same call without documents is another answer
        assert (A.flex_document_attention(q, k, v, 0.2, None, q_offset, compiled=False) - ref).abs().max() > 1e-2
