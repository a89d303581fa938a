"""MLA's attention under balanced context parallelism (``parallel.cp_balance``): queries against keys /
values expanded from the compressed latent one key block at a time, the blocks' partial outputs
merged by their log-sum-exp, so at most one block's expanded K/V exists at once.

Shapes: ``q_BHTK`` [B, H, Tq, K] (queries at positions ``[q_pos0, q_pos0 + Tq)``), ``latent_BTL``
[B, Tk, L] (keys at ``[0, Tk)``), ``expand(latent[:, k0:k1]) -> (k [B, H, n, K], v [B, H, n V])``;
documents ``doc_q_BT`` [B, Tq] / ``doc_k_BT`` [B, Tk] (both or neither). The mask is that of
:func:`megak3.ops.attention.reference_attention` with ``q_offset = q_pos0``.

Two forms of one computation (:func:`latent_attention` picks):

- ``_LatentAttention``, the chunked twin (every device; the CPU path): per key block the chunked
  online softmax of megak3/ops/attention.py (``_forward``), the merge below; backward re-expands
  each block and runs the flash backward (``_backward``) against the final log-sum-exp.
- ``_FlexLatentAttention`` (CUDA): per key block one FlexAttention call that also returns its
  log-sum-exp (``return_aux=AuxRequest(lse=True)``; block mask from block bounds,
  :func:`megak3.ops.attention.build_block_mask`, the offset a device tensor so one compiled kernel
  serves every block), the same merge. Backward, per key block: re-expand K/V and backpropagate
  through the block's FlexAttention call the block's share of the output gradient,
  ``do_j = w_j do`` and ``dlse_j = w_j rowsum(do * (o_j - o))`` with ``w_j = exp(lse_j - lse)``
  (``o = sum_j w_j o_j``, so d o / d lse_j = w_j (o_j - o)); the kernel's score gradient
  ``p_j (do_j v^T - rowsum(do_j * o_j)) + p_j dlse_j`` is then ``p (do v^T - rowsum(do * o))`` of the
  whole softmax (p = w_j p_j): the exact gradient. Tested on CPU with a dense differentiable block
  function in place of FlexAttention (torch 2.13 has no FlexAttention backward on CPU), and eager
  FlexAttention's forward against the chunked twin (tests/test_latent_flex.py); the compiled CUDA
  kernels, forward and backward, in tools/gpu_check.py (tools/gpu_checks/attention.py).

Merge (both forms): ``lse = logaddexp(lse_acc, lse_j)``, ``o = o_acc exp(lse_acc - lse) + o_j
exp(lse_j - lse)`` in fp32; a query with no allowed key in a block has o_j = 0, lse_j = -inf.

On CUDA the FlexAttention form is tried once per call signature (forward and backward on detached
copies, as ``attention``'s probe does); if that raises, a warning is issued once and the chunked
twin serves every later call (``megak3.ops.attention._flex_failed``).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import attention as A
from .attention import DEFAULT_K_CHUNK, DEFAULT_Q_CHUNK, _backward, _forward, _Plan

__all__ = ["latent_attention", "flex_block_lse"]


def _key_blocks(q_pos0: int, Tq: int, Tk: int, k_block: int):
    """(k0, k1) of the key blocks with some key not in the future of the last query."""
    last = min(Tk, q_pos0 + Tq)
    return [(k0, min(k0 + k_block, Tk)) for k0 in range(0, last, k_block)]


def _block_plan(Tq, q_chunk, k_chunk, doc_q_BT, doc_k_BT, q_pos0, k0, k1):
    doc_k = None if doc_k_BT is None else doc_k_BT[:, k0:k1]
    return _Plan(Tq, q_chunk, k_chunk, doc_k, q_pos0 - k0, k1 - k0, None if doc_k is None else doc_q_BT)


def _merge(o_acc, lse_acc, o, lse):
    """The running (o, lse) of the blocks so far merged with one more block's (fp32)."""
    if o_acc is None:
        return o, lse
    new = torch.logaddexp(lse_acc, lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    o_acc = o_acc.mul_((lse_acc - safe).exp_().unsqueeze(-1)).add_(o.mul_((lse - safe).exp_().unsqueeze(-1)))
    return o_acc, new


def _autocast_state(q):
    dev = q.device.type
    return dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


class _LatentAttention(torch.autograd.Function):
    """The chunked twin (module docstring)."""

    @staticmethod
    def forward(ctx, q, latent, doc_q, doc_k, expand, scale, q_pos0, k_block, q_chunk, k_chunk, *params):
        B, H, Tq, _ = q.shape
        o_acc = lse_acc = None
        for k0, k1 in _key_blocks(q_pos0, Tq, latent.shape[1], k_block):
            plan = _block_plan(Tq, q_chunk, k_chunk, doc_q, doc_k, q_pos0, k0, k1)
            k, v = expand(latent[:, k0:k1])
            o, lse = _forward(q, k, v, None if doc_k is None else doc_k[:, k0:k1], scale, plan)
            del k, v
            o_acc, lse_acc = _merge(o_acc, lse_acc, o.float(), lse)
        o = o_acc.to(q.dtype)
        ctx.save_for_backward(q, latent, o, lse_acc, doc_q, doc_k, *params)
        ctx.expand, ctx.scale, ctx.q_pos0, ctx.k_block, ctx.chunks = expand, scale, q_pos0, k_block, (q_chunk, k_chunk)
        ctx.autocast = _autocast_state(q)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, latent, o, lse, doc_q, doc_k, *params = ctx.saved_tensors
        Tq = q.shape[2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dlatent = torch.zeros(latent.shape, dtype=torch.float32, device=q.device)
        dparams = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        dev, enabled, dtype = ctx.autocast
        for k0, k1 in _key_blocks(ctx.q_pos0, Tq, latent.shape[1], ctx.k_block):
            plan = _block_plan(Tq, *ctx.chunks, doc_q, doc_k, ctx.q_pos0, k0, k1)
            lat = latent[:, k0:k1].detach().requires_grad_()
            with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                k, v = ctx.expand(lat)
            dq_j, dk, dv = _backward(do, q, k.detach(), v.detach(), o, lse,
                                     None if doc_k is None else doc_k[:, k0:k1], ctx.scale, plan)
            dq.add_(dq_j)
            grads = torch.autograd.grad((k, v), [lat, *params], (dk.to(k.dtype), dv.to(v.dtype)),
                                        allow_unused=True)
            dlatent[:, k0:k1] = grads[0].float()
            for acc, g in zip(dparams, grads[1:]):
                if g is not None:
                    acc.add_(g.float())
        return (dq.to(q.dtype), dlatent.to(latent.dtype), None, None, None, None, None, None, None, None,
                *[g.to(p.dtype) for g, p in zip(dparams, params)])


def flex_block_lse(q, k, v, scale: float, doc_q: Optional[torch.Tensor], doc_k: Optional[torch.Tensor],
                   q_offset: int, compiled: bool = True):
    """(o [B, H, Tq, V], lse [B, H, Tq] fp32, natural log) of FlexAttention of queries at ``q_offset``
    (any integer: the queries' positions relative to the first key) against ``k``, ``v`` [B, H, Tk, .]
    under the causal same-document mask (``doc_q`` [B, Tq] / ``doc_k`` [B, Tk], or both None).
    ``compiled=False``: torch's eager FlexAttention (dense scores; forward only on CPU in torch 2.13)."""
    from torch.nn.attention.flex_attention import AuxRequest

    compiled_fn, eager_fn, _ = A._flex_functions()
    B, _, Tq, _ = q.shape
    off = torch.full((), q_offset, dtype=torch.int64, device=q.device)  # a fill: no host-to-device copy
    bm = A.build_block_mask(doc_k, B, Tq, k.shape[2], q_offset, q.device, doc_q_BT=doc_q, offset_t=off)
    o, aux = (compiled_fn if compiled else eager_fn)(q, k, v, block_mask=bm, scale=scale,
                                                     return_aux=AuxRequest(lse=True))
    return o, aux.lse.float()


class _FlexLatentAttention(torch.autograd.Function):
    """The FlexAttention form (module docstring); ``block_fn(q, k, v, scale, doc_q, doc_k, q_offset) ->
    (o, lse)`` is :func:`flex_block_lse` in production (a differentiable twin in tests)."""

    @staticmethod
    def forward(ctx, q, latent, doc_q, doc_k, expand, scale, q_pos0, k_block, block_fn, *params):
        Tq = q.shape[2]
        o_acc = lse_acc = None
        for k0, k1 in _key_blocks(q_pos0, Tq, latent.shape[1], k_block):
            k, v = expand(latent[:, k0:k1])
            o, lse = block_fn(q.to(k.dtype), k, v, scale, doc_q, None if doc_k is None else doc_k[:, k0:k1],
                              q_pos0 - k0)
            del k, v
            o_acc, lse_acc = _merge(o_acc, lse_acc, o.float(), lse.float())
        ctx.save_for_backward(q, latent, o_acc, lse_acc, doc_q, doc_k, *params)
        ctx.expand, ctx.scale, ctx.q_pos0, ctx.k_block, ctx.block_fn = expand, scale, q_pos0, k_block, block_fn
        ctx.autocast = _autocast_state(q)
        return o_acc.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, latent, o, lse, doc_q, doc_k, *params = ctx.saved_tensors
        Tq = q.shape[2]
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dlatent = torch.zeros(latent.shape, dtype=torch.float32, device=q.device)
        dparams = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        dev, enabled, dtype = ctx.autocast
        do32 = do.float()
        safe = lse.masked_fill(lse == float("-inf"), 0.0)
        for k0, k1 in _key_blocks(ctx.q_pos0, Tq, latent.shape[1], ctx.k_block):
            lat = latent[:, k0:k1].detach().requires_grad_()
            qd = q.detach().requires_grad_()
            with torch.enable_grad():
                with torch.autocast(dev, dtype=dtype, enabled=enabled):
                    k, v = ctx.expand(lat)
                o_j, lse_j = ctx.block_fn(qd.to(k.dtype), k, v, ctx.scale, doc_q,
                                          None if doc_k is None else doc_k[:, k0:k1], ctx.q_pos0 - k0)
            w = (lse_j.detach().float() - safe).exp()                      # 0 where the block has no key
            g_o = w.unsqueeze(-1) * do32
            g_lse = w * (do32 * (o_j.detach().float() - o)).sum(-1)
            trained = [n for n, p in enumerate(params) if p.requires_grad]
            grads = torch.autograd.grad((o_j, lse_j), [qd, lat, *[params[n] for n in trained]],
                                        (g_o.to(o_j.dtype), g_lse.to(lse_j.dtype)), allow_unused=True)
            if grads[0] is not None:
                dq.add_(grads[0].float())
            if grads[1] is not None:
                dlatent[:, k0:k1] = grads[1].float()
            for n, g in zip(trained, grads[2:]):
                if g is not None:
                    dparams[n].add_(g.float())
        return (dq.to(q.dtype), dlatent.to(latent.dtype), None, None, None, None, None, None, None,
                *[g.to(p.dtype) for g, p in zip(dparams, params)])


_probed: dict = {}
"""call signatures whose FlexAttention form already ran forward and backward once"""


def _flex_probe(q, latent, doc_q, doc_k, expand, params, scale, q_pos0, k_block) -> bool:
    """The FlexAttention form's forward and backward once per call signature, on detached copies
    (identity saved-tensor hooks, so an enclosing activation checkpoint does not see it). On any
    exception: warn once, set ``megak3.ops.attention._flex_failed`` and return False."""
    sig = (tuple(q.shape), tuple(latent.shape), q.dtype, latent.dtype, str(q.device), doc_q is None, q_pos0,
           k_block, torch.is_autocast_enabled(q.device.type))
    if sig in _probed:
        return True
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            ins = [x.detach().requires_grad_() for x in (q, latent)]
            o = _FlexLatentAttention.apply(ins[0], ins[1], doc_q, doc_k, expand, float(scale), int(q_pos0),
                                           int(k_block), flex_block_lse, *params)
            torch.autograd.grad(o, ins, torch.ones_like(o))
    except Exception as e:  # noqa: BLE001 - fall back to the chunked twin for good
        A._flex_failed = True
        warnings.warn(f"FlexAttention with log-sum-exp failed ({type(e).__name__}: {e}); latent_attention "
                      "uses its chunked twin for forward and backward")
        return False
    _probed[sig] = True
    return True


def latent_attention(q_BHTK, latent_BTL, expand, params, scale: float, doc_q_BT: Optional[torch.Tensor] = None,
                     doc_k_BT: Optional[torch.Tensor] = None, q_pos0: int = 0, k_block: int = 1024,
                     q_chunk: int = DEFAULT_Q_CHUNK, k_chunk: int = DEFAULT_K_CHUNK) -> torch.Tensor:
    """Causal same-document attention of ``q_BHTK`` against K/V expanded from ``latent_BTL`` one block
    of ``k_block`` keys at a time (forward, and again in backward); shapes and forms in the module
    docstring. ``params``: the tensors ``expand`` reads that need gradients (their gradients are
    returned). Key blocks wholly in the future of the last query are skipped (never expanded).
    FlexAttention with its log-sum-exp on CUDA, the chunked twin elsewhere (``q_chunk`` /
    ``k_chunk`` apply to it only). Equal to :func:`megak3.ops.attention.chunked_attention` of the
    fully expanded keys with ``q_offset = q_pos0`` (tests/test_cp_balance.py)."""
    if (doc_q_BT is None) != (doc_k_BT is None):
        raise ValueError("latent_attention needs both doc_q_BT and doc_k_BT, or neither")
    if q_pos0 + q_BHTK.shape[2] > latent_BTL.shape[1]:
        raise ValueError(f"q_pos0={q_pos0} with {q_BHTK.shape[2]} queries needs at least "
                         f"{q_pos0 + q_BHTK.shape[2]} keys; got {latent_BTL.shape[1]}")
    dev = q_BHTK.device
    dq = None if doc_q_BT is None else doc_q_BT.to(dev)
    dk = None if doc_k_BT is None else doc_k_BT.to(dev)
    if (A._flex_device(q_BHTK) and not A._flex_failed and A._flex_functions() is not None
            and _flex_probe(q_BHTK, latent_BTL, dq, dk, expand, params, scale, q_pos0, k_block)):
        return _FlexLatentAttention.apply(q_BHTK, latent_BTL, dq, dk, expand, float(scale), int(q_pos0),
                                          int(k_block), flex_block_lse, *params)
    return _LatentAttention.apply(q_BHTK, latent_BTL, dq, dk, expand, float(scale), int(q_pos0), int(k_block),
                                  int(q_chunk), int(k_chunk), *params)
