"""MoonEP dispatch: every EP rank computes exactly S*K rows, into one fixed receive buffer.

Per LatentMoE call on EP rank ``me`` of R (E_loc = E/R home experts, M replica slots, J = E_loc + M):

1. **Counts.** ``permute`` sorts this rank's S*K (token, slot) rows by expert; one fixed-shape
   all_gather of the [E] counts gives every rank the same [R, E] matrix.
2. **Plan.** ``moonep.planner.plan_moonep`` (identical on every rank): replica slots, the split of
   every (source, expert) block over the expert's copies (home first, then replicas by (rank,
   slot)) and the receive offsets (slot-major, then source) in each rank's [S*K, L] buffer.
3. **Replica weights.** One all_to_all_single per layer and step moves the w1/w3/w2 of every
   replicated expert from its home rank to the ranks hosting a copy, in the compute dtype (bf16
   under autocast), straight into rows [E_loc, E_loc + n) of a persistent [J, P] buffer (shared by the layers)
   whose rows [0, E_loc) receive the home weights (:class:`_StackWeights`, :class:`ReplicaBuffers`:
   no per-layer cat or clone). It is issued with ``async_op=True`` and waited for just before the
   expert GEMMs; the layer's shared experts (``overlap=``) and the token dispatch run meanwhile
   (tools/bench_overlap.py measures the hidden fraction on gloo). Its backward sends the replicas'
   weight gradients back and ADDS them into the home experts' gradients, so the optimizer only
   ever sees home copies (that all_to_all is blocking).
4. **Dispatch.** Senders order rows by destination (rank, slot); each receiver lands its rows
   (exactly S*K, or at most S*K*(1 + tolerance) when the plan kept everything home) in the
   persistent pool buffer (moonep/buffers.py, one per (shape, dtype, device) for the whole run) and
   then copies them to the planned offsets (one index_copy into a fresh tensor), which makes the
   batch expert-grouped over the J slots. On gloo and NCCL this is ``all_to_all_single`` with split
   sizes read once per layer from the plan (the layer's one host read); a device-initiated
   symmetric-memory all_to_all (``torch.ops.symm_mem.all_to_all_vdev``), which would remove that
   read and the landing copy, is not implemented (it needs several GPUs to test).
5. **Experts.** One fixed-size [S*K, L] batch through the J slots' SiTU-GLU experts (home weights
   then replica weights), with the layer's QAT hooks applied to home and replica weights alike.
6. **Combine.** The mirror image back to each source, then ``unpermute`` applies the router
   weights after the down-projection in fp32, exactly as one process does.

If the plan is infeasible (replica bound too tight for this batch, or ranks with unequal S), the
same code runs with dynamic-size landing tensors instead of the pool buffer (``fallbacks`` counts
such calls), so results stay exact.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megak3.model.moe import permute, unpermute

from .buffers import DEFAULT_POOL, BufferPool
from .dispatch import _Exchange, _Return, block_transpose_index, exclusive_cumsum
from .planner import capacity_rows, plan_moonep

__all__ = ["MoonEPDispatcher", "expert_forward"]

# torch 2.13 renamed all_gather_into_tensor (deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def expert_forward(experts, w1_JmL, w3_JmL, w2_JLm, z_XL, rows_per_slot_J) -> torch.Tensor:
    """GroupedExperts math on explicit stacked weights (home + replica slots), same QAT hooks."""
    return experts.compute(w1_JmL, w3_JmL, w2_JLm, z_XL, rows_per_slot_J)


class _PendingFetch:
    """The in-flight replica-weight all_to_all of one layer call: ``wait()`` before the expert GEMMs."""

    def __init__(self):
        self.work = None
        self.send = None          # kept alive until the collective has read it
        self.issued_at = self.waited_at = self.done_at = 0.0

    def wait(self) -> None:
        if self.work is not None:
            self.waited_at = time.perf_counter()
            self.work.wait()
            self.done_at = time.perf_counter()
            self.work = self.send = None


class _StackWeights(torch.autograd.Function):
    """Home experts + fetched replicas -> views of ONE persistent [J, P] buffer in the compute dtype.

    forward: rows [0, El) of ``buf`` get this rank's home w1|w3|w2 (flattened, cast to buf's dtype:
    under autocast this is the cast autocast would make anyway); replica weights of the experts this
    rank hosts are sent from their home ranks in the compute dtype and land directly in rows
    [El, El + n_recv) (the plan puts a rank's replicas in expert-id order = source-rank order = the
    all_to_all's landing order, so no reordering copy). The all_to_all is issued with
    ``async_op=True``; ``pending.wait()`` must run before anything reads the replica rows.
    Returns w1 [J, m, L], w3 [J, m, L], w2 [J, L, m] as views of ``buf`` (rows past El + n_recv are
    stale and only ever used by groups of zero rows).
    backward: the home rows' gradient goes to the home weights; the replicas' gradients travel back
    to their home ranks and are ADDED there, so the optimizer only ever sees home copies.
    """

    @staticmethod
    def forward(ctx, w1, w3, w2, buf, send_local_idx, w_send, w_recv, group, pending):
        El, J = w1.shape[0], buf.shape[0]
        shapes = (w1.shape[1:], w3.shape[1:], w2.shape[1:])
        sizes = [sh.numel() for sh in shapes]
        dt = buf.dtype
        with torch.no_grad():
            col = 0
            for w, n in zip((w1, w3, w2), sizes):
                buf[:El, col:col + n].copy_(w.reshape(El, n))
                col += n
            n_send, n_recv = send_local_idx.numel(), sum(w_recv)
            send = torch.cat([w.index_select(0, send_local_idx).reshape(n_send, n).to(dt)
                              for w, n in zip((w1, w3, w2), sizes)], 1)
            pending.send = send
            pending.issued_at = time.perf_counter()
            pending.work = dist.all_to_all_single(buf[El:El + n_recv], send, w_recv, w_send, group=group,
                                                  async_op=True)
        ctx.save_for_backward(send_local_idx)
        ctx.meta = (w_send, w_recv, group, El, shapes, sizes, n_recv, (w1.dtype, w3.dtype, w2.dtype))
        views, col = [], 0
        for sh, n in zip(shapes, sizes):
            views.append(buf[:, col:col + n].view(J, *sh))
            col += n
        return tuple(views)

    @staticmethod
    def backward(ctx, g1, g3, g2):
        (send_local_idx,) = ctx.saved_tensors
        w_send, w_recv, group, El, shapes, sizes, n_recv, dtypes = ctx.meta
        ref = next(t for t in (g1, g3, g2) if t is not None)
        J = ref.shape[0]
        g = torch.cat([t.reshape(J, n) if t is not None else ref.new_zeros((J, n))
                       for t, n in zip((g1, g3, g2), sizes)], 1)
        g_home = g.new_empty((send_local_idx.numel(), g.shape[1]))
        dist.all_to_all_single(g_home, g[El:El + n_recv].contiguous(), w_send, w_recv, group=group)
        acc = g[:El].to(dtypes[0], copy=True)       # accumulate in the masters' dtype
        acc.index_add_(0, send_local_idx, g_home.to(acc.dtype))  # replicated on several ranks: sums
        outs, col = [], 0
        for sh, n, dt in zip(shapes, sizes, dtypes):
            outs.append(acc[:, col:col + n].reshape(El, *sh).to(dt))
            col += n
        return (*outs, None, None, None, None, None, None)


class ReplicaBuffers:
    """Persistent [J, P] weight buffers in the compute dtype, shared by the MoE layers of a model
    (parallel/expert_parallel.py hands one to every layer's dispatcher).

    A buffer is free when nothing but this object references its storage: the views handed to the
    expert GEMMs (saved by autograd until the layer's backward) keep it busy. Without activation
    checkpointing every layer's forward therefore keeps its own buffer until its backward (one per
    MoE layer and forward in flight); with full recomputation the forward saves nothing, so the
    next layer reuses the same buffer, and in backward each layer's recompute refetches its
    replicas into whichever buffer is free (one buffer per rank). ``allocations`` counts real
    allocations.
    """

    def __init__(self):
        self._bufs: list = []
        self.allocations = 0

    @staticmethod
    def _refs(buf) -> int:
        return torch._C._storage_Use_Count(buf.untyped_storage()._cdata)

    def get(self, shape, dtype, device) -> torch.Tensor:
        for buf, base in self._bufs:
            if buf.shape == shape and buf.dtype == dtype and buf.device == device and self._refs(buf) <= base:
                return buf
        buf = torch.zeros(shape, dtype=dtype, device=device)   # zeros: unused slots never hold NaN
        self._bufs.append((buf, self._refs(buf)))
        self.allocations += 1
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b, _ in self._bufs)


class MoonEPDispatcher:
    """Expert-parallel dispatch with per-batch replicas and exact balance (see module docstring).

    ep_group: the EP process group (every member must route the same number of tokens S).
    num_experts: global E; top_k: K; max_replicas_per_rank: M replica slots per rank.
    planner_backend: 'auto' | 'torch' | 'cpp' (moonep.planner.plan_moonep).
    pool: the fixed-buffer pool (default: the process-wide one), shared by all layers.
    recorder: optional callable ``recorder(dispatcher, counts_RE, plan)`` for load statistics.
    tolerance: plan no replicas when max/mean rank load <= 1 + tolerance (moonep.tolerance).
    replica_buffers: the :class:`ReplicaBuffers` to draw replica weight buffers from (shared across
    layers by parallelize_ep); default: a new one for this layer.
    """

    overlaps = True
    """the layer may pass ``overlap=`` (its shared experts) to run while the replica fetch is in flight"""

    def __init__(self, ep_group, num_experts: int, top_k: int, max_replicas_per_rank: Optional[int] = None,
                 planner_backend: str = "auto", pool: Optional[BufferPool] = None, recorder=None,
                 layer_idx: int = 0, tolerance: float = 0.0, replica_buffers: Optional["ReplicaBuffers"] = None):
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
        if not float(tolerance) >= 0.0:
            raise ValueError(f"moonep.tolerance={tolerance!r} must be >= 0")
        self.max_replicas = M
        self.tolerance = float(tolerance)
        self.planner_backend = planner_backend
        self.pool = pool if pool is not None else DEFAULT_POOL
        self.replica_buffers = replica_buffers if replica_buffers is not None else ReplicaBuffers()
        """the persistent [E_loc + M, P] weight buffers (compute dtype) this layer draws from: shared
        with the model's other MoE layers when given (parallelize_ep), else this layer's own"""
        self.overlap_shared = True
        """run the layer's ``overlap`` work (shared experts) while the replica fetch is in flight;
        False issues the same work after waiting (the baseline of tools/bench_overlap.py)"""
        self.recorder = recorder
        self.layer_idx = layer_idx
        self.row_bytes = 0
        """bytes of one dispatched (latent) row, set per call (load statistics)"""
        self.expert_weight_bytes = 0
        """bytes of one expert's w1 + w3 + w2 as sent (compute dtype; a replica's traffic), set per call"""
        self.fallbacks = 0
        """calls whose plan was infeasible and ran with dynamic-size landing tensors"""
        self.last: dict = {}
        """facts of the last call: rows_computed, num_replicas, feasible, fetch timing (tests, statistics)"""

    def __call__(self, z_TL: torch.Tensor, route, experts, overlap=None):
        """``u_TL``, or ``(u_TL, overlap())`` when ``overlap`` (a callable) is given."""
        R, E, El, M = self.ep, self.num_experts, self.local_experts, self.max_replicas
        J, me, dev = El + M, self.rank, z_TL.device
        if experts.num_experts != El:
            raise ValueError(f"MoonEPDispatcher: the layer holds {experts.num_experts} experts, expected "
                             f"model.moe.num_experts / parallel.ep = {E} / {R} = {El}")
        order_X, token_of_row_X, tokens_per_expert_E = permute(route.indices_TK, E)
        X = order_X.numel()                                   # S*K, from shapes
        cap = capacity_rows(X, self.tolerance)
        w_dtype = (torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type)
                   else experts.w1.dtype)                     # replicas travel in the compute dtype
        self.row_bytes = z_TL.shape[-1] * z_TL.element_size()
        self.expert_weight_bytes = sum(w[0].numel() for w in (experts.w1, experts.w3, experts.w2)) * \
            torch.empty((), dtype=w_dtype).element_size()
        extra = None
        if R == 1:
            self.last = {"rows_computed": X, "num_replicas": 0, "feasible": True}
            u = unpermute(experts(z_TL[token_of_row_X], tokens_per_expert_E), order_X, route.weights_TK)
            return u if overlap is None else (u, overlap())

        # 1. counts of every source rank (fixed shape)
        counts_RE = torch.empty(R * E, dtype=torch.int64, device=dev)
        _all_gather_single(counts_RE, tokens_per_expert_E.contiguous(), group=self.group)
        counts_RE = counts_RE.view(R, E)
        # 2. plan (same on every rank)
        plan = plan_moonep(counts_RE, X, M, backend=self.planner_backend, tolerance=self.tolerance)
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
                          counts_RE.sum(1)]).tolist()        # the one host read of the layer (split sizes)
        send_splits, recv_splits = host[:R], host[R:2 * R]
        w_send, w_recv = host[2 * R:3 * R], host[3 * R:4 * R]
        feasible, num_replicas, rows_of_source = bool(host[4 * R]), host[4 * R + 1], host[4 * R + 2:]
        if any(n != X for n in rows_of_source):
            raise ValueError(f"MoonEP needs the same number of routed rows on every EP rank, got "
                             f"{rows_of_source}; give every rank the same micro-batch shape "
                             "(or set moonep.enabled=false)")
        n_recv = sum(recv_splits)
        fixed = feasible and n_recv <= cap
        if not fixed:
            self.fallbacks += 1

        # 3. replica weights from their home ranks, in the compute dtype, straight into this layer's
        #    persistent buffer; issued asynchronously and waited for just before the expert GEMMs
        pending = _PendingFetch()
        if num_replicas > 0:
            big = R * M
            key_RM = torch.where(home_RM == me, torch.arange(R * M, device=dev).view(R, M),
                                 torch.full_like(rep_RM, big))
            send_flat = torch.argsort(key_RM.reshape(-1))[:sum(w_send)]
            send_local_idx = rep_RM.reshape(-1)[send_flat] - me * El
            P = sum(w[0].numel() for w in (experts.w1, experts.w3, experts.w2))
            buf = self.replica_buffers.get((J, P), w_dtype, dev)
            w1, w3, w2 = _StackWeights.apply(experts.w1, experts.w3, experts.w2, buf, send_local_idx,
                                             w_send, w_recv, self.group, pending)
        else:
            w1, w3, w2 = experts.w1, experts.w3, experts.w2
        if overlap is not None and self.overlap_shared:
            extra = overlap()                                 # shared experts while the fetch flies

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
        pool_buf = self.pool.get((cap, z_TL.shape[1]), z_TL.dtype, dev) if fixed else None
        landing = pool_buf[:n_recv] if fixed else None        # receive zone of the dispatch ...
        back = pool_buf[:X] if fixed else None                # ... and of the combine (X rows back)
        z_send = z_TL[token_of_row_X[send_perm]]
        z_recv = _Exchange.apply(z_send, send_splits, recv_splits, land_to_dest, self.group, landing)

        # 5. one expert-grouped batch over the J slots
        pending.wait()
        rows_J = recv_SJ.sum(0)
        if num_replicas == 0:
            y_recv = expert_forward(experts, w1, w3, w2, z_recv, rows_J[:El])
        else:
            y_recv = expert_forward(experts, w1, w3, w2, z_recv, rows_J)
        if overlap is not None and not self.overlap_shared:
            extra = overlap()

        # 6. combine: back to the source, in expert-sorted order
        y_sorted = _Return.apply(y_recv, send_splits, recv_splits, land_to_dest, send_perm, self.group, back)
        self.last = {"rows_computed": n_recv, "num_replicas": num_replicas, "feasible": feasible,
                     "fetch_wait_s": pending.done_at - pending.waited_at,
                     "fetch_issue_to_wait_s": pending.waited_at - pending.issued_at}
        if self.recorder is not None:
            self.recorder(self, counts_RE, plan)
        u = unpermute(y_sorted, order_X, route.weights_TK)
        return u if overlap is None else (u, extra)
