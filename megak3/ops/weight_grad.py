"""Deferred weight gradients: split a backward pass into B (input gradients) and W (weight gradients).

Zero-bubble pipeline schedules (Qi et al., 2023) run a micro-batch's backward in two parts: B, which
computes the gradient that the previous stage is waiting for, and W, the weight gradients, which
nothing downstream needs and which the schedule can place in what would otherwise be a bubble.

Inside ``with store.capture():`` (the forward *and* the backward of a micro-batch; activation
checkpointing passes ``context_fn=checkpoint_contexts`` so its recomputation defers alike), every
``F.linear`` whose weight requires a gradient (nn.Linear, the tensor-parallel linears and the QAT
linears all end in it) and every routed-expert GEMM (``megak3.model.moe.grouped_linear``) runs
through an autograd function whose backward returns only the input (and bias) gradient and records
the GEMM's (input, output-gradient) pair under ``store.key``. ``store.flush(key)`` later computes
``dW = g^T x`` for every recorded GEMM and feeds it into the weight's autograd graph with one
``torch.autograd.backward`` call: a leaf weight accumulates into ``.grad`` (hooks fire as usual); a
derived weight (QAT fake-quant, MoonEP replicas, ...) carries the gradient through its own graph,
which B never ran and therefore never freed. Several GEMMs on one weight tensor are summed first.
A routed-expert dW is formed in its forward's compute dtype (bf16 under autocast, as autograd's
grouped_mm backward does), so it reaches the same bf16 grouped GEMM (tests/test_cuda_constraints.py).
Other parameters (norms, gates, small vectors) get their gradients in B as usual. Outside
``capture()`` the functions are plain ``F.linear`` / ``grouped_linear``.

B + W compute the same sums as one backward, in a different fp32 order (dW is formed here as one
g^T x GEMM, and GEMMs sharing a weight are added before accumulation): on k3_tiny the gradients
agree to <= 7.3e-6 relative (tests/test_weight_grad.py, tests/test_pipeline.py).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_ACTIVE: List["WeightGradStore"] = []


def active_store() -> Optional["WeightGradStore"]:
    """The store capturing weight gradients now (None outside ``WeightGradStore.capture``)."""
    return _ACTIVE[-1] if _ACTIVE else None


def checkpoint_contexts():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: the
    recomputation in backward (where torch-function modes are not active) deferred the same GEMMs
    as the forward did, so the recomputed graph saves the same tensors."""
    store = active_store()
    return contextlib.nullcontext(), (_LinearMode(store) if store is not None else contextlib.nullcontext())


class WeightGradStore:
    """Deferred weight-gradient work, kept per key (e.g. (model chunk, micro-batch))."""

    def __init__(self):
        self.key = None
        """where the next recorded GEMMs go; set it before each backward"""
        self._pending: Dict[object, list] = {}
        self.bytes_held = 0
        """bytes of (input, output-gradient) pairs waiting for their W (for activation meters)"""

    # ---- recording -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self):
        _ACTIVE.append(self)
        try:
            with _LinearMode(self):
                yield self
        finally:
            _ACTIVE.remove(self)

    def _record(self, item) -> None:
        if self.key is None:
            raise RuntimeError("WeightGradStore: a deferred GEMM ran its backward with no store.key set")
        self._pending.setdefault(self.key, []).append(item)
        self.bytes_held += _item_bytes(item)

    def defer_linear(self, weight, x, g) -> None:
        self._record(("linear", weight, x, g))

    def defer_grouped(self, weight, x, g, counts, impl=None, dtype=None) -> None:
        """``dtype``: the forward's compute dtype (bf16 under autocast), in which dW is formed."""
        self._record(("grouped", weight, x, g, counts, impl, dtype))

    def defer_call(self, fn: Callable[[], None]) -> None:
        """Any other deferred weight-gradient work (a closure run at flush)."""
        self._record(("call", fn))

    def pending(self, key) -> bool:
        return key in self._pending

    # ---- W ---------------------------------------------------------------------------------------
    def flush(self, key) -> None:
        """Compute and accumulate every weight gradient recorded under ``key``."""
        items = self._pending.pop(key, [])
        grads: Dict[int, list] = {}
        for item in items:
            self.bytes_held -= _item_bytes(item)
            kind = item[0]
            if kind == "call":
                item[1]()
                continue
            w = item[1]
            if kind == "linear":
                _, _, x, g = item
                gw = g.reshape(-1, g.shape[-1]).T.to(w.dtype) @ x.reshape(-1, x.shape[-1]).to(w.dtype)
            else:
                from megak3.model.moe import grouped_weight_grad

                _, _, x, g, counts, impl, dt = item
                dt = dt or w.dtype   # the forward's compute dtype, as autograd's dW of grouped_mm
                gw = grouped_weight_grad(x.to(dt), g.to(dt), counts, w.shape[0], impl).to(w.dtype)
            slot = grads.setdefault(id(w), [w, None])
            slot[1] = gw if slot[1] is None else slot[1] + gw
        if grads:
            ws, gs = zip(*grads.values())
            torch.autograd.backward(list(ws), grad_tensors=list(gs))

    def flush_all(self) -> None:
        for key in list(self._pending):
            self.flush(key)


def _item_bytes(item) -> int:
    return sum(t.numel() * t.element_size() for t in item[2:4]) if item[0] != "call" else 0


class _Weight:
    """Carries a weight into an autograd function *without* an autograd edge: B never enters the
    weight's own graph (QAT fake-quant, fetched replicas), so it is still intact, and unfreed, at W."""

    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, store, weight: _Weight):
        ctx.save_for_backward(x)
        ctx.store, ctx.weight, ctx.has_bias = store, weight.w, bias is not None
        return F.linear(x, weight.w.detach(), bias)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        w = ctx.weight
        gx = g @ w.detach().to(g.dtype) if ctx.needs_input_grad[0] else None
        gb = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        ctx.store.defer_linear(w, x, g)
        ctx.weight = None
        return gx, gb, None, None


class _DeferredGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_XI, counts, store, use_grouped_mm, weight: _Weight):
        from megak3.model.moe import grouped_linear

        ctx.save_for_backward(x_XI, counts)
        ctx.store, ctx.gmm, ctx.weight = store, use_grouped_mm, weight.w
        y = grouped_linear(x_XI, weight.w.detach(), counts, use_grouped_mm)
        ctx.dt = y.dtype
        return y

    @staticmethod
    def backward(ctx, g_XO):
        from megak3.model.moe import grouped_linear

        x_XI, counts = ctx.saved_tensors
        w = ctx.weight
        gx = None
        if ctx.needs_input_grad[0]:  # g_e @ w_e = g_e @ (w_e^T)^T
            gx = grouped_linear(g_XO.contiguous(), w.detach().transpose(-2, -1).contiguous().to(g_XO.dtype),
                                counts, ctx.gmm)
        ctx.store.defer_grouped(w, x_XI, g_XO, counts, ctx.gmm, ctx.dt)
        ctx.weight = None
        return gx, None, None, None, None


def deferred_grouped_linear(store, x_XI, w_EOI, tokens_per_expert_E, use_grouped_mm):
    """``grouped_linear`` whose weight gradient waits for ``store.flush`` (no host sync: the counts
    stay a device tensor, dW is :func:`megak3.model.moe.grouped_weight_grad`)."""
    return _DeferredGroupedLinear.apply(x_XI, tokens_per_expert_E, store, use_grouped_mm, _Weight(w_EOI))


class _LinearMode(TorchFunctionMode):
    """Routes ``F.linear`` with a trainable weight through :class:`_DeferredLinear`."""

    def __init__(self, store: WeightGradStore):
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x = args[0] if args else kwargs["input"]
            w = args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(w, torch.Tensor) and w.requires_grad and isinstance(x, torch.Tensor) and x.requires_grad:
                return _DeferredLinear.apply(x, b, self.store, _Weight(w))
        return func(*args, **kwargs)
