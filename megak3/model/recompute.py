"""Activation recomputation (``train.recompute``): what a decoder layer keeps for backward.

    none       keep every activation autograd saves (fastest, most memory)
    full       keep only each decoder layer's inputs; rerun the whole layer in backward
               (torch.utils.checkpoint around the layer)
    selective  per sub-block: rerun the cheap, memory-heavy element-wise work, keep the GEMM outputs
               and the attention cores' own saved tensors

Selective (measured on k3_tiny, tools/bench_long_context.py --recompute): every decoder layer is cut
into segments, each run under ``torch.utils.checkpoint`` with a selective-checkpoint policy that
*saves* the outputs of matrix products (mm/addmm/bmm/baddbmm/grouped_mm: the expensive ops) and
recomputes everything else (norms, AttnRes mixing, SiTU-GLU, the KDA short convolutions, L2 norms,
gates, sigmoids, index gathers/scatters, dtype casts). The segments are

  * AttnRes mix + input RMSNorm; the AttnRes mix + post-attention RMSNorm;
  * KDA: projections + short convolutions + L2 norms + decay gate + beta (they hand q, k, v, g,
    beta to the core); the output RMSNorm + sigmoid gate + o_proj;
  * KDA core (the chunked delta rule): also under the policy, so its chunk matrices and states
    (bmm/baddbmm outputs) are kept and its element-wise intermediates (decay exponentials,
    reciprocals, masks, casts; about half its saved bytes) are recomputed;
  * MLA: latent projections + norms + K/V expansion (hands the expanded q, k, v to the core); the
    sigmoid gate + o_proj. The attention core is NOT in a segment: the chunked/flash attention
    already keeps only q, k, v, o and the fp32 log-sum-exp and recomputes the probabilities in its
    own backward, so recomputing its forward as well would cost a full attention pass (the O(T^2)
    part at long T) to free O(T) bytes;
  * the MLP / LatentMoE: router, expert down/up projections, grouped expert GEMMs and the shared
    experts keep their GEMM outputs; SiTU-GLU, the routing gathers and the combine are recomputed.

The policies recompute, they do not approximate: losses and gradients equal those of ``none``
(tests/test_recompute.py). Under the zero-bubble weight-gradient store the recomputation defers its
GEMMs like the forward did (``checkpoint_contexts``).
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..ops.weight_grad import checkpoint_contexts

MODES = ("none", "full", "selective")

_aten = torch.ops.aten
SAVE_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._grouped_mm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
})
"""ops whose outputs a selective segment keeps (everything else is recomputed in backward)"""


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """``context_fn`` of a selective segment: the op policy, plus the weight-gradient store's
    recomputation mode (``checkpoint_contexts``) when one is capturing."""
    fwd, rec = create_selective_checkpoint_contexts(_policy)
    _, lin_rec = checkpoint_contexts()

    @contextlib.contextmanager
    def both():
        with lin_rec, rec:
            yield

    return fwd, both()


_state = threading.local()


def selective_active() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def selective_scope():
    """Inside: :func:`segment` checkpoints its sub-block (the decoder layers enter it under
    ``recompute='selective'`` while training with gradients)."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def segment(fn, *args):
    """``fn(*args)``; inside :func:`selective_scope` (with gradients on) as a selective-checkpoint
    segment: its GEMM outputs kept, the rest recomputed in backward."""
    if selective_active() and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, context_fn=selective_contexts)
    return fn(*args)


def recompute_whole(fn, *args):
    """``fn(*args)`` keeping only its inputs: rerun whole in backward (torch.utils.checkpoint, with the
    weight-gradient store's recomputation mode); a plain call without gradients. Used for decoder
    layers under ``recompute='full'`` and for every vision-tower block under any recompute mode."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=checkpoint_contexts)
