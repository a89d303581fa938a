"""Deferred weight gradients: split a backward pass into B (input gradients) and W (weight gradients).

Zero-bubble pipeline schedules (Qi et al., 2023) run a micro-batch's backward in two parts: B, which
computes the gradient that the previous stage is waiting for, and W, the weight gradients, which
nothing downstream needs and which the schedule can place in what would otherwise be a bubble.

Inside ``with store.capture():`` (the forward *and* the backward of a micro-batch; activation
checkpointing passes ``context_fn=checkpoint_contexts`` so its recomputation defers alike), every
``F.linear`` whose weight requires a gradient (nn.Linear, the tensor-parallel linears and the QAT
linears all end in it) and every routed-expert GEMM (``megak3.ops.grouped_gemm.grouped_linear``) runs
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

    def defer_gemm(self, weight, x, g, dw: Callable) -> None:
        """Any other GEMM on ``weight``: ``dw(weight, x, g)`` gives its weight gradient at flush
        (megak3/ops/grouped_gemm.py defers the routed-expert GEMMs this way)."""
        self._record(("gemm", weight, x, g, dw))

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
                _, _, x, g, dw = item
                gw = dw(w, x, g)
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


class WeightRef:
    """Carries a weight into an autograd function *without* an autograd edge: B never enters the
    weight's own graph (QAT fake-quant, fetched replicas), so it is still intact, and unfreed, at W."""

    __slots__ = ("w",)

    def __init__(self, w):
        self.w = w


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, store, weight: WeightRef):
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
                return _DeferredLinear.apply(x, b, self.store, WeightRef(w))
        return func(*args, **kwargs)
