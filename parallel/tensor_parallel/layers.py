"""Tensor-parallel (+ sequence-parallel) linear, embedding and cross-entropy layers.

Shapes: B batch, T tokens, tp group size, r this rank's index in the group. Every layer is built
from the full single-process weights (``from_linear`` / ``from_embedding``, or ``__init__``, which
draws the full tensor with the same RNG calls as ``nn.Linear`` / ``nn.Embedding`` and keeps the
shard), so with the same seed a TP model starts from exactly the single-process weights.

Megatron pattern (an MLP or attention block)::

    x [B,T,D] -> ColumnParallelLinear (copy_to_tp)        -> [B,T,F/tp] -> act ->
              -> RowParallelLinear   (reduce_from_tp)      -> [B,T,D]
    under SP: x [B,T/tp,D] -> gather_from_sp ... reduce_scatter_to_sp -> [B,T/tp,D]

A column-parallel lm_head is ``ColumnParallelLinear(D, V, group)`` (gather_output=False) whose
``[N, V/tp]`` logits feed :func:`vocab_parallel_cross_entropy` directly.

Collectives come from :mod:`.collectives` only.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import collectives as C
from .collectives import Group, group_rank, group_size

_PARTIAL_GRAD = "tp_partial_grad"
"""attribute set on replicated parameters whose gradient must be summed over the TP group"""


# --------------------------------------------------------------------------- sharding helpers
def _shard(t: torch.Tensor, dim: int, group: Group, block: int, what: str) -> torch.Tensor:
    """Contiguous chunk r of ``t`` along ``dim``, never splitting a ``block`` (e.g. one head)."""
    size, n = group_size(group), t.shape[dim]
    if n % block:
        raise ValueError(f"{what}: dim {dim} of size {n} is not a whole number of blocks of {block}")
    if (n // block) % size:
        raise ValueError(f"{what}: tensor-parallel size {size} does not divide the {n // block} blocks "
                         f"(of {block}) along dim {dim}; contiguous shards would split a block")
    return t.detach().chunk(size, dim=dim)[group_rank(group)].clone(memory_format=torch.contiguous_format)


def shard_rows(t: torch.Tensor, group: Group, block: int = 1) -> torch.Tensor:
    """[R, ...] -> [R/tp, ...]: rows ``[r*R/tp, (r+1)*R/tp)``.

    ``block``: rows per indivisible unit. For a head-major ``[H*hd, D]`` weight pass ``block=hd``:
    contiguous slicing is then head-aligned exactly when tp divides H, which is checked.
    """
    return _shard(t, 0, group, block, "shard_rows")


def shard_cols(t: torch.Tensor, group: Group, block: int = 1) -> torch.Tensor:
    """[R, C] -> [R, C/tp]: columns ``[r*C/tp, (r+1)*C/tp)``; ``block`` as in :func:`shard_rows`."""
    return _shard(t, t.dim() - 1, group, block, "shard_cols")


def partial_grad_parameters(module: nn.Module) -> List[nn.Parameter]:
    """Parameters of ``module`` tagged as replicated-with-partial-grad (feed them to
    :func:`.collectives.sync_replicated_grads` after backward)."""
    return [p for p in module.parameters() if getattr(p, _PARTIAL_GRAD, False)]


# --------------------------------------------------------------------------- linear layers
class ColumnParallelLinear(nn.Module):
    """Y = X W^T + b with W's output rows sharded: this rank holds ``weight [out/tp, in]``.

    Input: ``[B, T, in]`` replicated (``[B, T/tp, in]`` token-sharded along ``sequence_dim`` when
    ``sequence_parallel``). Output: ``[B, T, out/tp]`` (this rank's columns of Y), or the full
    ``[B, T, out]`` with ``gather_output=True``. Forward collectives: none (SP: one all-gather);
    backward: one all-reduce of the input grad (SP: one reduce-scatter).
    ``row_block``: output rows per indivisible unit (head_dim for head-major weights).
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 gather_output: bool = False, sequence_parallel: bool = False, row_block: int = 1, *,
                 sequence_dim: int = 1, device=None, dtype=None):
        super().__init__()
        self.group, self.tp = group, group_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.row_block, self.sequence_dim = row_block, sequence_dim
        full = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._load_full(full.weight, full.bias)

    def _load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.weight = nn.Parameter(shard_rows(weight, self.group, self.row_block))  # [out/tp, in]
        self.bias = None if bias is None else nn.Parameter(shard_rows(bias, self.group, self.row_block))

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs) -> "ColumnParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (its weights are copied, not shared)."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device="meta", **kwargs)  # meta: skip a throw-away init of the full weight
        layer._load_full(linear.weight, linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = C.gather_from_sp(x, self.group, dim=self.sequence_dim)
        else:
            x = C.copy_to_tp(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # [B, T, out/tp]
        return C.gather_from_tp(y, self.group, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), tp={self.tp}, "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X W^T + b with W's input columns sharded: this rank holds ``weight [out, in/tp]``.

    Input: ``[B, T, in/tp]`` (``input_is_parallel``) or ``[B, T, in]`` replicated (then this rank
    keeps its columns). Output: ``[B, T, out]`` summed over ranks (one all-reduce), or
    ``[B, T/tp, out]`` token-sharded under ``sequence_parallel`` (one reduce-scatter). The bias is
    whole on every rank and added after the reduction; under SP it sees only this rank's tokens,
    so it is tagged for :func:`partial_grad_parameters`. ``col_block``: input columns per unit.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, col_block: int = 1, *,
                 sequence_dim: int = 1, device=None, dtype=None):
        super().__init__()
        self.group, self.tp = group, group_size(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.col_block, self.sequence_dim = col_block, sequence_dim
        full = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._load_full(full.weight, full.bias)

    def _load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        self.weight = nn.Parameter(shard_cols(weight, self.group, self.col_block))  # [out, in/tp]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        if self.bias is not None and self.sequence_parallel and self.tp > 1:
            setattr(self.bias, _PARTIAL_GRAD, True)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs) -> "RowParallelLinear":
        """This rank's shard of an existing ``nn.Linear`` (its weights are copied, not shared)."""
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device="meta", **kwargs)
        layer._load_full(linear.weight, linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = C.scatter_to_tp(x, self.group, dim=-1)
        y = F.linear(x, self.weight)  # [B, T, out], partial sum over this rank's input columns
        if self.sequence_parallel:
            y = C.reduce_scatter_to_sp(y, self.group, dim=self.sequence_dim)
        else:
            y = C.reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, tp={self.tp}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sp={self.sequence_parallel}")


# --------------------------------------------------------------------------- vocabulary parallel
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
        self.weight = nn.Parameter(shard_rows(weight, self.group))  # [V/tp, D]
        per_rank = self.num_embeddings // self.tp
        self.vocab_start = group_rank(self.group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
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
            return C.reduce_scatter_to_sp(out, self.group, dim=self.sequence_dim)
        return C.reduce_from_tp(out, self.group)

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
        row_max_N = C.all_reduce_max(x_NV.max(dim=-1).values, group)
        shifted_NV = x_NV - row_max_N.unsqueeze(-1)  # <= 0: exp cannot overflow
        exp_NV = shifted_NV.exp()

        valid_N = target != ignore_index
        local_t_N = target - start
        here_N = valid_N & (local_t_N >= 0) & (local_t_N < n_local)
        local_t_N = local_t_N.masked_fill(~here_N, 0)
        target_logit_N = shifted_NV.gather(-1, local_t_N.unsqueeze(-1)).squeeze(-1).masked_fill(~here_N, 0.0)
        sums_2N = C.all_reduce_sum(torch.stack([exp_NV.sum(dim=-1), target_logit_N]), group)
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
