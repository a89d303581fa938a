"""Expert-parallel token dispatch: the baseline dispatcher and the exchange primitives MoonEP shares.

A dispatcher replaces ``permute -> experts -> unpermute`` inside ``LatentMoE.forward`` (its
``expert_dispatch`` hook, installed by parallel/expert_parallel.py)::

    u_TL = dispatcher(z_TL, route, experts)      # experts: this rank's GroupedExperts (E/ep of them)

Baseline data flow on EP rank ``me`` of R (expert e is homed on rank e // E_loc, E_loc = E/R):

    permute by global expert      rows sorted by expert = grouped by destination rank
    counts exchange               all_to_all_single of [R, E_loc] counts (fixed shape)
    dispatch                      all_to_all_single of the latent rows (L = d/2 wide), split sizes
                                  from the counts (dynamic shapes: one host sync per layer)
    regroup                       received blocks (source s, local expert e) -> expert-major order
    experts                       GroupedExperts on one expert-grouped batch
    combine                       the mirror image, back to the source rank's sorted order
    unpermute                     router weights applied after each expert's down-projection, on
                                  the source rank, fixed-order fp32 sum over K (as one process)

Autograd: the backward of an exchange is the reverse exchange (:class:`_Exchange`, :class:`_Return`).
Both are written once for both dispatchers: a "block transpose" index maps the landing order of an
all_to_all_single (source-major) to the order the experts want (slot-major), so the receiving
rank reorders with one index_copy instead of a Python loop over blocks.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from megak3.model.moe import permute, unpermute

__all__ = ["BaselineDispatcher", "block_transpose_index", "exclusive_cumsum"]


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """[a, b, c] -> [0, a, a+b] (int64)."""
    c = x.cumsum(0)
    return c - x


def block_transpose_index(sizes_B: torch.Tensor, dest_start_B: torch.Tensor, total: int) -> torch.Tensor:
    """For rows laid out as consecutive blocks of ``sizes_B``: the destination row of every row.

    Block b occupies rows ``[sum(sizes[:b]), ...)`` in the source layout and starts at
    ``dest_start_B[b]`` in the destination layout; ``total`` = sizes.sum() (known from shapes, so
    no host sync). Returns int64 [total].
    """
    block_X = torch.repeat_interleave(torch.arange(sizes_B.numel(), device=sizes_B.device), sizes_B,
                                      output_size=total)
    src_start_B = exclusive_cumsum(sizes_B)
    pos_X = torch.arange(total, device=sizes_B.device)
    return dest_start_B[block_X] + (pos_X - src_start_B[block_X])


def _a2a(out: torch.Tensor, inp: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> None:
    dist.all_to_all_single(out, inp.contiguous(), out_splits, in_splits, group=group)


class _Exchange(torch.autograd.Function):
    """Send rows (already in destination-rank order), land them, reorder to the receiver's layout.

    forward(x_send [sum(send), W]) -> y [sum(recv), W] with y[land_to_dest[i]] = landing row i.
    ``landing`` (optional) is a persistent buffer of shape [sum(recv), W] used as the landing zone
    (forward) and as the send staging of the backward; the output and gradients are fresh tensors.
    """

    @staticmethod
    def forward(ctx, x_send, send_splits, recv_splits, land_to_dest, group, landing):
        n_recv = sum(recv_splits)
        recv = landing if landing is not None else x_send.new_empty((n_recv, x_send.shape[1]))
        _a2a(recv, x_send, recv_splits, send_splits, group)
        y = x_send.new_empty((n_recv, x_send.shape[1]))
        y.index_copy_(0, land_to_dest, recv)
        ctx.save_for_backward(land_to_dest)
        ctx.meta = (send_splits, recv_splits, group, landing, x_send.shape[0])
        return y

    @staticmethod
    def backward(ctx, g_y):
        (land_to_dest,) = ctx.saved_tensors
        send_splits, recv_splits, group, landing, n_send = ctx.meta
        g_y = g_y.contiguous()
        if landing is not None:
            g_land = torch.index_select(g_y, 0, land_to_dest, out=landing)
        else:
            g_land = g_y.index_select(0, land_to_dest)
        g_x = g_y.new_empty((n_send, g_y.shape[1]))
        _a2a(g_x, g_land, send_splits, recv_splits, group)
        return g_x, None, None, None, None, None


class _Return(torch.autograd.Function):
    """Mirror of :class:`_Exchange`: rows in the receiver's layout go back to their source rank.

    forward(y [n_dest, W]) -> out [n_src, W]: row i of the source's send order (before the
    exchange) is put at ``send_to_src[i]``; ``land_to_dest`` is the index of the forward exchange.
    """

    @staticmethod
    def forward(ctx, y, send_splits, recv_splits, land_to_dest, send_to_src, group, landing):
        y_land = y.contiguous().index_select(0, land_to_dest)
        n_src = sum(send_splits)
        back = landing if landing is not None else y.new_empty((n_src, y.shape[1]))
        _a2a(back, y_land, send_splits, recv_splits, group)
        out = y.new_empty((n_src, y.shape[1]))
        out.index_copy_(0, send_to_src, back)
        ctx.save_for_backward(land_to_dest, send_to_src)
        ctx.meta = (send_splits, recv_splits, group, landing, y.shape[0])
        return out

    @staticmethod
    def backward(ctx, g_out):
        land_to_dest, send_to_src = ctx.saved_tensors
        send_splits, recv_splits, group, landing, n_dest = ctx.meta
        g_out = g_out.contiguous()
        if landing is not None:
            g_send = torch.index_select(g_out, 0, send_to_src, out=landing)
        else:
            g_send = g_out.index_select(0, send_to_src)
        g_land = g_out.new_empty((n_dest, g_out.shape[1]))
        _a2a(g_land, g_send, recv_splits, send_splits, group)
        g_y = g_out.new_empty((n_dest, g_out.shape[1]))
        g_y.index_copy_(0, land_to_dest, g_land)
        return g_y, None, None, None, None, None, None


class BaselineDispatcher:
    """Home-expert-only dispatch with dynamic split sizes (the reference for MoonEP).

    ep_group: the expert-parallel group (None or size 1: everything local, no collective).
    num_experts: the global expert count E; this rank holds experts [rank*E/R, (rank+1)*E/R).
    """

    def __init__(self, ep_group, num_experts: int, recorder=None, layer_idx: int = 0):
        self.group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide model.moe.num_experts={num_experts}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.ep
        self.recorder = recorder
        self.layer_idx = layer_idx
        self.row_bytes = 0
        """bytes of one dispatched (latent) row, set per call (load statistics)"""
        self.expert_weight_bytes = 0
        self.last: dict = {}
        """facts of the last call: rows_computed by the local experts (tests, statistics)"""

    def __call__(self, z_TL: torch.Tensor, route, experts) -> torch.Tensor:
        R, E, El = self.ep, self.num_experts, self.local_experts
        if experts.num_experts != El:
            raise ValueError(f"BaselineDispatcher: the layer holds {experts.num_experts} experts, expected "
                             f"model.moe.num_experts / parallel.ep = {E} / {R} = {El}")
        order_X, token_of_row_X, tokens_per_expert_E = permute(route.indices_TK, E)
        X = order_X.numel()
        self.row_bytes = z_TL.shape[-1] * z_TL.element_size()
        if R == 1:
            y_sorted = experts(z_TL[token_of_row_X], tokens_per_expert_E)
            self.last = {"rows_computed": X}
            return unpermute(y_sorted, order_X, route.weights_TK)
        send_RE = tokens_per_expert_E.view(R, El)
        recv_SE = torch.empty_like(send_RE)          # [source rank, local expert]
        dist.all_to_all_single(recv_SE, send_RE.contiguous(), group=self.group)
        host = torch.cat([send_RE.sum(1), recv_SE.sum(1)]).tolist()  # the one host sync
        send_splits, recv_splits = host[:R], host[R:]
        n_recv = sum(recv_splits)
        # landing order: (source s, local expert e) blocks; experts want (e, s)
        dest_start_SE = exclusive_cumsum(recv_SE.t().reshape(-1)).view(El, R).t()
        land_to_dest = block_transpose_index(recv_SE.reshape(-1), dest_start_SE.reshape(-1), n_recv)
        # rows sorted by expert are already grouped by destination rank: send in sorted order
        z_recv = _Exchange.apply(z_TL[token_of_row_X], send_splits, recv_splits, land_to_dest,
                                 self.group, None)
        y_recv = experts(z_recv, recv_SE.sum(0))
        identity = torch.arange(X, device=z_TL.device)
        y_sorted = _Return.apply(y_recv, send_splits, recv_splits, land_to_dest, identity, self.group, None)
        self.last = {"rows_computed": n_recv}
        if self.recorder is not None:
            self.recorder(self, tokens_per_expert_E, None)
        return unpermute(y_sorted, order_X, route.weights_TK)
