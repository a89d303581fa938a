"""Context parallelism (CP): each sequence row split into cp contiguous segments, one per CP rank.

Placement. CP rank r of a row of length T holds tokens ``[r*T/cp, (r+1)*T/cp)`` (contiguous), with
the same rows (the same data-parallel micro-batch) on every rank of the CP group. Both layer kinds
read this one placement:

- KDA (69 of K3's 93 layers): the exact state-summary scan (:func:`megak3.ops.kda_cp.kda_cp`) needs
  each rank's segment to be one contiguous run of the recurrence: rank r folds the affine maps of
  ranks 0..r-1 into its incoming state, and the short convolutions take the previous rank's last
  kernel-1 tokens (:func:`megak3.ops.kda_cp.exchange_conv_halo`). Its traffic per layer is
  ``cp*B*H*K*(K+V)`` values, independent of T.
- Gated MLA: every rank all-gathers the compressed latent (``kv_a_proj_with_mqa`` output,
  kv_lora_rank + the rope slot = 576 values per token at K3 size, not the expanded per-head K/V),
  expands K/V locally and runs its local queries against keys ``[0, end of own segment)``
  (:func:`megak3.ops.attention.attention` with ``q_offset``). Backward reduce-scatters the latent's
  gradient (the autograd all-gather of megak3/ops/kda_cp.py).

Cost of contiguous vs head-tail "zigzag" placement (computed from the chunk pairs
:func:`megak3.ops.attention.chunked_attention` visits; it skips key chunks wholly in the future).
Causal MLA: rank r's S = T/cp queries see r*S + i + 1 keys each, so with one document over the row it
computes S^2 * (r + 1/2) scores (forward FLOPs 2 * S^2 * (r + 1/2) * H * (qk + v head dims),
K3: H = 96, 192 + 128): the last rank does (2cp-1)x the score work of rank 0 and (2cp-1)/cp x the
average (cp=4: 7x and 1.75x; cp=32: 63x and 1.97x; the 256-token chunks computed whole on the diagonal
lower these a little: 6.65x and 1.739x at T=16K, cp=4). Packed documents shorter than T/cp even it out
(4K-token documents at T=64K, cp=4: every rank 1.00x the average; bench_long_context's three documents
per row: ranks 0.64 / 0.80 / 1.48 / 1.09x). Memory: rank r expands K/V for (r+1)*S keys, the last rank
for all T (cp x rank 0's); zigzag would not lower that peak with a latent all-gather (the rank holding
the last chunk still needs every earlier key). In a whole layer stack only the MLA score work is uneven
(KDA, MoE and projections do the same work per token on every rank), so by the planner's FLOP model
(megak3/launch/planner.py ``layer_flops_per_token``, one document per row) the last rank's forward work
is, at cp=4 for k3_tiny, 1.17x / 1.40x / 1.62x the average at T = 4K / 16K / 64K (MLA scores
22% / 54% / 82% of the layer FLOPs), and 1.76x for K3 at T = 1M, cp=32 (MLA scores 79%): the planner
charges each pipeline stage its MLA layers' share of that, and a balanced placement would cut the
compute term of such a step by up to 43%. Zigzag (rank r holds chunks r and 2cp-1-r) equalises the
score work, but breaks the KDA scan into two non-adjacent runs per rank: the scan would need two
summaries per rank and a second exclusive fold in the middle of the ring, and the conv halos would come
from two different ranks. We keep one placement for both kinds (contiguous) and accept the MLA
imbalance; at 1M tokens it is the first thing to revisit (listed in the README's CP section). Measured
on this CPU (docs/SCALING.md, k3_tiny, T = 64K, cp=4, the bench's row) the slowest rank's CPU time is
only 1.05x a quarter of cp=1's: CPU time is not proportional to these FLOP shares.

Documents. The global packing (``cu_seqlens`` over the flattened global ``B*T`` stream) is cut per
rank by :func:`megak3.ops.kda_cp.cp_local_docs`: local ``cu_seqlens`` (row ends included), whether
row b's first local token continues the previous rank's document (the KDA scan), global positions
in document (the conv halo masks) and, for MLA, the document ids of the keys ``[0, end)``.

Loss and reductions. Each rank computes the loss of its own tokens' labels (labels are already
shifted by the loader, so the label of a segment's last token is the next segment's first token);
the step's token count is the global one (counted from the whole rows before they are cut), so
``loss_sum_local / step_tokens`` backpropagated on every rank and gradients summed over ``dp x cp``
(``ParallelPlan.grad_group``) give the single-process gradient. Router statistics, Quantile
Balancing and expert loads are reduced over ``dp x cp`` (``ParallelPlan.token_groups``); routed
experts fold over ``cp x dp`` (the expert grid's edp spans the CP ranks, parallel/grid.py).

Nothing here runs for cp = 1: the model's ``context_parallel`` hook stays None.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megak3.model.seqinfo import SeqInfo, make_seq_info
from megak3.ops.kda_cp import all_gather_autograd, conv_halo_seq_info, cp_local_docs, exchange_conv_halo, kda_cp

__all__ = ["CPShard", "ContextParallel", "check_context_parallel", "parallelize_cp"]


def check_context_parallel(cp: int, tp: int, sequence_parallel: bool, seq_len: int, model_cfg=None) -> None:
    """Raise ValueError naming the field when ``parallel.cp`` cannot split ``data.seq_len``."""
    if cp == 1:
        return
    shard = cp * (tp if sequence_parallel and tp > 1 else 1)
    if seq_len % shard:
        what = f"parallel.cp x parallel.tp = {cp} x {tp}" if shard != cp else f"parallel.cp={cp}"
        raise ValueError(f"data.seq_len={seq_len} must be a multiple of {what} (each CP rank holds "
                         f"seq_len/cp contiguous tokens{', split again over TP by SP' if shard != cp else ''})")
    if model_cfg is not None:  # (images under CP are refused where they arrive: K3Model.embed)
        W = model_cfg.kda.conv_kernel
        if seq_len // cp < W - 1:
            raise ValueError(f"data.seq_len/parallel.cp = {seq_len // cp} is shorter than the KDA conv halo "
                             f"(model.kda.conv_kernel-1 = {W - 1}); lower parallel.cp")


@dataclass(eq=False)
class CPShard:
    """One CP rank's view of a batch (``SeqInfo.cp``): what the KDA and MLA layers call under CP."""

    group: object
    size: int
    rank: int
    seqlen: int
    """local tokens per row (T / cp)"""
    continues: list
    """[B] bools: row b's first local token continues the previous rank's last document"""
    cu_seqlens: Optional[torch.Tensor]
    """int32 local document offsets into the flattened local B*T stream (row ends included), or None"""
    pos_in_doc_BT: Optional[torch.Tensor]
    """int64 [B, T/cp] global position in document of every local token, or None (unpacked rows)"""
    key_doc_ids_BT: Optional[torch.Tensor]
    """int64 [B, offset + T/cp] document ids of the keys MLA attends to, or None (one document per row)"""
    _conv_seq: dict = field(default_factory=dict)

    @property
    def offset(self) -> int:
        """global position of this rank's first token in every row"""
        return self.rank * self.seqlen

    def causal_conv(self, conv, x_BTP: torch.Tensor) -> torch.Tensor:
        """``conv`` (a ShortConv) of this segment with the previous rank's last kernel-1 tokens as the
        left context; equal to the whole sequence's conv restricted to this segment."""
        W = conv.kernel
        if W not in self._conv_seq:
            self._conv_seq[W] = conv_halo_seq_info(self.pos_in_doc_BT, W)
        halo = exchange_conv_halo(x_BTP, W, self.group)
        return conv(torch.cat([halo, x_BTP], 1), self._conv_seq[W])[:, W - 1:]

    def kda(self, q, k, v, g, beta, chunk_size: int, use_fla: bool, lower_bound: float = -5.0,
            cu_seqlens_cpu=None) -> torch.Tensor:
        """KDA output of this segment with the exact incoming state of the ranks before it.
        ``lower_bound``: the gate bound g was built with (fla's safe_gate choice); ``cu_seqlens_cpu``:
        host offsets of the local documents (used only when the segment holds document cuts)."""
        o, _ = kda_cp(q, k, v, g, beta, self.group, cu_seqlens=self.cu_seqlens, continues=self.continues,
                      chunk_size=chunk_size, use_fla=use_fla, lower_bound=lower_bound,
                      cu_seqlens_cpu=cu_seqlens_cpu if self.cu_seqlens is not None else None)
        return o

    def gather_keys(self, c_BTL: torch.Tensor) -> torch.Tensor:
        """The latent of every row's tokens ``[0, offset + T/cp)``: ``[B, offset + T/cp, L]``.
        One all-gather over the CP group forward, one reduce-scatter of its gradient backward."""
        B, T, L = c_BTL.shape
        parts = all_gather_autograd(c_BTL, self.group, "mla_latent_")  # [cp, B, T, L]
        keys = parts[: self.rank + 1].permute(1, 0, 2, 3).reshape(B, (self.rank + 1) * T, L)
        return keys


class ContextParallel:
    """The model's ``context_parallel`` hook: cuts whole rows into this rank's segment."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def shard(self, input_ids_BT: torch.Tensor, labels_BT: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor]):
        """(local input ids [B, T/cp], local labels or None, local SeqInfo with ``.cp``) of whole rows
        ``input_ids_BT`` [B, T] packed as ``cu_seqlens`` (global offsets; None = one document per row)."""
        B, T = input_ids_BT.shape
        if T % self.size:
            raise ValueError(f"sequence length {T} is not a multiple of parallel.cp={self.size}")
        Tl, r = T // self.size, self.rank
        dev = input_ids_BT.device
        cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens).cpu()
        docs = cp_local_docs(cu, B, T, self.size, r)
        key_doc = None
        if cu is not None:
            whole = make_seq_info(B, T, cu)
            if whole.cu_seqlens.numel() - 1 != B:  # some row holds more than one document
                key_doc = whole.doc_ids_BT[:, : (r + 1) * Tl].to(dev)
        local_cu = None if docs.cu_seqlens is None else docs.cu_seqlens.to(dev)
        shard = CPShard(self.group, self.size, r, Tl, docs.continues, local_cu,
                        None if docs.pos_in_doc_BT is None else docs.pos_in_doc_BT.to(dev), key_doc)
        seq = dataclasses.replace(make_seq_info(B, Tl, docs.cu_seqlens, dev), cp=shard)
        sl = slice(r * Tl, (r + 1) * Tl)
        labels = None if labels_BT is None else labels_BT[:, sl]
        return input_ids_BT[:, sl], labels, seq


def parallelize_cp(model, ps) -> Optional[ContextParallel]:
    """Set ``model.context_parallel`` when ``ps.cp_size > 1`` (returns the hook, or None)."""
    if ps.cp_size == 1:
        return None
    hook = ContextParallel(ps.cp_group, ps.cp_size, dist.get_rank(ps.cp_group))
    model.context_parallel = hook
    return hook
