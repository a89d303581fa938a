"""FlexAttention's block mask without a [Tq, Tk] tensor (issue 24, finding 2) and its fallback
(forward and backward together).

The block mask is compared with torch's ``create_block_mask`` (the dense twin: it evaluates the
mask on every [Tq, Tk] entry) at small T, with documents and query offsets. Its memory at
T = 65,536 is measured on the meta device (no data, so the old dense construction can be measured
too without allocating 32 GiB) by a dispatch-mode spy that tracks the bytes of every live storage
an op creates.
"""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megak3.ops import attention as A
from megak3.ops.attention import chunked_attention, reference_attention

pytestmark = pytest.mark.skipif(A._flex_functions() is None, reason="flex_attention does not import")

FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
          "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


class AllocSpy(TorchDispatchMode):
    """Live bytes of the storages created by ops under the mode (a storage shared by views counts
    once and is released when its last seen tensor is freed); ``peak`` and ``largest``."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}
        self.cur = self.peak = 0
        self.largest = (0, "", ())

    def _release(self, key):
        n, refs = self.live[key]
        if refs == 1:
            del self.live[key]
            self.cur -= n
        else:
            self.live[key] = (n, refs - 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self.live:
                self.live[key] = (self.live[key][0], self.live[key][1] + 1)
            elif key in inputs:     # a view of a tensor made outside the mode
                continue
            else:
                n = st.nbytes()
                self.live[key] = (n, 1)
                self.cur += n
                self.peak = max(self.peak, self.cur)
                if n > self.largest[0]:
                    self.largest = (n, str(func), tuple(t.shape))
            weakref.finalize(t, self._release, key)
        return out


def _packed_docs(B, T, n_cuts, seed):
    """Non-decreasing document ids per row (packed documents), cuts at random positions."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        for c in torch.randint(1, T, (n_cuts,), generator=g).tolist():
            doc[b, c:] += 1
    return doc


def _dense_twin(doc, B, Tq, Tk, q_offset):
    from torch.nn.attention.flex_attention import create_block_mask

    if doc is None:
        def mask_mod(b, h, q, k):
            return k <= q + q_offset
    else:
        doc_q = doc[:, q_offset:q_offset + Tq]

        def mask_mod(b, h, q, k):
            return (k <= q + q_offset) & (doc_q[b, q] == doc[b, k])
    return create_block_mask(mask_mod, B, None, Tq, Tk, device="cpu")


@pytest.mark.parametrize("Tk,q_offset", [(1000, 0), (1000, 300), (1024, 512), (700, 129), (256, 0)])
@pytest.mark.parametrize("with_docs", [True, False])
def test_block_mask_equals_create_block_mask(Tk, q_offset, with_docs):
    """Tiles from block bounds == create_block_mask's evaluation of every entry (partial and full
    tiles, both orderings), for packed documents, CP offsets (also not a multiple of 128) and T
    not a multiple of 128."""
    B, Tq = 2, Tk - q_offset
    doc = _packed_docs(B, Tk, 4, seed=Tk + q_offset) if with_docs else None
    A._block_mask_cache.clear()
    got = A.flex_block_mask(doc, B, Tq, Tk, q_offset, "cpu")
    ref = _dense_twin(doc, B, Tq, Tk, q_offset)
    assert got.seq_lengths == ref.seq_lengths == (Tq, Tk)
    for f in FIELDS:
        assert getattr(got, f).dtype == getattr(ref, f).dtype and torch.equal(getattr(got, f), getattr(ref, f)), f
    assert got.BLOCK_SIZE == ref.BLOCK_SIZE
    if with_docs:   # the check can fail: the mask without documents differs
        other = A.flex_block_tiles(None, B, Tq, Tk, q_offset, "cpu")[1]
        assert not torch.equal(other, A.flex_block_tiles(doc, B, Tq, Tk, q_offset, "cpu")[1])


def test_block_mask_with_unsorted_ids_is_a_superset_and_exact_attention():
    """Ids that are not non-decreasing (an id reappearing later in the row): the tiles cover every
    tile create_block_mask keeps, and eager FlexAttention with them equals the dense reference."""
    torch.manual_seed(3)
    B, H, Tk, q_offset, K = 2, 2, 384, 128, 16
    Tq = Tk - q_offset
    doc = torch.randint(0, 3, (B, Tk // 32)).repeat_interleave(32, dim=1)   # runs of 32, ids 0..2 recurring
    A._block_mask_cache.clear()
    got = A.flex_block_mask(doc, B, Tq, Tk, q_offset, "cpu")
    ref = _dense_twin(doc, B, Tq, Tk, q_offset)
    assert bool((got.to_dense() >= ref.to_dense()).all())
    q, k, v = torch.randn(B, H, Tq, K), torch.randn(B, H, Tk, K), torch.randn(B, H, Tk, K)
    with torch.no_grad():
        out = A.flex_document_attention(q, k, v, 0.25, doc, q_offset, compiled=False)
    assert (out - reference_attention(q, k, v, 0.25, doc, q_offset)).abs().max() < 1e-5


def _spy_block_mask(T, B=1, q_offset=0):
    doc = torch.zeros(B, T, dtype=torch.long, device="meta")      # one document: every tile visible is full
    A._block_mask_cache.clear()
    with AllocSpy() as spy:
        bm = A.flex_block_mask(doc, B, T - q_offset, T, q_offset, "meta")
    A._block_mask_cache.clear()
    del bm
    return spy


def test_block_mask_memory_at_64k_has_no_dense_term(capsys):
    """The block mask of T = 65,536 tokens allocates no [T, T] tensor: peak live bytes within
    64 B per token plus 40 B per (128 x 128) tile, and no single allocation of even T^2 / 1024
    bytes. Printed per T: the block-level term (quadratic in T / 128) is what grows ~4x per
    doubling; the dense mask create_block_mask evaluates would be 8 B * T^2 (32 GiB at 64K)."""
    rows = []
    for T in (8192, 16384, 32768, 65536):
        spy = _spy_block_mask(T)
        tiles = (T // 128) ** 2
        rows.append((T, spy.peak, spy.largest))
        assert spy.peak <= 64 * T + 40 * tiles, (T, spy.peak, spy.largest)
        assert spy.largest[0] < T * T // 1024, (T, spy.largest)
    with capsys.disabled():
        for T, peak, (n, op, shape) in rows:
            print(f"\nflex_block_mask T={T}: peak {peak / 2**20:.2f} MiB (largest {n / 2**20:.2f} MiB: "
                  f"{op} {list(shape)}); dense [T, T] int64 would be {8 * T * T / 2**30:.1f} GiB")
    # with a CP offset (second half of the row) the same bound holds
    spy = _spy_block_mask(65536, q_offset=32768)
    assert spy.peak <= 64 * 65536 + 40 * (65536 // 128) ** 2


def test_attention_flex_path_at_64k_allocates_no_dense_tensor(monkeypatch):
    """The whole attention() path FlexAttention takes at T = 65,536 (device move of the ids, block
    mask, the forward+backward probe, the real call and its backward) on the meta device, with the
    kernel itself replaced by a stand-in that only allocates its outputs (the kernel's own memory
    is measured on a GPU by tools/gpu_check.py): no allocation larger than one [T, H, K]
    activation, peak within six activations plus the block mask's bound."""
    class Kernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bm, scale):
            assert bm.kv_indices.shape[-2:] == (q.shape[2] // 128, k.shape[2] // 128)
            ctx.shapes = (q.shape, k.shape, v.shape)
            return q.new_empty(q.shape[:3] + (v.shape[3],))

        @staticmethod
        def backward(ctx, do):
            return tuple(do.new_empty(s) for s in ctx.shapes) + (None, None)

    real = A._flex_functions()
    monkeypatch.setattr(A, "_flex_functions", lambda: (lambda q, k, v, block_mask, scale: Kernel.apply(
        q, k, v, block_mask, scale), real[1], real[2]))
    monkeypatch.setattr(A, "_flex_device", lambda q: True)
    monkeypatch.setattr(A, "_flex_failed", False)
    monkeypatch.setattr(A, "_flex_probed", {}, raising=False)
    A._block_mask_cache.clear()
    T, H, K = 65536, 1, 64
    doc = torch.zeros(1, T, dtype=torch.long, device="meta")
    q, k, v = (torch.empty(1, H, T, K, device="meta", requires_grad=True) for _ in range(3))
    with AllocSpy() as spy:
        o = A.attention(q, k, v, 0.125, doc)
        o.sum().backward()
    assert not A._flex_failed
    one = q.numel() * q.element_size()                       # 16 MiB; a dense [T, T] int64 mask: 32 GiB
    activations = 6 * one        # o, dq, dk, dv, the probe's output and grad seed (measured: 5.25x)
    assert spy.largest[0] <= one, spy.largest
    assert spy.peak <= activations + 64 * T + 40 * (T // 128) ** 2, (spy.peak, spy.largest)


# ---- the fallback: forward and backward together ---------------------------------------------

def _flex_stub(monkeypatch, backward_fails: bool):
    """Route attention() to a FlexAttention stand-in on CPU: eager flex forward; backward either
    raises (a kernel that compiles for the forward only) or is the reference's gradient."""
    real = A._flex_functions()
    calls = {"fwd": 0}

    class Stub(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, bm, scale):
            calls["fwd"] += 1
            ctx.save_for_backward(q, k, v)
            ctx.bm, ctx.scale = bm, scale
            return real[1](q.detach(), k.detach(), v.detach(), block_mask=bm, scale=scale)

        @staticmethod
        def backward(ctx, do):
            if backward_fails:
                raise RuntimeError("stub: no backward kernel for these shapes")
            q, k, v = ctx.saved_tensors
            with torch.enable_grad():
                ins = [x.detach().requires_grad_() for x in (q, k, v)]
                o = reference_attention(*ins, ctx.scale, Stub.doc, Stub.q_offset)
                g = torch.autograd.grad(o, ins, do)
            return g[0], g[1], g[2], None, None

    def compiled(q, k, v, block_mask, scale):
        return Stub.apply(q, k, v, block_mask, scale)

    monkeypatch.setattr(A, "_flex_functions", lambda: (compiled, real[1], real[2]))
    monkeypatch.setattr(A, "_flex_device", lambda q: True, raising=False)
    monkeypatch.setattr(A, "_flex_failed", False)
    monkeypatch.setattr(A, "_flex_probed", {}, raising=False)
    A._block_mask_cache.clear()
    return Stub, calls


def _case():
    torch.manual_seed(11)
    B, H, Tk, q_offset, K = 2, 2, 160, 32, 16
    doc = torch.zeros(B, Tk, dtype=torch.long)
    doc[:, 70:] = 1
    doc[1, 120:] = 2
    q = torch.randn(B, H, Tk - q_offset, K, requires_grad=True)
    k, v = torch.randn(B, H, Tk, K, requires_grad=True), torch.randn(B, H, Tk, K, requires_grad=True)
    return q, k, v, doc, q_offset


def _grads(fn, q, k, v):
    for x in (q, k, v):
        x.grad = None
    o = fn(q, k, v)
    (o * torch.linspace(-1, 1, o.shape[-1])).sum().backward()
    return o.detach(), [x.grad.clone() for x in (q, k, v)]


def test_flex_backward_failure_falls_back_for_forward_and_backward(monkeypatch):
    """A FlexAttention whose backward raises: attention() notices it before the real call (the
    probe runs forward and backward) and takes chunked_attention for both; the loss's gradients
    equal the dense reference's. Before the fix the forward ran FlexAttention and backward raised."""
    stub, calls = _flex_stub(monkeypatch, backward_fails=True)
    q, k, v, doc, off = _case()
    stub.doc, stub.q_offset = doc, off
    with pytest.warns(UserWarning, match="forward and backward"):
        o, g = _grads(lambda q, k, v: A.attention(q, k, v, 0.25, doc, q_offset=off), q, k, v)
    ro, rg = _grads(lambda q, k, v: reference_attention(q, k, v, 0.25, doc, off), q, k, v)
    assert (o - ro).abs().max() < 1e-5
    for a, b in zip(g, rg):
        assert (a - b).abs().max() < 1e-5
    assert A._flex_failed and calls["fwd"] == 1          # the probe only; later calls go straight to chunked
    _grads(lambda q, k, v: A.attention(q, k, v, 0.25, doc, q_offset=off), q, k, v)
    assert calls["fwd"] == 1


def test_flex_path_taken_when_forward_and_backward_work(monkeypatch):
    """The same stand-in with a working backward: attention() runs FlexAttention (probe + real
    call, then the real call alone), no fallback; its output and gradients match chunked."""
    stub, calls = _flex_stub(monkeypatch, backward_fails=False)
    q, k, v, doc, off = _case()
    stub.doc, stub.q_offset = doc, off
    o, g = _grads(lambda q, k, v: A.attention(q, k, v, 0.25, doc, q_offset=off), q, k, v)
    assert not A._flex_failed and calls["fwd"] == 2
    _grads(lambda q, k, v: A.attention(q, k, v, 0.25, doc, q_offset=off), q, k, v)
    assert calls["fwd"] == 3
    co, cg = _grads(lambda q, k, v: chunked_attention(q, k, v, 0.25, doc, 32, 32, off), q, k, v)
    assert (o - co).abs().max() < 1e-5
    for a, b in zip(g, cg):
        assert (a - b).abs().max() < 1e-5


def test_flex_probe_inside_activation_checkpoint(monkeypatch):
    """The first call inside a non-reentrant activation checkpoint (megak3/model/recompute.py): the
    probe's saved tensors bypass the checkpoint's hooks, so FlexAttention is kept, forward and
    recomputation take the same path, and the gradients are the reference's."""
    from torch.utils.checkpoint import checkpoint

    stub, calls = _flex_stub(monkeypatch, backward_fails=False)
    q, k, v, doc, off = _case()
    stub.doc, stub.q_offset = doc, off
    o, g = _grads(lambda q, k, v: checkpoint(lambda *x: A.attention(*x, 0.25, doc, q_offset=off), q, k, v,
                                             use_reentrant=False), q, k, v)
    assert not A._flex_failed and calls["fwd"] == 3      # probe, forward, recomputation
    ro, rg = _grads(lambda q, k, v: reference_attention(q, k, v, 0.25, doc, off), q, k, v)
    assert (o - ro).abs().max() < 1e-5
    for a, b in zip(g, rg):
        assert (a - b).abs().max() < 1e-5
