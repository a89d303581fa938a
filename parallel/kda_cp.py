"""KDA over context-parallel (CP) ranks by a scan of per-rank affine state maps, with backward.

Layout. The sequence of every batch row is split into cp contiguous segments: CP rank r holds tokens
[r*T, (r+1)*T) of each row (T = local length). Packed documents are described per rank by local
`cu_seqlens` over the flattened local stream (B*T tokens, row ends included) and by `continues[b]`:
whether row b's first local token continues the document of rank r-1's last token in that row.
`cp_local_docs` derives both (and global positions in document) from the global packing.

Convention (derived from `recurrent_kda`'s update in megak3/ops/kda/recurrent.py). Per head, state S in R^{KxV},
alpha_t = exp(g_t) per key channel. One token does
    S <- Diag(alpha_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T
i.e.  S_t = A_t S_{t-1} + beta_t k_t v_t^T   with   A_t = (I - beta_t k_t k_t^T) Diag(alpha_t)  (K x K),
acting on the key (row) axis of S; the V columns of S evolve independently under the same A_t.
A run of tokens 1..n of one document is therefore affine in its incoming state:
    S_out = M S_in + E,   M = A_n A_{n-1} ... A_1 (latest token leftmost),   E = the run from S_in = 0,
and the output is  o_t = scale S_t^T q_t = o_t|_{S_in=0} + S_in^T u_t,   u_t = scale P_t^T q_t,
P_t = A_t ... A_1. Composition (map 1 then map 2): (M2, E2) o (M1, E1) = (M2 M1, M2 E1 + E2).

How M and u are obtained exactly. Because the columns of S evolve independently, one `kda` call on
v_aug = [v | 0_K] (V + K value columns) with the initial state [0 | I_K] (for the document that
continues from the previous rank; [0 | 0] for every other document) computes, column block by column
block, the zero-state run [v] and the run of the identity with zero values [0_K]: the final state is
[E | M] and the output is [o|_{S_in=0} | u]. This is the recurrence itself (no approximation), so
M is exact up to the rounding of the chunked kernel. A document that starts inside the segment has
the zero initial block, so its M (and its u) is exactly 0: nothing of the incoming state survives.

Algorithm per rank r (group of size cp):
 1. one local `kda` call as above (plain v when no row of this rank carries an incoming state);
 2. summary of row b = [M_b | E_b] of the LAST local document of that row ([B, H, K, K + V], fp32):
    M_b = 0 unless that document is also the first one and continues; on rank 0 the initial state
    (if given) is applied here, E_b <- E_b + M_b S0_b, M_b <- 0;
 3. all-gather of the summaries ([cp, B, H, K, K + V]: cp*B*H*K*(K+V) values, independent of T);
 4. exclusive scan: S_in = S_out of rank r-1 = fold over j < r of S <- M_j S + E_j (starting at rank
    0's E, its M being 0); rows whose first token does not continue ignore it (their u and M are 0);
 5. o = o|_{S_in=0} + S_in^T u on the continuing document's tokens; final state of local document n
    = E_n + M_n S_in.

Backward is autograd through every step: the all-gather is an autograd.Function whose backward is
a reduce-scatter (sum over ranks of d[gathered], rank j keeps slot j), so dS_in flows to rank j < r
as dE_j = dS_j, dM_j = dS_j S_{j-1}^T, dS_{j-1} = M_j^T dS_j (the reverse scan of the adjoint),
then into the local `kda` backward through its final state. Communication per call: one all-gather
forward, one reduce-scatter backward, each of cp*B*H*K*(K+V) values; nothing scales with T.
Every rank's output is tied to the gathered summaries (`_Tie`), so the reduce-scatter runs on every
rank whenever backward runs through o (or the final state), also on ranks that consume no summary.

Short convolutions. `exchange_conv_halo` hands the last kernel-1 tokens of rank r to rank r+1 (one
all_to_all_single whose only non-empty split goes to the next rank; backward sends the halo's
gradient back the same way). `conv_halo_seq_info` builds the SeqInfo under which
`ShortConv(cat([halo, x], 1), seq)[:, kernel-1:]` equals the conv of the whole sequence: tap j of a
local token is masked unless its global position in document is >= j, so a halo token of another
document never contributes.

Byte accounting. `comm_log()` records, per collective issued on this thread by this module (or by
`record_comm`), the bytes handed to it and the bytes this rank sends to other ranks in a
bandwidth-optimal implementation (all-gather: (cp-1) x input; reduce-scatter: (cp-1)/cp x input;
all-to-all: the splits addressed to other ranks).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megak3.model.seqinfo import SeqInfo, make_seq_info
from megak3.ops.h2d import host_to_device
from megak3.ops.kda import kda

__all__ = ["kda_cp", "all_gather_autograd", "segment_affine_map", "exchange_conv_halo", "conv_halo_seq_info", "cp_local_docs",
           "CPDocs", "comm_log", "record_comm", "CommLog"]


# --------------------------------------------------------------------------------- byte accounting
_active = threading.local()


@dataclass
class CommLog:
    """Collectives recorded while active: (kind, bytes handed to the collective, bytes sent off-rank)."""

    events: list = field(default_factory=list)

    def handed(self, kind: Optional[str] = None) -> int:
        return sum(h for kd, h, _ in self.events if kind is None or kd == kind)

    def sent(self, kind: Optional[str] = None) -> int:
        return sum(s for kd, _, s in self.events if kind is None or kd == kind)


class comm_log:
    """Context manager returning a CommLog of the collectives issued on this thread inside it.

        with comm_log() as log:
            o, _ = kda_cp(...); o.sum().backward()
        log.sent()  # bytes this rank sent
    """

    def __enter__(self) -> CommLog:
        self.log = CommLog()
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self.log)
        return self.log

    def __exit__(self, *exc) -> None:
        _active.stack.remove(self.log)


def record_comm(kind: str, handed_bytes: int, sent_bytes: int) -> None:
    """Append one collective to every active CommLog of this thread."""
    for log in getattr(_active, "stack", ()):
        log.events.append((kind, int(handed_bytes), int(sent_bytes)))


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


# ------------------------------------------------------------------------------ autograd collectives
class _AllGather(torch.autograd.Function):
    """fwd: [*S] -> [cp, *S] (slot j = rank j's tensor); bwd: reduce-scatter (sum over ranks, keep own slot)."""

    @staticmethod
    def forward(ctx, x, group, tag=""):
        ctx.group, ctx.tag = group, tag
        cp = dist.get_world_size(group)
        x1 = x.detach().contiguous().unsqueeze(0)
        out = x1.new_empty((cp,) + tuple(x.shape))
        record_comm(tag + "all_gather", _nbytes(x1), (cp - 1) * _nbytes(x1))
        dist.all_gather_single(out, x1, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        cp = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((1,) + tuple(grad.shape[1:]))
        record_comm(ctx.tag + "reduce_scatter", _nbytes(grad), (cp - 1) * _nbytes(out))
        dist.reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out[0], None, None


def all_gather_autograd(x: torch.Tensor, group, tag: str = "") -> torch.Tensor:
    """``[*S] -> [cp, *S]`` (slot j = rank j's x) over ``group``; backward reduce-scatters the gradient
    (each rank gets the sum over ranks of its slot's gradient). Recorded in ``comm_log`` as
    ``tag + "all_gather"`` / ``tag + "reduce_scatter"``. None or a group of size 1: ``x[None]``."""
    if group is None or dist.get_world_size(group) == 1:
        return x.unsqueeze(0)
    return _AllGather.apply(x, group, tag)


class _Tie(torch.autograd.Function):
    """Identity on `outs`; gives `anchor` a zero gradient so anchor's backward always runs."""

    @staticmethod
    def forward(ctx, anchor, *outs):
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        return (torch.zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype, device=grads[0].device), *grads)


def _send_to_next(x_LBP: torch.Tensor, group, direction: int) -> torch.Tensor:
    """Rank r sends x to rank r + direction and returns what rank r - direction sent (zeros where
    there is no such rank). One all_to_all_single along dim 0 with at most one non-empty split."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    n = x_LBP.shape[0]
    dst, src = r + direction, r - direction
    in_splits = [n if j == dst else 0 for j in range(cp)]
    out_splits = [n if j == src else 0 for j in range(cp)]
    out = x_LBP.new_empty((sum(out_splits),) + tuple(x_LBP.shape[1:]))
    send = x_LBP.contiguous() if 0 <= dst < cp else x_LBP.new_empty((0,) + tuple(x_LBP.shape[1:]))
    record_comm("all_to_all", _nbytes(send), _nbytes(send))
    dist.all_to_all_single(out, send, output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out if 0 <= src < cp else x_LBP.new_zeros(x_LBP.shape)


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BTP, n, group):
        ctx.group, ctx.T = group, x_BTP.shape[1]
        tail_LBP = x_BTP.detach()[:, x_BTP.shape[1] - n:].transpose(0, 1)
        return _send_to_next(tail_LBP, group, +1).transpose(0, 1).contiguous()

    @staticmethod
    def backward(ctx, grad_BLP):
        n = grad_BLP.shape[1]
        g_tail = _send_to_next(grad_BLP.transpose(0, 1), ctx.group, -1).transpose(0, 1)
        grad_x = grad_BLP.new_zeros(grad_BLP.shape[0], ctx.T, *grad_BLP.shape[2:])
        grad_x[:, ctx.T - n:] = g_tail
        return grad_x, None, None


def exchange_conv_halo(x_BTP: torch.Tensor, kernel: int, group) -> torch.Tensor:
    """The previous CP rank's last `kernel - 1` tokens of x.

    Args:
        x_BTP: this rank's segment `[B, T, ...]` (T >= kernel - 1).
        kernel: the causal conv's kernel size W.
        group: the CP process group (None or size 1: no exchange).
    Returns:
        halo `[B, kernel - 1, ...]`: rank r-1's x[:, T-W+1:], zeros on rank 0. Differentiable: the
        halo's gradient is sent back to rank r-1 and added to its x's gradient.
    """
    n = kernel - 1
    if x_BTP.shape[1] < n:
        raise ValueError(f"exchange_conv_halo: local length {x_BTP.shape[1]} < kernel - 1 = {n}")
    if group is None or dist.get_world_size(group) == 1 or n == 0:
        return x_BTP.new_zeros(x_BTP.shape[0], n, *x_BTP.shape[2:])
    return _Halo.apply(x_BTP, n, group)


def conv_halo_seq_info(pos_in_doc_BT: Optional[torch.Tensor], kernel: int, device=None) -> SeqInfo:
    """SeqInfo for `ShortConv` applied to `cat([halo, x_local], 1)` (`[B, W-1+T, P]`).

    Args:
        pos_in_doc_BT: global position in document of every local token `[B, T]` (`CPDocs.pos_in_doc_BT`),
            or None for unpacked rows (each row one document spanning all ranks). Pass the host
            copy: the document starts are found by index math on it (a boolean mask, whose result
            size would be a device-to-host read on a device tensor).
        device: where the returned tensors go, in one non-blocking copy (:meth:`SeqInfo.moved`);
            None: they stay where ``pos_in_doc_BT`` is.
    Returns:
        SeqInfo whose `pos_in_doc_BT` is the local positions preceded by W-1 placeholder zeros for the
        halo tokens (their outputs are to be dropped: `conv(...)[:, W-1:]`); `cu_seqlens` lists the
        extended stream's document starts (positions == 0) and row ends (`cu_seqlens_host`: the same
        offsets on the host).
    """
    if pos_in_doc_BT is None:
        return SeqInfo(0, 0, None, None, None)
    B, T = pos_in_doc_BT.shape
    n = kernel - 1
    pos = torch.cat([pos_in_doc_BT.new_zeros(B, n), pos_in_doc_BT], 1)
    flat = pos.reshape(-1)
    idx = torch.arange(flat.numel(), device="cpu")                # host index math (flat is on the host)
    starts = idx[(flat == 0) | (idx % (T + n) == 0)]
    cu = torch.nn.functional.pad(starts, (0, 1), value=flat.numel())   # + the stream's end
    seq = SeqInfo(B, T + n, cu.to(torch.int32), None, pos, cu_seqlens_host=cu)
    return seq if device is None else seq.moved(device)[0]  # one non-blocking copy


# -------------------------------------------------------------------------------- document layout
@dataclass(frozen=True)
class CPDocs:
    """One CP rank's view of the packed documents of its segment."""

    cu_seqlens: Optional[torch.Tensor]
    """int32 [N+1] document offsets into the flattened local B*T stream (row ends included), or None"""
    continues: list
    """[B] bools: row b's first local token continues the document of rank r-1's last token"""
    pos_in_doc_BT: Optional[torch.Tensor]
    """int64 [B, T] global position of every local token inside its document, or None (unpacked)"""


def cp_local_docs(cu_seqlens: Optional[torch.Tensor], batch: int, seqlen: int, cp: int, rank: int) -> CPDocs:
    """Rank `rank`'s CPDocs for a global packing.

    Args:
        cu_seqlens: int `[N+1]` document offsets into the flattened global `batch * seqlen` stream
            (the model's convention; row ends are added), or None (one document per row).
        seqlen: global row length, divisible by cp; rank r holds tokens [r*T, (r+1)*T), T = seqlen/cp.
    """
    if seqlen % cp:
        raise ValueError(f"cp_local_docs: seqlen={seqlen} is not divisible by cp={cp}")
    T = seqlen // cp
    if cu_seqlens is None:
        return CPDocs(None, [rank > 0] * batch, None)
    seq = make_seq_info(batch, seqlen, cu_seqlens)
    pos_BT = seq.pos_in_doc_BT[:, rank * T:(rank + 1) * T].contiguous()
    flat = pos_BT.reshape(-1)
    idx = torch.arange(flat.numel(), device="cpu")
    starts = idx[(flat == 0) | (idx % T == 0)]
    cu = torch.nn.functional.pad(starts, (0, 1), value=flat.numel()).to(torch.int32)  # + the stream's end
    return CPDocs(cu, [bool(p > 0) for p in pos_BT[:, 0].tolist()], pos_BT)


# ------------------------------------------------------------------------------------ local pass
def _row_docs(offsets, B: int, T: int):
    """(first, last) local document index of every row; every row end must be a document end."""
    if offsets is None:
        return list(range(B)), list(range(B))
    first, last = [], []
    for b in range(B):
        s, e = b * T, (b + 1) * T
        f = [n for n in range(len(offsets) - 1) if offsets[n] == s and offsets[n + 1] > s]
        l_ = [n for n in range(len(offsets) - 1) if offsets[n + 1] == e and offsets[n] < e]
        if not f or not l_:
            raise ValueError(f"kda_cp: cu_seqlens {offsets} must contain every row boundary "
                             f"(multiples of the local length T={T})")
        first.append(f[0])
        last.append(l_[0])
    return first, last


def _local_pass(q, k, v, g, beta, cu, cu_cpu, carried_docs, scale, chunk_size, use_fla, lower_bound):
    """One `kda` call over the local segment; `cu`, `cu_cpu`: the local offsets as given to `kda_cp`
    (handed to `kda` as they are, so fla's offset cache sees the same tensors every layer).

    Returns (o0 `[B,T,H,V]` for zero incoming state, u `[B,T,H,K]` or None, E `[N,H,K,V]`,
    P `[N,H,K,K]` or None): u and P are the identity-started columns (zero outside carried_docs).
    """
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    cdt = torch.float64 if any(t.dtype == torch.float64 for t in (q, k, v, g, beta)) else torch.float32
    packed = cu is not None
    N = cu.numel() - 1 if packed else B
    flat = (lambda t: t.reshape(1, B * T, *t.shape[2:])) if packed else (lambda t: t)
    if carried_docs:
        v_in = torch.cat([v.to(cdt), v.new_zeros(B, T, H, K, dtype=cdt)], -1)
        init = q.new_zeros(N, H, K, Vd + K, dtype=cdt)
        eye = torch.eye(K, dtype=cdt, device=q.device)
        for n in carried_docs:
            init[n, :, :, Vd:] = eye
    else:
        v_in, init = v.to(cdt), None
    o, fin = kda(flat(q), flat(k), flat(v_in), flat(g), flat(beta), scale=scale, initial_state=init,
                 output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_size=chunk_size,
                 use_fla=use_fla, lower_bound=lower_bound)
    o = o.reshape(B, T, H, -1)
    if not carried_docs:
        return o, None, fin, None
    return o[..., :Vd], o[..., Vd:], fin[..., :Vd], fin[..., Vd:]


def segment_affine_map(k, v, g, beta, chunk_size: int = 64, use_fla: bool = False,
                       lower_bound: Optional[float] = -5.0):
    """Affine state map of whole unpacked segments: S_out = M S_in + E per row and head.

    Args: k `[B,T,H,K]`, v `[B,T,H,V]`, g `[B,T,H,K]`, beta `[B,T,H]` (q is not needed: zeros are used);
        chunk_size, use_fla, lower_bound: passed to `kda`.
    Returns: (M `[B,H,K,K]`, E `[B,H,K,V]`), from one `kda` call on [v | 0] started at [0 | I].
    """
    B = k.shape[0]
    _, _, E, P = _local_pass(torch.zeros_like(k), k, v, g, beta, None, None, list(range(B)), None,
                             chunk_size, use_fla, lower_bound)
    return P, E


# ------------------------------------------------------------------------------------------ kda_cp
def kda_cp(q, k, v, g, beta, group, *, cu_seqlens: Optional[torch.Tensor] = None,
           continues: Optional[Sequence[bool]] = None, scale: Optional[float] = None,
           initial_state: Optional[torch.Tensor] = None, output_final_state: bool = False,
           chunk_size: int = 64, use_fla: bool = False, lower_bound: Optional[float] = -5.0,
           cu_seqlens_cpu: Optional[torch.Tensor] = None):
    """KDA of this CP rank's segment with the exact incoming state of the ranks before it.

    Args:
        q, k: `[B,T,H,K]`; v: `[B,T,H,V]`; g: `[B,T,H,K]` log-decay; beta: `[B,T,H]` -- this rank's
            segment, tokens [r*T, (r+1)*T) of every row (r = rank in `group`).
        group: CP process group; None or size 1 runs plain `kda`.
        cu_seqlens: int `[N+1]` document offsets into the flattened local B*T stream, containing every
            row end (`CPDocs.cu_seqlens`); None: every row is one document spanning all ranks.
        continues: `[B]` bools, row b's first local token continues rank r-1's last document in that
            row (`CPDocs.continues`); required with cu_seqlens on ranks > 0; without cu_seqlens it
            defaults to True on ranks > 0. Not read on rank 0.
        scale: query scale, default K**-0.5.
        initial_state: `[B,H,K,V]` state entering the first token of every row; only rank 0 may pass it.
        output_final_state: also return the state after every local document.
        chunk_size, use_fla, lower_bound: passed to `kda` (lower_bound: the bound g was built with).
        cu_seqlens_cpu: the same offsets on the host (the layer passes `SeqInfo.cu_seqlens_host`):
            the document layout is read from it instead of from `cu_seqlens`, and both are passed
            to `kda` unchanged (fla's cu_seqlens / cu_seqlens_cpu).
    Returns:
        (o `[B,T,H,V]` in v.dtype, final `[N,H,K,V]` (N = B, or documents in cu_seqlens) in the compute
        dtype, or None). Equal to `kda` over the concatenated segments (same documents and initial
        state) restricted to this rank. Backward issues one reduce-scatter of
        cp*B*H*K*(K+V) values; every rank of the group must run backward through o or final.
    """
    B, T, H, K = q.shape
    Vd = v.shape[-1]
    cp = 1 if group is None else dist.get_world_size(group)
    r = 0 if group is None else dist.get_rank(group)
    if initial_state is not None and r > 0:
        raise ValueError(f"kda_cp: initial_state is read on CP rank 0 only; rank {r} passed one")
    if initial_state is not None and tuple(initial_state.shape) != (B, H, K, Vd):
        raise ValueError(f"kda_cp: initial_state must be [B,H,K,V]=[{B},{H},{K},{Vd}], "
                         f"got {tuple(initial_state.shape)}")
    offsets = None
    if cu_seqlens is not None:
        if cu_seqlens_cpu is not None and cu_seqlens_cpu.numel() != cu_seqlens.numel():
            raise ValueError(f"kda_cp: cu_seqlens_cpu has {cu_seqlens_cpu.numel()} offsets, cu_seqlens "
                             f"{cu_seqlens.numel()}; pass the same offsets on the host")
        offsets = [int(x) for x in (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()]
        if offsets[0] != 0 or offsets[-1] != B * T or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"kda_cp: cu_seqlens must be non-decreasing offsets [0, ..., B*T={B * T}], "
                             f"got {offsets}")
    first, last = _row_docs(offsets, B, T)
    if r == 0:
        carried_rows = list(range(B)) if initial_state is not None else []
    else:
        if continues is None:
            if offsets is not None:
                raise ValueError("kda_cp: `continues` is required with cu_seqlens on CP ranks > 0 "
                                 "(see cp_local_docs)")
            continues = [True] * B
        continues = [bool(c) for c in (continues.tolist() if torch.is_tensor(continues) else continues)]
        if len(continues) != B:
            raise ValueError(f"kda_cp: continues has {len(continues)} entries, need B={B}")
        carried_rows = [b for b in range(B) if continues[b]]
    if cp == 1:
        init_n = None
        if initial_state is not None:  # per document: row b's first document starts from S0_b
            N = B if offsets is None else len(offsets) - 1
            init_n = initial_state.new_zeros(N, H, K, Vd)
            first_idx = host_to_device([torch.tensor(first)], q.device)[0]
            init_n = init_n.index_copy(0, first_idx, initial_state)
        flat = (lambda t: t.reshape(1, B * T, *t.shape[2:])) if offsets is not None else (lambda t: t)
        o, fin = kda(flat(q), flat(k), flat(v), flat(g), flat(beta), scale=scale, initial_state=init_n,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     cu_seqlens_cpu=cu_seqlens_cpu if offsets is not None else None, chunk_size=chunk_size,
                     use_fla=use_fla, lower_bound=lower_bound)
        return o.reshape(B, T, H, Vd), fin

    carried_docs = [first[b] for b in carried_rows]
    o0, u, E, P = _local_pass(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu if offsets is not None else None,
                              carried_docs, scale, chunk_size, use_fla, lower_bound)
    cdt = E.dtype
    if offsets is None:                                   # one document per row: last[b] = b
        E_last, M_last = E, (P if P is not None else E.new_zeros(B, H, K, K))
    else:  # row b's last document ends at (b+1)*T: found on the device, no host-to-device copy
        row_end_B = torch.arange(1, B + 1, dtype=cu_seqlens.dtype, device=cu_seqlens.device) * T
        last_idx = (torch.searchsorted(cu_seqlens, row_end_B) - 1).to(E.device)       # == last
        E_last = E.index_select(0, last_idx)                                          # [B,H,K,V]
        M_last = P.index_select(0, last_idx) if P is not None else E.new_zeros(B, H, K, K)
    if r == 0:
        S_in = initial_state.to(cdt) if initial_state is not None else None
        if S_in is not None:
            E_last = E_last + M_last @ S_in
        M_last = torch.zeros_like(M_last)
    summary = torch.cat([M_last, E_last], -1)                                        # [B,H,K,K+V]
    gathered = _AllGather.apply(summary, group)                                      # [cp,B,H,K,K+V]
    if r > 0:
        S_in = gathered[0][..., K:]                                                  # rank 0: M = 0
        for j in range(1, r):
            S_in = gathered[j][..., :K] @ S_in + gathered[j][..., K:]
    # o = o0 + S_in^T u on each carried row's first document; the rest is o0
    if carried_rows:
        rows = []
        for b in range(B):
            if b not in carried_rows:
                rows.append(o0[b])
                continue
            L = T if offsets is None else offsets[first[b] + 1] - offsets[first[b]]
            corr = torch.einsum("thk,hkv->thv", u[b, :L], S_in[b])
            rows.append(torch.cat([o0[b, :L] + corr, o0[b, L:]], 0) if L < T else o0[b] + corr)
        o = torch.stack(rows, 0)
    else:
        o = o0
    o = o.to(v.dtype)
    if not output_final_state:
        return _Tie.apply(gathered, o)[0], None
    fin = E
    if carried_rows:
        row_of_doc = host_to_device([torch.tensor([first.index(n) if n in carried_docs else 0
                                                   for n in range(E.shape[0])])], q.device)[0]
        fin = E + P @ S_in.index_select(0, row_of_doc)     # P is 0 for documents that are not carried
    o, fin = _Tie.apply(gathered, o, fin)
    return o, fin
