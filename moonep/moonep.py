"""MoonEP dispatch: every EP rank computes exactly S*K rows, into one fixed receive buffer.

Per LatentMoE call on EP rank ``me`` of R (E_loc = E/R home experts, M replica slots, J = E_loc + M):

1. **Counts.** ``permute`` sorts this rank's S*K (token, slot) rows by expert; one fixed-shape
   all_gather of the [E] counts gives every rank the same [R, E] matrix.
2. **Plan.** ``moonep.planner.plan_moonep`` (identical on every rank): replica slots, the split of
   every (source, expert) block over the expert's copies (home first, then replicas by (rank,
   slot)) and the receive offsets (slot-major, then source) in each rank's [S*K, L] buffer.
3. **Replica weights.** One all_to_all_single per layer and step moves the w1/w3/w2 of every
   replicated expert from its home rank to the ranks hosting a copy (:class:`_FetchReplicas`).
   Its backward sends the replicas' weight gradients back and ADDS them into the home experts'
   gradients, so the optimizer only ever sees home copies. It is issued before the token exchange
   and waited for only before the expert GEMMs, so on NCCL it runs concurrently with the token
   dispatch (and would overlap shared-expert compute if the layer ran those first); on CPU/gloo
   the collectives are effectively sequential.
4. **Dispatch.** Senders order rows by destination (rank, slot); each receiver lands exactly S*K
   rows in the persistent pool buffer (moonep/buffers.py, one per (shape, dtype, device) for the
   whole run) and places them at the planned offsets, which makes the batch expert-grouped over
   the J slots. On gloo (and on NCCL) this is ``all_to_all_single`` with split sizes read once per
   layer from the plan (one small host sync); a device-initiated symmetric-memory all_to_all
   (``torch.ops.symm_mem.all_to_all_vdev``) would remove that sync but is not implemented here
   (it needs several GPUs to test, see the report in docs/PARALLEL.md).
5. **Experts.** One fixed-size [S*K, L] batch through the J slots' SiTU-GLU experts (home weights
   then replica weights), with the layer's QAT hooks applied to home and replica weights alike.
6. **Combine.** The mirror image back to each source, then ``unpermute`` applies the router
   weights after the down-projection in fp32, exactly as one process does.

If the plan is infeasible (replica bound too tight for this batch, or ranks with unequal S), the
same code runs with dynamic-size landing tensors instead of the pool buffer (``fallbacks`` counts
such calls), so results stay exact.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megak3.model.moe import permute, unpermute

from .buffers import DEFAULT_POOL, BufferPool
from .dispatch import _Exchange, _Return, block_transpose_index, exclusive_cumsum
from .planner import plan_moonep

__all__ = ["MoonEPDispatcher", "expert_forward"]

# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def expert_forward(experts, w1_JmL, w3_JmL, w2_JLm, z_XL, rows_per_slot_J) -> torch.Tensor:
    """GroupedExperts math on explicit stacked weights (home + replica slots), same QAT hooks."""
    return experts.compute(w1_JmL, w3_JmL, w2_JLm, z_XL, rows_per_slot_J)


class _FetchReplicas(torch.autograd.Function):
    """Home expert weights -> this rank's M replica slots (zeros where unused); backward adds the
    replica gradients into the home experts' gradients on their home ranks."""

    @staticmethod
    def forward(ctx, w1, w3, w2, send_local_idx, send_splits, recv_splits, recv_slot_idx, M, group, landing):
        El = w1.shape[0]
        shapes = (w1.shape[1:], w3.shape[1:], w2.shape[1:])
        n_send = send_local_idx.numel()
        send = torch.cat([w.index_select(0, send_local_idx).reshape(n_send, w[0].numel()) for w in (w1, w3, w2)], 1)
        P = send.shape[1]
        n_recv = sum(recv_splits)
        recv = landing[:n_recv]
        dist.all_to_all_single(recv, send.contiguous(), recv_splits, send_splits, group=group)
        out = w1.new_zeros((M, P))
        out.index_copy_(0, recv_slot_idx, recv)
        ctx.save_for_backward(send_local_idx, recv_slot_idx)
        ctx.meta = (send_splits, recv_splits, group, El, shapes)
        sizes = [s.numel() for s in shapes]
        a, b, c = out.split(sizes, 1)
        return tuple(t.reshape(M, *sh).clone() for t, sh in zip((a, b, c), shapes))

    @staticmethod
    def backward(ctx, g1, g3, g2):
        send_local_idx, recv_slot_idx = ctx.saved_tensors
        send_splits, recv_splits, group, El, shapes = ctx.meta
        ref = next(t for t in (g1, g3, g2) if t is not None)
        M = ref.shape[0]
        g = torch.cat([t.reshape(M, s.numel()) if t is not None else ref.new_zeros((M, s.numel()))
                       for t, s in zip((g1, g3, g2), shapes)], 1)
        g_send = g.index_select(0, recv_slot_idx)
        g_home = g.new_empty((send_local_idx.numel(), g.shape[1]))
        dist.all_to_all_single(g_home, g_send.contiguous(), send_splits, recv_splits, group=group)
        acc = g.new_zeros((El, g.shape[1]))
        acc.index_add_(0, send_local_idx, g_home)   # a home expert replicated to several ranks sums
        sizes = [s.numel() for s in shapes]
        a, b, c = acc.split(sizes, 1)
        return (a.reshape(El, *shapes[0]), b.reshape(El, *shapes[1]), c.reshape(El, *shapes[2]),
                None, None, None, None, None, None, None)


class MoonEPDispatcher:
    """Expert-parallel dispatch with per-batch replicas and exact balance (see module docstring).

    ep_group: the EP process group (every member must route the same number of tokens S).
    num_experts: global E; top_k: K; max_replicas_per_rank: M replica slots per rank.
    planner_backend: 'auto' | 'torch' | 'cpp' (moonep.planner.plan_moonep).
    pool: the fixed-buffer pool (default: the process-wide one), shared by all layers.
    recorder: optional callable ``recorder(dispatcher, counts_RE, plan)`` for load statistics.
    """

    def __init__(self, ep_group, num_experts: int, top_k: int, max_replicas_per_rank: Optional[int] = None,
                 planner_backend: str = "auto", pool: Optional[BufferPool] = None, recorder=None,
                 layer_idx: int = 0):
        self.group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide model.moe.num_experts={num_experts}")
        self.num_experts, self.top_k = num_experts, top_k
        self.local_experts = num_experts // self.ep
        M = self.local_experts if max_replicas_per_rank in (None, 0) else int(max_replicas_per_rank)
        if M < 0 or M > num_experts - self.local_experts:
            raise ValueError(f"moonep.max_replicas_per_rank={M} must lie in [0, "
                             f"{num_experts - self.local_experts}] (0 = num_experts / ep)")
        self.max_replicas = M
        self.planner_backend = planner_backend
        self.pool = pool if pool is not None else DEFAULT_POOL
        self.recorder = recorder
        self.layer_idx = layer_idx
        self.row_bytes = 0
        """bytes of one dispatched (latent) row, set per call (load statistics)"""
        self.expert_weight_bytes = 0
        """bytes of one expert's w1 + w3 + w2 (a replica's weight traffic), set per call"""
        self.fallbacks = 0
        """calls whose plan was infeasible and ran with dynamic-size landing tensors"""
        self.last: dict = {}
        """facts of the last call: rows_computed, num_replicas, feasible (tests, statistics)"""

    def __call__(self, z_TL: torch.Tensor, route, experts) -> torch.Tensor:
        R, E, El, M = self.ep, self.num_experts, self.local_experts, self.max_replicas
        J, me, dev = El + M, self.rank, z_TL.device
        if experts.num_experts != El:
            raise ValueError(f"MoonEPDispatcher: the layer holds {experts.num_experts} experts, expected "
                             f"model.moe.num_experts / parallel.ep = {E} / {R} = {El}")
        order_X, token_of_row_X, tokens_per_expert_E = permute(route.indices_TK, E)
        X = order_X.numel()                                   # S*K, from shapes
        self.row_bytes = z_TL.shape[-1] * z_TL.element_size()
        self.expert_weight_bytes = sum(w[0].numel() * w.element_size() for w in (experts.w1, experts.w3, experts.w2))
        if R == 1:
            self.last = {"rows_computed": X, "num_replicas": 0, "feasible": True}
            return unpermute(experts(z_TL[token_of_row_X], tokens_per_expert_E), order_X, route.weights_TK)

        # 1. counts of every source rank (fixed shape)
        counts_RE = torch.empty(R * E, dtype=torch.int64, device=dev)
        _all_gather_single(counts_RE, tokens_per_expert_E.contiguous(), group=self.group)
        counts_RE = counts_RE.view(R, E)
        # 2. plan (same on every rank)
        plan = plan_moonep(counts_RE, X, M, backend=self.planner_backend)
        slot_RJ, rows_SRJ = plan.slot_expert_RJ, plan.rows_SRJ
        rep_RM = slot_RJ[:, El:]
        home_RM = torch.where(rep_RM >= 0, rep_RM // El, torch.full_like(rep_RM, -1))
        ranks_R = torch.arange(R, device=dev)
        rows_mine_RJ = rows_SRJ[me]                           # what I send to (rank, slot)
        recv_SJ = rows_SRJ[:, me, :]                          # what I receive from (source, slot)
        w_send_R = (home_RM == me).sum(1)                     # replica weights I send to each rank
        w_recv_R = (home_RM[me][None, :] == ranks_R[:, None]).sum(1)
        host = torch.cat([rows_mine_RJ.sum(1), recv_SJ.sum(1), w_send_R, w_recv_R,
                          plan.feasible.view(1).to(torch.int64), plan.num_replicas.view(1),
                          counts_RE.sum(1)]).tolist()        # the one host sync of the layer
        send_splits, recv_splits = host[:R], host[R:2 * R]
        w_send, w_recv = host[2 * R:3 * R], host[3 * R:4 * R]
        feasible, num_replicas, rows_of_source = bool(host[4 * R]), host[4 * R + 1], host[4 * R + 2:]
        if any(n != X for n in rows_of_source):
            raise ValueError(f"MoonEP needs the same number of routed rows on every EP rank, got "
                             f"{rows_of_source}; give every rank the same micro-batch shape "
                             "(or set moonep.enabled=false)")
        n_recv = sum(recv_splits)
        fixed = feasible and n_recv == X
        if not fixed:
            self.fallbacks += 1

        # 3. replica weights from their home ranks (issued first: overlappable on NCCL)
        if num_replicas > 0:
            big = R * M
            key_RM = torch.where(home_RM == me, torch.arange(R * M, device=dev).view(R, M),
                                 torch.full_like(rep_RM, big))
            send_flat = torch.argsort(key_RM.reshape(-1))[:sum(w_send)]
            send_local_idx = rep_RM.reshape(-1)[send_flat] - me * El
            key_M = torch.where(rep_RM[me] >= 0, home_RM[me] * M + torch.arange(M, device=dev),
                                torch.full_like(rep_RM[me], big))
            recv_slot_idx = torch.argsort(key_M)[:sum(w_recv)]
            P = sum(w[0].numel() for w in (experts.w1, experts.w3, experts.w2))
            w_landing = self.pool.get((M, P), experts.w1.dtype, dev)
            r1, r3, r2 = _FetchReplicas.apply(experts.w1, experts.w3, experts.w2, send_local_idx, w_send,
                                              w_recv, recv_slot_idx, M, self.group, w_landing)
            w1 = torch.cat([experts.w1, r1])
            w3 = torch.cat([experts.w3, r3])
            w2 = torch.cat([experts.w2, r2])
        else:
            w1, w3, w2 = experts.w1, experts.w3, experts.w2

        # 4. dispatch: my expert-sorted rows fill each expert's copies in copy order
        F = R * J
        f_F = torch.arange(F, device=dev)
        e_F = slot_RJ.reshape(-1)
        is_home_F = (f_F % J) < El
        key_F = torch.where(e_F >= 0, e_F * (F + 1) + torch.where(is_home_F, 0, 1 + f_F), E * (F + 1) + f_F)
        slot_order = torch.argsort(key_F)                     # slots in (expert, copy) order
        rows_F = rows_mine_RJ.reshape(-1)
        slot_of_row = torch.repeat_interleave(slot_order, rows_F[slot_order], output_size=X)
        send_perm = torch.argsort(slot_of_row, stable=True)   # sorted row -> send position
        land_to_dest = block_transpose_index(recv_SJ.reshape(-1), plan.recv_offset_SRJ[:, me, :].reshape(-1),
                                             n_recv)
        landing = self.pool.get((X, z_TL.shape[1]), z_TL.dtype, dev) if fixed else None
        z_send = z_TL[token_of_row_X[send_perm]]
        z_recv = _Exchange.apply(z_send, send_splits, recv_splits, land_to_dest, self.group, landing)

        # 5. one expert-grouped batch over the J slots
        rows_J = recv_SJ.sum(0)
        if num_replicas == 0:
            y_recv = expert_forward(experts, w1, w3, w2, z_recv, rows_J[:El])
        else:
            y_recv = expert_forward(experts, w1, w3, w2, z_recv, rows_J)

        # 6. combine: back to the source, in expert-sorted order
        y_sorted = _Return.apply(y_recv, send_splits, recv_splits, land_to_dest, send_perm, self.group, landing)
        self.last = {"rows_computed": n_recv, "num_replicas": num_replicas, "feasible": feasible}
        if self.recorder is not None:
            self.recorder(self, counts_RE, plan)
        return unpermute(y_sorted, order_X, route.weights_TK)
