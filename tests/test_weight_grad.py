"""Deferred weight gradients (megak3/ops/weight_grad.py): B (backward inside capture) leaves the
GEMM weights' gradients unset and W (flush) produces exactly the one-pass gradients, for
nn.Linear with bias, tied/shared weights, a derived (fake-quantized) weight, routed-expert grouped
GEMMs (both code paths) and activation checkpointing; a whole k3_tiny model too."""
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megak3.config import load_model_config
from megak3.model.k3 import build_model
from megak3.ops.grouped_gemm import grouped_linear
from megak3.ops.weight_grad import WeightGradStore, checkpoint_contexts
from parallel.testing import PARITY_MODEL, global_batch, local_rows


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _split_vs_plain(params, loss_fn):
    loss_fn().backward()
    ref = [None if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    store = WeightGradStore()
    with store.capture():
        loss = loss_fn()
        store.key = "mb0"
        loss.backward()
        after_b = [p.grad is None for p in params]
        assert store.pending("mb0") and store.bytes_held > 0
        store.flush("mb0")
    assert store.bytes_held == 0 and not store.pending("mb0")
    return ref, [p.grad for p in params], after_b


@pytest.mark.parametrize("gmm", [False, True])
def test_linear_grouped_and_derived_weights(gmm):
    torch.manual_seed(0)
    lin, lin2 = nn.Linear(8, 6), nn.Linear(6, 8, bias=False)
    W = nn.Parameter(torch.randn(3, 8, 8))  # grouped_mm needs 16-byte strides
    x0 = torch.randn(7, 8, requires_grad=True)
    counts = torch.tensor([2, 0, 5])

    def loss_fn():
        h = lin2(torch.tanh(lin(x0)))
        h = checkpoint(lambda t: lin2(torch.tanh(lin(t))), h, use_reentrant=False, context_fn=checkpoint_contexts) + h
        wq = torch.round(W * 8) / 8 + (W - W.detach())  # fake-quant with a straight-through estimator
        y = grouped_linear(h, wq, counts, gmm)
        return y.pow(2).sum() + grouped_linear(h, wq, counts, gmm).sum() + lin(x0).sum()

    params = [lin.weight, lin.bias, lin2.weight, W, x0]
    ref, got, after_b = _split_vs_plain(params, loss_fn)
    assert after_b == [True, False, True, True, False]  # GEMM weights wait for W; bias and input do not
    for r, g in zip(ref, got):
        assert _rel(g, r) < 1e-6


@pytest.mark.parametrize("ckpt", [False, True])
def test_k3_tiny_split_backward_matches(ckpt):
    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    model = build_model(cfg, seed=3)
    model.gradient_checkpointing = ckpt
    ids, labels, _ = global_batch(0, 1, 32, cfg.vocab_size)
    a, b, cu = local_rows(ids, labels, 0, 1)
    params = [p for p in model.parameters()]

    def loss_fn():
        return model(a, labels=b, cu_seqlens=cu).loss

    ref, got, after_b = _split_vs_plain(params, loss_fn)
    assert sum(after_b) > len(params) // 3  # the linears and experts were deferred
    for (name, _), r, g in zip(model.named_parameters(), ref, got):
        assert (r is None) == (g is None), name
        if r is not None:
            assert _rel(g, r) < 1e-5, name
