"""Vocabulary-parallel embedding and cross entropy (see docs/PARALLEL.md).

Shapes: B batch, T tokens, V vocabulary, tp group size, r this rank's index in the group. Rank r
owns the vocabulary rows ``[r*V/tp, (r+1)*V/tp)``: of the embedding table here, and of the lm_head
in :class:`parallel.parallelize.VocabParallelHead`, whose ``[.., V/tp]`` logits feed
:func:`vocab_parallel_cross_entropy` directly (the full ``[.., V]`` logits never exist).

:class:`VocabParallelEmbedding` is built from the full single-process table
(``from_embedding``, or ``__init__``, which draws the full tensor with the same RNG calls as
``nn.Embedding`` and keeps the shard), so with the same seed it starts from exactly the
single-process weights. The linear layers of a TP model are not special classes: parallelize.py
shards plain ``nn.Linear`` layers in place and wraps their module in a ``TPRegion``.

Collectives come from :mod:`.collectives` only.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import (Group, all_reduce_max, all_reduce_sum, group_rank, group_size, reduce_from_tp,
                          reduce_scatter_to_sp)


class VocabParallelEmbedding(nn.Module):
    """Embedding with vocabulary rows sharded: this rank holds rows ``[r*V/tp, (r+1)*V/tp)``.

    ``ids [B, T]`` (replicated) -> ``[B, T, D]`` (one all-reduce), or ``[B, T/tp, D]`` token-sharded
    under ``sequence_parallel`` (one reduce-scatter). Ids outside this rank's range contribute 0.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group, sequence_parallel: bool = False,
                 *, padding_idx: Optional[int] = None, sequence_dim: int = 1, device=None, dtype=None):
        super().__init__()
        self.group, self.tp = group, group_size(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.padding_idx = padding_idx
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx, device=device, dtype=dtype)
        self._load_full(full.weight)

    def _load_full(self, weight: torch.Tensor) -> None:
        if self.num_embeddings % self.tp:
            raise ValueError(f"tensor-parallel size {self.tp} does not divide the vocabulary size "
                             f"{self.num_embeddings}")
        per_rank = self.num_embeddings // self.tp
        self.vocab_start = group_rank(self.group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        rows = weight.detach()[self.vocab_start:self.vocab_end]
        self.weight = nn.Parameter(rows.clone(memory_format=torch.contiguous_format))  # [V/tp, D]
        # padding_idx only matters (zero grad of that row) on the rank that owns it
        pad = self.padding_idx
        owned = pad is not None and self.vocab_start <= pad < self.vocab_end
        self._local_padding_idx = pad - self.vocab_start if owned else None

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: Group, sequence_parallel: bool = False,
                       **kwargs) -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``nn.Embedding`` (copied, not shared)."""
        if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
            raise ValueError("VocabParallelEmbedding supports plain embeddings only "
                             "(max_norm=None, scale_grad_by_freq=False, sparse=False)")
        layer = cls(emb.num_embeddings, emb.embedding_dim, group, sequence_parallel,
                    padding_idx=emb.padding_idx, device="meta", **kwargs)
        layer._load_full(emb.weight)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight, self._local_padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, self._local_padding_idx)
        # zeroing the output also zeroes the grad those positions would send to local row 0
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.group, dim=self.sequence_dim)
        return reduce_from_tp(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp}, "
                f"rows=[{self.vocab_start}, {self.vocab_end}), sp={self.sequence_parallel}")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over a vocabulary split across ranks; math in fp32.

    Two all-reduces in forward (MAX of the row maxima; one SUM of the stacked [sum-exp, target
    logit] -- both sums fuse into one call), none in backward: d loss_i / d logit_ij =
    softmax_ij - [j == target_i], computed on the local shard only.
    """

    @staticmethod
    def forward(ctx, logits_local, target, group, ignore_index, reduction):
        x_NV = logits_local.float()
        n_local = x_NV.shape[-1]
        start = group_rank(group) * n_local
        row_max_N = all_reduce_max(x_NV.max(dim=-1).values, group)
        shifted_NV = x_NV - row_max_N.unsqueeze(-1)  # <= 0: exp cannot overflow
        exp_NV = shifted_NV.exp()

        valid_N = target != ignore_index
        local_t_N = target - start
        here_N = valid_N & (local_t_N >= 0) & (local_t_N < n_local)
        local_t_N = local_t_N.masked_fill(~here_N, 0)
        target_logit_N = shifted_NV.gather(-1, local_t_N.unsqueeze(-1)).squeeze(-1).masked_fill(~here_N, 0.0)
        sums_2N = all_reduce_sum(torch.stack([exp_NV.sum(dim=-1), target_logit_N]), group)
        sum_exp_N, target_logit_N = sums_2N[0], sums_2N[1]

        loss_N = (sum_exp_N.log() - target_logit_N).masked_fill(~valid_N, 0.0)
        n_valid = valid_N.sum()
        softmax_NV = exp_NV.div_(sum_exp_N.unsqueeze(-1))  # exp_NV is ours: reuse its memory
        ctx.save_for_backward(softmax_NV, local_t_N, here_N, valid_N, n_valid)
        ctx.reduction, ctx.in_dtype = reduction, logits_local.dtype
        if reduction == "none":
            return loss_N
        if reduction == "sum":
            return loss_N.sum()
        return loss_N.sum() / n_valid  # "mean" over non-ignored targets; 0/0 = nan like F.cross_entropy

    @staticmethod
    def backward(ctx, g):
        softmax_NV, local_t_N, here_N, valid_N, n_valid = ctx.saved_tensors
        g = g.float()
        if ctx.reduction == "none":
            scale_N = g
        elif ctx.reduction == "sum":
            scale_N = g.expand(valid_N.shape)
        else:
            scale_N = (g / n_valid).expand(valid_N.shape)
        scale_N = scale_N.masked_fill(~valid_N, 0.0)
        grad_NV = softmax_NV * scale_N.unsqueeze(-1)  # new tensor: the saved softmax stays intact
        grad_NV.scatter_add_(-1, local_t_N.unsqueeze(-1), (-scale_N * here_N).unsqueeze(-1))
        return grad_NV.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, target: torch.Tensor, group: Group,
                                 ignore_index: int = -100, reduction: str = "sum") -> torch.Tensor:
    """Cross entropy of ``logits_local [N, V/tp]`` (this rank's vocabulary columns
    ``[r*V/tp, (r+1)*V/tp)``) against ``target [N]`` (full-vocabulary ids, identical on all ranks).

    Equals ``F.cross_entropy(full_logits, target, ignore_index=..., reduction=...)`` on every rank;
    reduction: "sum" (default), "mean" (over non-ignored targets) or "none" (``[N]``, 0 where
    ignored). Numerically stable (global max subtracted) and computed in fp32; the gradient is
    returned in the dtype of ``logits_local``.
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    if logits_local.dim() != 2 or target.shape != logits_local.shape[:1]:
        raise ValueError(f"expected logits_local [N, V/tp] and target [N], got {tuple(logits_local.shape)} "
                         f"and {tuple(target.shape)}")
    return _VocabParallelCrossEntropy.apply(logits_local, target, group, ignore_index, reduction)
