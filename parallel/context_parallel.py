"""Context parallelism (CP): each sequence row split into cp contiguous segments, one per CP rank.

Placement. CP rank r of a row of length T holds tokens ``[r*T/cp, (r+1)*T/cp)`` (contiguous), with
the same rows (the same data-parallel micro-batch) on every rank of the CP group. Both layer kinds
read this one placement:

- KDA (69 of K3's 93 layers): the exact state-summary scan (:func:`parallel.kda_cp.kda_cp`) needs
  each rank's segment to be one contiguous run of the recurrence: rank r folds the affine maps of
  ranks 0..r-1 into its incoming state, and the short convolutions take the previous rank's last
  kernel-1 tokens (:func:`parallel.kda_cp.exchange_conv_halo`). Its traffic per layer is
  ``cp*B*H*K*(K+V)`` values, independent of T.
- Gated MLA: every rank all-gathers the compressed latent (``kv_a_proj_with_mqa`` output,
  kv_lora_rank + the rope slot = 576 values per token at K3 size, not the expanded per-head K/V),
  expands K/V locally and runs its local queries against keys ``[0, end of own segment)``
  (:func:`megak3.ops.attention.attention` with ``q_offset``). Backward reduce-scatters the latent's
  gradient (the autograd all-gather of parallel/kda_cp.py).

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
(megak3/launch/planner/flops.py ``layer_flops_per_token``, one document per row) the last rank's forward work
is, at cp=4 for k3_tiny, 1.17x / 1.40x / 1.62x the average at T = 4K / 16K / 64K (MLA scores
22% / 54% / 82% of the layer FLOPs), and 1.76x for K3 at T = 1M, cp=32 (MLA scores 79%): the planner
charges each pipeline stage its MLA layers' share of that, and a balanced placement would cut the
compute term of such a step by up to 43%. Zigzag (rank r holds chunks r and 2cp-1-r) equalises the
score work, but breaks the KDA scan into two non-adjacent runs per rank: the scan would need two
summaries per rank and a second exclusive fold in the middle of the ring, and the conv halos would come
from two different ranks. We keep one placement for both kinds (contiguous); the MLA imbalance is
what the balanced schedule below removes (on by default). Measured
on this CPU (docs/SCALING.md, k3_tiny, T = 64K, cp=4, the bench's row) the slowest rank's CPU time is
only 1.05x a quarter of cp=1's: CPU time is not proportional to these FLOP shares.

Balanced MLA (``parallel.cp_balance``, default true; :meth:`CPShard.balanced_attention`). KDA
keeps the contiguous segments above; only MLA's query work moves. Each row is cut into ``split * cp``
query blocks of T/(split*cp) tokens (``parallel.cp_balance_split``, default 2; rank r holds blocks
split*r .. split*r+split-1). :func:`balanced_blocks` gives every rank ``split`` blocks to compute: with
one document per row and split 2 the head-tail pairing r and 2cp-1-r (every rank (2cp+1)/2 segments
of key work: exactly even), with packed rows a work-balanced assignment from the blocks' allowed
(query, key) counts (:func:`block_work`, computed on every rank from the global ``cu_seqlens``, so all
agree). Per MLA layer: the latent is all-gathered as before; the local q (fp32, [B, H/tp, T/cp, qk])
goes to the computing ranks in one all-to-all; each rank runs
:func:`megak3.ops.latent_attention.latent_attention` for its blocks, which expands K/V from the latent one key
block (T/(split*cp) keys, ``CPShard.key_block``) at a time and merges the blocks' outputs by their
log-sum-exp, and again block by block in backward; the outputs return by the reverse all-to-all.
Counted (:func:`mla_score_work`, the chunk pairs the layers visit, k3_tiny chunks at T = 64K): the
heaviest rank's score work over the average is 1.00 at cp 4 and 8 with one document per row (1.75 /
1.87 contiguous) and 1.03 / 1.05 (split 4) for bench_long_context's three documents (1.48 / 1.79
contiguous). No rank holds more than one key block's expanded K/V (the contiguous last rank holds all
T). What it costs: every computed query block expands its key prefix again, (cp*split + 1)/2 key
expansions per token on average instead of one (2 * kv_lora_rank * H * (nope + v) FLOPs each: ~2.5% of
the MLA score FLOPs at K3, T = 1M, cp 32, split 2), and the q / o all-to-all (fp32, H*(qk+v) values per
local token each way). On CUDA each key block is one FlexAttention call that also returns its
log-sum-exp (megak3/ops/latent_attention.py; forward and the exact backward through the kernel),
elsewhere the chunked pure-torch twin. ``parallel.cp_balance=false`` restores the contiguous
schedule (required with ``pp_schedule=zb_h1``).

Documents. The global packing (``cu_seqlens`` over the flattened global ``B*T`` stream) is cut per
rank by :func:`parallel.kda_cp.cp_local_docs`: local ``cu_seqlens`` (row ends included), whether
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
import functools
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.distributed as dist

from megak3.model.seqinfo import SeqInfo, make_seq_info
from megak3.ops.latent_attention import latent_attention
from parallel.config import ParallelConfig
from parallel.kda_cp import (_nbytes, all_gather_autograd, conv_halo_seq_info, cp_local_docs, exchange_conv_halo,
                             kda_cp, record_comm)

__all__ = ["CPShard", "ContextParallel", "balanced_blocks", "block_work", "check_context_parallel", "mla_score_work",
           "parallelize_cp"]


def balanced_blocks(cp: int, rank: int, block_work=None, split: int = 2) -> list:
    """Global query blocks (each row cut into ``split * cp`` blocks of T/(split*cp) tokens; rank r
    holds blocks split*r .. split*r + split-1) whose MLA attention rank ``rank`` computes under
    ``parallel.cp_balance``, ascending.

    ``block_work``: the score entries of each block's queries (:func:`block_work`; None = one document
    per row, where block b's work grows with b). Blocks go heaviest first (ties: higher index first)
    to the rank with the least work so far (ties: lower rank) among those holding fewer than
    ``split`` blocks, so every rank computes ``split`` blocks; with ``block_work`` given, blocks of the
    heaviest rank are then swapped with lighter ones while that lowers the heaviest rank's work. For one document per row and split 2
    that is the head-tail pairing r and 2cp-1-r ((r + 1) + (2cp - r) = 2cp + 1 key blocks on every
    rank)."""
    return _assignment(cp, split, None if block_work is None else tuple(block_work))[rank]


@functools.lru_cache(maxsize=64)
def _assignment(cp: int, split: int, work) -> list:
    n = split * cp
    w = list(range(n)) if work is None else list(work)
    load, blocks = [0] * cp, [[] for _ in range(cp)]
    for b in sorted(range(n), key=lambda b: (-w[b], -b)):
        r = min((r for r in range(cp) if len(blocks[r]) < split), key=lambda r: (load[r], r))
        load[r] += w[b] if work is not None else b + 1
        blocks[r].append(b)
    if work is not None:  # then swap a block of the heaviest rank with one of another while that lowers it
        for _ in range(4 * n):
            top = max(range(cp), key=lambda r: (load[r], -r))
            best = None
            for r in range(cp):
                for a in blocks[top]:
                    for b in blocks[r]:
                        d = w[a] - w[b]
                        if d > 0 and load[r] + d < load[top] and (best is None or max(load[top] - d, load[r] + d)
                                                                  < best[0]):
                            best = (max(load[top] - d, load[r] + d), r, a, b)
            if best is None:
                break
            _, r, a, b = best
            d = w[a] - w[b]
            blocks[top][blocks[top].index(a)], blocks[r][blocks[r].index(b)] = b, a
            load[top], load[r] = load[top] - d, load[r] + d
    return [sorted(x) for x in blocks]


def block_work(doc_ids_BT: Optional[torch.Tensor], T: int, blocks: int) -> Optional[list]:
    """Allowed (query, key) pairs of each of ``blocks`` equal query blocks of rows with document ids
    ``doc_ids_BT`` [B, T] (non-decreasing along each row; a query sees its document's keys up to
    itself), or None for None (one document per row)."""
    if doc_ids_BT is None:
        return None
    d = doc_ids_BT.cpu()
    t = torch.arange(T, device="cpu").expand_as(d)
    start = torch.ones_like(d, dtype=torch.bool)
    start[:, 1:] = d[:, 1:] != d[:, :-1]
    first = torch.where(start, t, torch.zeros_like(t)).cummax(dim=1).values
    return (t - first + 1).sum(0).view(blocks, -1).sum(1).tolist()


def mla_score_work(T: int, cp: int, balance: bool, q_chunk: int = 256, k_chunk: int = 256,
                   cu_seqlens=None, B: int = 1, split: int = 2) -> list:
    """Score entries (query x key products, per head) each CP rank's MLA computes for rows of T tokens:
    the sum over the chunk pairs that :func:`megak3.ops.attention.chunked_attention` (contiguous) or
    :func:`megak3.ops.latent_attention.latent_attention` (balanced, key blocks of T/(2cp)) visit, built from
    the same visibility plans the layers run (``cu_seqlens``: packed documents over the B rows)."""
    from megak3.model.seqinfo import make_seq_info
    from megak3.ops.attention import _Plan
    from megak3.ops.latent_attention import _block_plan, _key_blocks

    doc = None
    if cu_seqlens is not None:
        whole = make_seq_info(B, T, torch.as_tensor(cu_seqlens))
        doc = whole.doc_ids_BT if whole.cu_seqlens.numel() - 1 != B else None
    S = T // cp
    work_b = block_work(doc, T, split * cp)

    def count(plan):
        return sum((min(plan.q_range(i)[1], plan.T) - plan.q_range(i)[0]) * (plan.k_range(j)[1] - plan.k_range(j)[0])
                   for i, pairs in enumerate(plan.rows) for j, _, _ in pairs) * B

    work = []
    for r in range(cp):
        if not balance:
            work.append(count(_Plan(S, q_chunk, k_chunk, None if doc is None else doc[:, : (r + 1) * S], r * S)))
            continue
        h, total = S // split, 0
        for blk in balanced_blocks(cp, r, work_b, split):
            q0 = blk * h
            dq = None if doc is None else doc[:, q0:q0 + h]
            for k0, k1 in _key_blocks(q0, h, T, h):
                total += count(_block_plan(h, q_chunk, k_chunk, dq, doc, q0, k0, k1))
        work.append(total)
    return work


class _Exchange(torch.autograd.Function):
    """all_to_all of blocks stacked on dim 0 (``send``/``recv``: blocks per peer); backward: the reverse."""

    @staticmethod
    def forward(ctx, x_N, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x_N, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(x_N, send, recv, group):
    x_N = x_N.detach().contiguous()
    out = x_N.new_empty((sum(recv),) + tuple(x_N.shape[1:]))
    per = _nbytes(x_N[:1]) if x_N.shape[0] else 0
    record_comm("mla_query_all_to_all", _nbytes(x_N), per * (sum(send) - send[dist.get_rank(group)]))
    dist.all_to_all_single(out, x_N, output_split_sizes=list(recv), input_split_sizes=list(send), group=group)
    return out


def check_context_parallel(cp: int, tp: int, sequence_parallel: bool, seq_len: int, model_cfg=None,
                           balance_split: int = 0) -> None:
    """Raise ValueError naming the field when ``parallel.cp`` cannot split ``data.seq_len``
    (``balance_split``: ``parallel.cp_balance_split`` when ``parallel.cp_balance`` is on, else 0)."""
    if cp == 1:
        return
    shard = cp * (tp if sequence_parallel and tp > 1 else 1)
    if seq_len % shard:
        what = f"parallel.cp x parallel.tp = {cp} x {tp}" if shard != cp else f"parallel.cp={cp}"
        raise ValueError(f"data.seq_len={seq_len} must be a multiple of {what} (each CP rank holds "
                         f"seq_len/cp contiguous tokens{', split again over TP by SP' if shard != cp else ''})")
    if balance_split and seq_len % (cp * balance_split):
        raise ValueError(f"data.seq_len={seq_len} must be a multiple of parallel.cp x parallel.cp_balance_split "
                         f"= {cp} x {balance_split} under parallel.cp_balance=true (lower cp_balance_split, or "
                         f"set parallel.cp_balance=false)")
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
    """int64 [B, T/cp] global position in document of every local token, ON THE HOST (the conv halo's
    document starts are index math on it, :func:`parallel.kda_cp.conv_halo_seq_info`), or None
    (unpacked rows)"""
    key_doc_ids_BT: Optional[torch.Tensor]
    """int64 [B, offset + T/cp] document ids of the keys MLA attends to ([B, T] under ``balance``), or
    None (one document per row)"""
    balance: bool = False
    """MLA under ``parallel.cp_balance``: :meth:`balanced_attention` instead of :meth:`gather_keys`"""
    key_block: int = 0
    """balanced: keys expanded per block of this many tokens (0 = T/(2cp), the query block)"""
    split: int = 2
    """balanced: query blocks per rank (each T/(split*cp) tokens)"""
    block_work: Optional[list] = None
    """balanced, packed rows: :func:`block_work` of the whole rows (which blocks each rank computes)"""
    device: Optional[torch.device] = None
    """where the layers run (the conv halo's SeqInfo is moved there)"""
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
            self._conv_seq[W] = conv_halo_seq_info(self.pos_in_doc_BT, W, self.device or x_BTP.device)
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

    def balanced_attention(self, q_BHSK: torch.Tensor, latent_BSL: torch.Tensor, expand, params, scale: float,
                           q_chunk: int, k_chunk: int) -> torch.Tensor:
        """MLA output [B, H, T/cp, V] of this rank's queries under the balanced schedule: the local
        queries, cut into two blocks of T/(2cp), go to the ranks computing them (:func:`balanced_blocks`,
        one all-to-all), every rank runs :func:`megak3.ops.latent_attention.latent_attention` for its two
        blocks against the all-gathered latent (K/V expanded one key block at a time) and the outputs
        come back by the reverse all-to-all. Backward runs the same exchanges in reverse."""
        B, H, S, K = q_BHSK.shape
        cp, r, n = self.size, self.rank, self.split
        h = S // n
        Tl = latent_BSL.shape[1]
        parts = all_gather_autograd(latent_BSL, self.group, "mla_latent_")  # [cp, B, S, L]
        latent = parts.permute(1, 0, 2, 3).reshape(B, cp * Tl, latent_BSL.shape[-1])
        where = {b: d for d in range(cp) for b in balanced_blocks(cp, d, self.block_work, n)}  # block -> rank
        mine = list(range(n * r, n * r + n))
        send_order = sorted(mine, key=lambda b: (where[b], b))
        send = [sum(where[b] == d for b in mine) for d in range(cp)]
        computed = balanced_blocks(cp, r, self.block_work, n)  # arrives ordered by owner (b // n), then block
        recv = [sum(b // n == s for b in computed) for s in range(cp)]
        blocks = q_BHSK.view(B, H, n, h, K)
        q_blocks = _Exchange.apply(torch.stack([blocks[:, :, b - n * r] for b in send_order]), send, recv,
                                   self.group)
        doc = self.key_doc_ids_BT
        outs = []
        for n, b in enumerate(computed):
            dq = None if doc is None else doc[:, b * h:(b + 1) * h]
            outs.append(latent_attention(q_blocks[n], latent[:, : (b + 1) * h], expand, params, scale, dq,
                                         None if doc is None else doc[:, : (b + 1) * h], q_pos0=b * h,
                                         k_block=self.key_block or h, q_chunk=q_chunk, k_chunk=k_chunk))
        back = _Exchange.apply(torch.stack(outs), recv, send, self.group)  # in send_order
        o = [back[send_order.index(b)] for b in mine]
        return torch.cat(o, dim=2)


class ContextParallel:
    """The model's ``context_parallel`` hook: cuts whole rows into this rank's segment."""

    def __init__(self, group, size: int, rank: int, balance: bool = False, split: int = 2, conv_kernel: int = 0):
        """``conv_kernel``: the KDA short convolutions' kernel (``model.kda.conv_kernel``): their halo
        SeqInfo is built in :meth:`shard` and rides in its one host-to-device copy (0: built by the
        first ``causal_conv``, in a copy of its own)."""
        self.group, self.size, self.rank, self.balance, self.split = group, size, rank, balance, split
        self.conv_kernel = conv_kernel

    def shard(self, input_ids_BT: torch.Tensor, labels_BT: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor]):
        """(local input ids [B, T/cp], local labels or None, local SeqInfo with ``.cp``) of whole rows
        ``input_ids_BT`` [B, T] packed as ``cu_seqlens`` (global offsets; None = one document per row)."""
        B, T = input_ids_BT.shape
        if T % (self.split * self.size if self.balance else self.size):
            raise ValueError(f"sequence length {T} is not a multiple of "
                             f"{f'{self.split} x ' if self.balance else ''}parallel.cp={self.size}")
        Tl, r = T // self.size, self.rank
        dev = input_ids_BT.device
        # all document index math runs on the host copy of the offsets (the loader's batch: reading
        # it is not a device sync); only its results move to the device
        cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens).cpu()
        docs = cp_local_docs(cu, B, T, self.size, r)
        key_doc_host = None
        if cu is not None:
            whole = make_seq_info(B, T, cu)
            if whole.cu_seqlens_host.numel() - 1 != B:  # some row holds more than one document
                key_doc_host = whole.doc_ids_BT[:, : T if self.balance else (r + 1) * Tl]
        halo = None  # the conv halo's SeqInfo (packed rows only; built on the host)
        if self.conv_kernel and docs.pos_in_doc_BT is not None:
            halo = conv_halo_seq_info(docs.pos_in_doc_BT, self.conv_kernel)
        # the local SeqInfo, the key document ids, the local offsets and the halo's offsets and
        # positions: one non-blocking host-to-device copy (megak3.ops.h2d)
        seq, (key_doc, local_cu, halo_cu, halo_pos) = make_seq_info(B, Tl, docs.cu_seqlens).moved(
            dev, (key_doc_host, docs.cu_seqlens, None if halo is None else halo.cu_seqlens,
                  None if halo is None else halo.pos_in_doc_BT))
        shard = CPShard(self.group, self.size, r, Tl, docs.continues, local_cu, docs.pos_in_doc_BT, key_doc,
                        balance=self.balance,
                        split=self.split,
                        block_work=block_work(key_doc_host, T, self.split * self.size) if self.balance else None,
                        device=dev)
        if halo is not None:
            shard._conv_seq[self.conv_kernel] = dataclasses.replace(halo, cu_seqlens=halo_cu, pos_in_doc_BT=halo_pos)
        seq = dataclasses.replace(seq, cp=shard)
        sl = slice(r * Tl, (r + 1) * Tl)
        labels = None if labels_BT is None else labels_BT[:, sl]
        return input_ids_BT[:, sl], labels, seq


def parallelize_cp(model, ps, parallel_cfg=None) -> Optional[ContextParallel]:
    """Install the model's ``context_parallel`` hook (``ParallelHooks``) when ``ps.cp_size > 1`` (returns the hook, or None);
    ``parallel_cfg``: a ParallelConfig whose ``cp_balance`` / ``cp_balance_split`` pick MLA's
    schedule (None = ParallelConfig's defaults: balanced, split 2)."""
    if ps.cp_size == 1:
        return None
    balance = bool(getattr(parallel_cfg, "cp_balance", ParallelConfig.cp_balance))
    split = int(getattr(parallel_cfg, "cp_balance_split", ParallelConfig.cp_balance_split))
    kda = getattr(getattr(model, "config", None), "kda", None)
    hook = ContextParallel(ps.cp_group, ps.cp_size, dist.get_rank(ps.cp_group), balance, split,
                           conv_kernel=getattr(kda, "conv_kernel", 0))
    model.set_parallel_hooks(replace(model.parallel_hooks, context_parallel=hook))
    return hook
