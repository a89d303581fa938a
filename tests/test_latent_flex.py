"""The FlexAttention form of balanced CP's latent attention (megak3/ops/latent_attention.py) against
its chunked twin, on CPU.

- Forward: torch's eager FlexAttention with its log-sum-exp (``flex_block_lse(compiled=False)``)
  against the chunked loop's (o, lse) per key block (negative and past-the-end query offsets,
  documents, rows with no allowed key), and the whole merged FlexAttention form against the chunked
  twin, within 1e-5 (fp32).
- Backward (torch 2.13 has no FlexAttention backward on CPU): the FlexAttention form's gradient
  algebra (block share ``w_j do`` plus the log-sum-exp gradient) with a dense differentiable block
  function in FlexAttention's place: q, latent and the expansion's parameters within 1e-6 of fp64
  autograd through the fully expanded keys (the merge runs in fp32), and within 1e-5 of the chunked twin's backward (fp32
  math inside). Dropping the log-sum-exp term is seen.
"""
import pytest
import torch

from megak3.ops import attention as A
from megak3.ops import latent_attention as L

pytestmark = pytest.mark.skipif(A._flex_functions() is None, reason="flex_attention does not import")

B, H, Tq, Tk, KD, VD, LAT = 2, 2, 16, 48, 8, 4, 6


def _docs():
    ids = torch.zeros(B, Tk, dtype=torch.int64)
    ids[0, 11:30], ids[0, 30:] = 1, 2          # row 0: three documents; row 1: one
    return ids


def _inputs(dtype, q_pos0):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Tq, KD, generator=g, dtype=dtype)
    lat = torch.randn(B, Tk, LAT, generator=g, dtype=dtype)
    W = torch.randn(H * (KD + VD), LAT, generator=g, dtype=dtype) * 0.5

    def expand(x):
        kv = (x @ W.t()).view(x.shape[0], x.shape[1], H, KD + VD).transpose(1, 2)
        return kv[..., :KD], kv[..., KD:]
    return q, lat, W, expand


def dense_block(q, k, v, scale, doc_q, doc_k, q_offset, zero_lse_grad=False):
    """Differentiable (o, lse) of one key block (the dense twin of flex_block_lse)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = torch.arange(k.shape[2])[None, :] <= torch.arange(q.shape[2])[:, None] + q_offset
    if doc_q is not None:
        allowed = allowed & (doc_q[:, :, None] == doc_k[:, None, :]).unsqueeze(1)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    safe = lse.masked_fill(lse == float("-inf"), 0.0)
    o = torch.matmul((s - safe.unsqueeze(-1)).exp(), v)
    if zero_lse_grad:  # no gradient through the finite entries (still a graph node, as autograd.grad needs)
        lse = torch.where(torch.isfinite(lse), lse.detach(), lse)
    return o, lse


@pytest.mark.parametrize("q_offset", [-5, 0, 7, 40])
@pytest.mark.parametrize("docs", [True, False], ids=["docs", "nodocs"])
def test_flex_block_lse_equals_chunked_block(q_offset, docs):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, n, d, generator=g) for n, d in ((Tq, KD), (24, KD), (24, VD)))
    doc_k = _docs()[:, :24] if docs else None
    doc_q = _docs()[:, 16:32] if docs else None
    plan = A._Plan(Tq, 5, 7, doc_k, q_offset, 24, doc_q)
    o_ref, lse_ref = A._forward(q, k, v, doc_k, 0.4, plan)
    o, lse = L.flex_block_lse(q, k, v, 0.4, doc_q, doc_k, q_offset, compiled=False)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse))
    if q_offset < 0:
        assert not fin.all()                       # some queries see no key of this block: o = 0, lse = -inf
    assert torch.allclose(lse[fin], lse_ref[fin], rtol=1e-5, atol=1e-5)
    assert torch.allclose(o, o_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_pos0", [0, 16, 32])
def test_flex_forward_equals_chunked_twin(q_pos0):
    q, lat, W, expand = _inputs(torch.float32, q_pos0)
    doc_k = _docs()
    doc_q = doc_k[:, q_pos0:q_pos0 + Tq]
    ref = L._LatentAttention.apply(q, lat, doc_q, doc_k, expand, 0.3, q_pos0, 16, 5, 7, W)
    got = L._FlexLatentAttention.apply(q, lat, doc_q, doc_k, expand, 0.3, q_pos0, 16,
                                       lambda *a: L.flex_block_lse(*a, compiled=False), W)
    assert float((got - ref).norm() / ref.norm()) <= 1e-5


def _grads(fn, q, lat, W):
    q, lat, W = (x.detach().clone().requires_grad_() for x in (q, lat, W))
    o = fn(q, lat, W)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=o.dtype)
    o.backward(do)
    return o.detach(), [q.grad, lat.grad, W.grad]


@pytest.mark.parametrize("q_pos0,k_block", [(32, 16), (16, 12)])
def test_flex_backward_algebra_equals_chunked_twin(q_pos0, k_block):
    q, lat, W, _ = _inputs(torch.float64, q_pos0)
    doc_k = _docs()
    doc_q = doc_k[:, q_pos0:q_pos0 + Tq]

    def expand_of(W):
        def expand(x):
            kv = (x @ W.t()).view(x.shape[0], x.shape[1], H, KD + VD).transpose(1, 2)
            return kv[..., :KD], kv[..., KD:]
        return expand

    def chunked(q, lat, W):
        return L._LatentAttention.apply(q, lat, doc_q, doc_k, expand_of(W), 0.3, q_pos0, k_block, 5, 7, W)

    def flexform(block_fn):
        return lambda q, lat, W: L._FlexLatentAttention.apply(q, lat, doc_q, doc_k, expand_of(W), 0.3, q_pos0,
                                                              k_block, block_fn, W)

    def dense(q, lat, W):  # fp64 autograd through the fully expanded keys
        k, v = expand_of(W)(lat)
        return A.reference_attention(q, k, v, 0.3, doc_k, q_offset=q_pos0)

    o_ref, g_ref = _grads(dense, q, lat, W)
    o_twin, g_twin = _grads(chunked, q, lat, W)      # fp32 math inside
    o, g = _grads(flexform(dense_block), q, lat, W)
    assert float((o - o_ref).norm() / o_ref.norm()) <= 1e-6       # the merge is fp32 (measured 1e-7)
    assert float((o_twin - o_ref).norm() / o_ref.norm()) <= 1e-5
    for a, b, c in zip(g, g_ref, g_twin):
        assert float((a - b).norm() / b.norm()) <= 1e-6
        assert float((a - c).norm() / c.norm()) <= 1e-5
    # the log-sum-exp term carries part of the gradient: without it the answer is wrong
    _, bad = _grads(flexform(lambda *a: dense_block(*a, zero_lse_grad=True)), q, lat, W)
    assert float((bad[0] - g_ref[0]).norm() / g_ref[0].norm()) > 1e-3


def test_latent_attention_takes_the_flex_form_on_flex_devices(monkeypatch):
    """The dispatcher: on a FlexAttention device the FlexAttention form serves (its probe included),
    here with eager FlexAttention standing in for the compiled kernel (forward only on CPU, so the
    probe's backward runs the dense twin); a failing probe falls back to the chunked twin for good."""
    q, lat, W, expand = _inputs(torch.float32, 16)
    ref = latent_attention_ref = L.latent_attention(q, lat, expand, [W], 0.3, q_pos0=16, k_block=16)
    calls = []

    def fake(q, k, v, scale, doc_q, doc_k, off):
        calls.append(off)
        return dense_block(q, k, v, scale, doc_q, doc_k, off)

    monkeypatch.setattr(A, "_flex_device", lambda q: True)
    monkeypatch.setattr(A, "_flex_failed", False)
    monkeypatch.setattr(L, "flex_block_lse", fake)
    monkeypatch.setattr(L, "_probed", {})
    got = L.latent_attention(q, lat, expand, [W], 0.3, q_pos0=16, k_block=16)
    assert calls and float((got - ref).norm() / ref.norm()) <= 1e-5
    assert latent_attention_ref is ref

    def broken(*a):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(L, "flex_block_lse", broken)
    monkeypatch.setattr(L, "_probed", {})
    with pytest.warns(UserWarning, match="chunked twin"):
        got = L.latent_attention(q, lat, expand, [W], 0.3, q_pos0=16, k_block=16)
    assert A._flex_failed and torch.allclose(got, ref)
