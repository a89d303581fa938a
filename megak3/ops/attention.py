"""Causal, same-document softmax attention that never forms a [Tq, Tk] score tensor outside its dense
twin (MLA's attention core).

Memory: the per-token tensors are O(T). The chunked and FlexAttention paths also keep a chunk- or
block-level structure that grows as T^2 over the chunk area, not linearly: the chunked path's
visibility plan (a host-side list of up to (Tq / q_chunk) * (Tk / k_chunk) pairs) and the
FlexAttention block mask (a few [B, 1, Tq/128, Tk/128] tensors: O((T/128)^2), a peak of 7.5 MiB per
row at T = 65,536, growing 4x per doubling of T). ``reference_attention`` is O(T^2).

A query at token t of row b attends to the key at token s of the same row iff ``s <= t`` and
``doc_ids_BT[b, s] == doc_ids_BT[b, t]`` (without ``doc_ids_BT``: iff ``s <= t``). Shapes:

    q_BHTK  [B, H, T, K]   queries
    k_BHTK  [B, H, T, K]   keys
    v_BHTV  [B, H, T, V]   values
    doc_ids_BT [B, T]      integer document id per token, or None (one document per row)
    returns o_BHTV [B, H, T, V] in q's dtype

Query offset (context parallelism, parallel/context_parallel.py): with ``q_offset = t0`` the Tq
queries sit at positions ``[t0, t0 + Tq)`` of the rows and the Tk >= t0 + Tq keys at ``[0, Tk)``;
query t attends to key s iff ``s <= t0 + t`` and their document ids agree; ``doc_ids_BT`` is then
``[B, Tk]`` (the keys' ids; the queries' are ``doc_ids_BT[:, t0:t0 + Tq]``). A CP rank holding the
segment ``[t0, t0 + Tq)`` of every row runs its local queries against the gathered keys of the
segments up to its own. ``q_offset = 0`` with Tq == Tk is the ordinary self-attention above.

``chunked_attention`` is flash-style: it loops over query chunks and key chunks with an online softmax
(fp32 running max and sum, fp32 output accumulator), so every temporary is at most
``[B, H, q_chunk, k_chunk]``. Chunk pairs whose keys are all in the future of the query chunk, or whose
document-id ranges do not overlap in any row, are skipped; the visibility plan (a host-side list of
at most (T / q_chunk) * (T / k_chunk) pairs) is computed once per call from per-chunk min/max
document ids (one small device-to-host copy). Its backward (a custom
``torch.autograd.Function``) saves q, k, v, the output and the per-row fp32 logsumexp, and recomputes
the probabilities chunk pair by chunk pair, so no tensor of forward or backward exceeds O(T) apart
from the chunk-pair temporaries.

``reference_attention`` is the dense masked fp32 softmax (O(T^2) memory), the twin for tests.

``latent_attention`` (balanced CP, ``parallel.cp_balance``) lives in megak3/ops/latent_attention.py:
the same softmax on K/V it expands from a latent one key block at a time (this module's chunked
loop on CPU, FlexAttention with its log-sum-exp on CUDA).

``attention`` is the entry point: without document ids it calls
``F.scaled_dot_product_attention(is_causal=True)`` on any device (its CPU and CUDA flash kernels keep
memory linear in T); on CUDA with document ids or a query offset (context parallelism) it calls
``flex_document_attention``: a compiled FlexAttention with a causal document block mask, offset by
``q_offset``, when ``torch.nn.attention.flex_attention`` imports; elsewhere it calls
``chunked_attention``. Before the first FlexAttention call of each call signature (shapes, dtype,
device, documents, offset) its forward and backward run once on detached copies; if either raises,
a warning is issued once and ``chunked_attention`` serves forward and backward from then on. The
block mask (``flex_block_mask``) is built from block bounds (no [Tq, Tk] tensor) and tested on CPU
against torch's dense ``create_block_mask`` and, with torch's eager FlexAttention, the chunked and
dense twins (forward: torch 2.13 has no FlexAttention backward on CPU); its memory at T = 65,536 is
measured on the meta device (tests/test_flex_memory.py); the compiled CUDA kernel and its backward
run in tools/gpu_check.py.
"""
from __future__ import annotations

import functools
import warnings
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

DEFAULT_Q_CHUNK = 256
DEFAULT_K_CHUNK = 256

# one entry per visible chunk pair: (other chunk index, needs the causal mask, needs the document mask)
_Pairs = List[Tuple[int, bool, bool]]


def reference_attention(q_BHTK, k_BHTK, v_BHTV, scale: float, doc_ids_BT: Optional[torch.Tensor] = None,
                        q_offset: int = 0):
    """Dense twin: ``softmax(q k^T * scale + mask) v`` with a ``[B, 1, Tq, Tk]`` causal/document mask,
    in fp32 (fp64 for fp64 inputs); ``q_offset`` as in the module docstring."""
    Tq, Tk = q_BHTK.shape[2], k_BHTK.shape[2]
    ct = torch.promote_types(q_BHTK.dtype, torch.float32)
    s = torch.matmul(q_BHTK.to(ct), k_BHTK.to(ct).transpose(-1, -2)) * scale
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q_BHTK.device).tril(q_offset)
    if doc_ids_BT is not None:
        q_doc = doc_ids_BT[:, q_offset:q_offset + Tq]
        allowed = allowed & (q_doc[:, :, None] == doc_ids_BT[:, None, :]).unsqueeze(1)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.matmul(p, v_BHTV.to(ct)).to(q_BHTK.dtype)


def _chunk_minmax(doc_BT: torch.Tensor, c: int):
    """Per-chunk (min, max) document id, each [B, ceil(T / c)]."""
    B, T = doc_BT.shape
    pad = -T % c
    if pad:  # repeating the last id leaves every chunk's min and max unchanged
        doc_BT = torch.cat([doc_BT, doc_BT[:, -1:].expand(B, pad)], dim=1)
    d = doc_BT.view(B, -1, c)
    return d.amin(-1), d.amax(-1)


class _Plan:
    """Which (query chunk, key chunk) pairs have any allowed entry, and which masks each needs.

    T: number of queries; keys: ``k_len`` (default ``q_offset + T``); query i sits at position
    ``q_offset + i``; ``doc_BT``: the keys' document ids ``[B, k_len]`` or None."""

    def __init__(self, T: int, q_chunk: int, k_chunk: int, doc_BT: Optional[torch.Tensor],
                 q_offset: int = 0, k_len: Optional[int] = None, q_doc_BT: Optional[torch.Tensor] = None):
        Tk = q_offset + T if k_len is None else k_len
        self.T, self.Tk, self.q_offset, self.qc, self.kc = T, Tk, q_offset, q_chunk, k_chunk
        if doc_BT is not None and q_doc_BT is None:
            q_doc_BT = doc_BT[:, q_offset:q_offset + T]
        self.q_doc = q_doc_BT
        qs = torch.arange(0, T, q_chunk)
        ks = torch.arange(0, Tk, k_chunk)
        qe, ke = (qs + q_chunk).clamp(max=T), (ks + k_chunk).clamp(max=Tk)
        visible = ks[None, :] <= (q_offset + qe - 1)[:, None]   # [nq, nk]: some key not in the future
        need_causal = (ke - 1)[None, :] > (q_offset + qs)[:, None]  # some key in the future of some query
        if doc_BT is None:
            need_doc = torch.zeros_like(visible)
        else:
            qmin, qmax = _chunk_minmax(q_doc_BT, q_chunk)
            kmin, kmax = _chunk_minmax(doc_BT, k_chunk)
            qmin, qmax, kmin, kmax = qmin[:, :, None], qmax[:, :, None], kmin[:, None, :], kmax[:, None, :]
            overlap = ((kmin <= qmax) & (kmax >= qmin)).any(0)  # document ranges intersect in some row
            uniform = ((qmin == qmax) & (kmin == kmax) & (qmin == kmin)).all(0)  # one document everywhere
            flags = torch.stack([overlap, uniform]).cpu()
            visible = visible & flags[0]
            need_doc = ~flags[1]
        self.rows: List[_Pairs] = [[] for _ in range(qs.numel())]
        self.cols: List[_Pairs] = [[] for _ in range(ks.numel())]
        for i, j in visible.nonzero().tolist():
            nc, nd = bool(need_causal[i, j]), bool(need_doc[i, j])
            self.rows[i].append((j, nc, nd))
            self.cols[j].append((i, nc, nd))

    def q_range(self, i: int):
        return i * self.qc, min((i + 1) * self.qc, self.T)

    def k_range(self, j: int):
        return j * self.kc, min((j + 1) * self.kc, self.Tk)


def _disallowed(plan: _Plan, i: int, j: int, nc: bool, nd: bool, doc_BT, idx_T):
    """[B or 1, 1, cq, ck] bool, True where the entry is masked out; None when nothing is.
    ``idx_T``: arange over the keys (query i's position is ``q_offset + i``)."""
    q0, q1 = plan.q_range(i)
    k0, k1 = plan.k_range(j)
    t0 = plan.q_offset
    out = None
    if nc:
        q_pos = torch.arange(t0 + q0, t0 + q1, device=idx_T.device)
        out = (idx_T[None, k0:k1] > q_pos[:, None])[None, None]
    if nd:
        other = (plan.q_doc[:, q0:q1, None] != doc_BT[:, None, k0:k1]).unsqueeze(1)
        out = other if out is None else out | other
    return out


def _forward(q, k, v, doc_BT, scale: float, plan: _Plan):
    B, H, T, _ = q.shape
    o = torch.empty(B, H, T, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    idx = torch.arange(plan.Tk, device=q.device)
    neg_inf = float("-inf")
    for i, pairs in enumerate(plan.rows):
        q0, q1 = plan.q_range(i)
        qq = q[:, :, q0:q1].float()
        m = torch.full((B, H, q1 - q0), neg_inf, dtype=torch.float32, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(B, H, q1 - q0, v.shape[-1], dtype=torch.float32, device=q.device)
        for j, nc, nd in pairs:
            k0, k1 = plan.k_range(j)
            s = torch.matmul(qq, k[:, :, k0:k1].float().transpose(-1, -2)).mul_(scale)
            bad = _disallowed(plan, i, j, nc, nd, doc_BT, idx)
            if bad is not None:
                s.masked_fill_(bad, neg_inf)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == neg_inf, 0.0)  # rows with no allowed key so far
            p = s.sub_(m_safe.unsqueeze(-1)).exp_()
            alpha = (m - m_safe).exp_()
            l.mul_(alpha).add_(p.sum(-1))
            acc.mul_(alpha.unsqueeze(-1)).add_(torch.matmul(p, v[:, :, k0:k1].float()))
            m = m_new
        # a query with no allowed key here (only in latent_attention's key blocks): o = 0, lse = -inf
        o[:, :, q0:q1] = acc.div_(l.masked_fill(l == 0, 1.0).unsqueeze(-1))
        lse[:, :, q0:q1] = m + l.log()
    return o, lse


def _backward(do, q, k, v, o, lse, doc_BT, scale: float, plan: _Plan):
    idx = torch.arange(plan.Tk, device=q.device)
    neg_inf = float("-inf")
    delta = (do.float() * o.float()).sum(-1)  # [B, H, T]: rowsum(dO * O)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for j, pairs in enumerate(plan.cols):
        k0, k1 = plan.k_range(j)
        kk, vv = k[:, :, k0:k1].float(), v[:, :, k0:k1].float()
        dk_j, dv_j = dk[:, :, k0:k1], dv[:, :, k0:k1]
        for i, nc, nd in pairs:
            q0, q1 = plan.q_range(i)
            qq, dd = q[:, :, q0:q1].float(), do[:, :, q0:q1].float()
            s = torch.matmul(qq, kk.transpose(-1, -2)).mul_(scale)
            bad = _disallowed(plan, i, j, nc, nd, doc_BT, idx)
            if bad is not None:
                s.masked_fill_(bad, neg_inf)
            p = s.sub_(lse[:, :, q0:q1].unsqueeze(-1)).exp_()
            dv_j.add_(torch.matmul(p.transpose(-1, -2), dd))
            ds = torch.matmul(dd, vv.transpose(-1, -2)).sub_(delta[:, :, q0:q1].unsqueeze(-1)).mul_(p)
            dq[:, :, q0:q1].add_(torch.matmul(ds, kk))
            dk_j.add_(torch.matmul(ds.transpose(-1, -2), qq))
    return dq.mul_(scale), dk.mul_(scale), dv


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc_BT, scale, q_chunk, k_chunk, q_offset):
        plan = _Plan(q.shape[2], q_chunk, k_chunk, doc_BT, q_offset, k.shape[2])
        o, lse = _forward(q, k, v, doc_BT, scale, plan)
        ctx.save_for_backward(q, k, v, o, lse, doc_BT)
        ctx.plan, ctx.scale = plan, scale
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse, doc_BT = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, doc_BT, ctx.scale, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def _check(q, k, v, doc_ids_BT, q_offset: int = 0):
    same = q.shape == k.shape if q_offset == 0 else (k.dim() == 4 and q.shape[:2] == k.shape[:2]
                                                      and q.shape[3] == k.shape[3])
    if q.dim() != 4 or not same or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"expected q, k [B, H, T, K] and v [B, H, T, V]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q_offset < 0 or q_offset + q.shape[2] > k.shape[2]:
        raise ValueError(f"q_offset={q_offset} with {q.shape[2]} queries needs at least "
                         f"{q_offset + q.shape[2]} keys; got {k.shape[2]}")
    if doc_ids_BT is not None and tuple(doc_ids_BT.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"doc_ids_BT must be [B, T] = {[k.shape[0], k.shape[2]]}; got {list(doc_ids_BT.shape)}")


def chunked_attention(q_BHTK, k_BHTK, v_BHTV, scale: float, doc_ids_BT: Optional[torch.Tensor] = None,
                      q_chunk: int = DEFAULT_Q_CHUNK, k_chunk: int = DEFAULT_K_CHUNK,
                      q_offset: int = 0) -> torch.Tensor:
    """Causal same-document attention, chunk by chunk (shapes in the module docstring).

    ``q_chunk`` / ``k_chunk``: query / key tokens per chunk (need not divide T). ``q_offset``: the
    queries' position among the keys (module docstring). Math in fp32; returns q's dtype; gradients
    flow to q, k, v (not to ``doc_ids_BT``).
    """
    _check(q_BHTK, k_BHTK, v_BHTV, doc_ids_BT, q_offset)
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"q_chunk and k_chunk must be >= 1; got {q_chunk}, {k_chunk}")
    doc = None if doc_ids_BT is None else doc_ids_BT.to(q_BHTK.device)
    return _ChunkedAttention.apply(q_BHTK, k_BHTK, v_BHTV, doc, float(scale), int(q_chunk), int(k_chunk),
                                   int(q_offset))


@functools.lru_cache(maxsize=None)
def _flex_functions():
    """(compiled flex_attention, eager flex_attention, BlockMask), or None when FlexAttention
    does not import."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention
    except Exception:  # noqa: BLE001 - any import failure means: not available
        return None
    return torch.compile(flex_attention, dynamic=False), flex_attention, BlockMask


FLEX_BLOCK = 128
"""FlexAttention's sparse block size (torch's default): the block mask has one entry per
FLEX_BLOCK x FLEX_BLOCK tile of the [Tq, Tk] score matrix"""

_flex_failed = False
_flex_probed: dict = {}
"""call signatures (shapes, dtype, device, documents, offset) whose FlexAttention forward and
backward already ran once (``_flex_probe``)"""
_block_mask_cache: list = []
"""one entry ``(key, doc_BT, block_mask)``: the MLA layers of one forward share their document ids
(and, under CP, their query offset), so the block mask is built once per forward, not per layer;
the entry holds ``doc_BT`` so its id cannot be reused while cached"""


def _ordered(blocks_BHQK: torch.Tensor):
    """FlexAttention's (num_blocks [B, H, nq] int32, indices [B, H, nq, nk] int32) of a block-level
    bool tensor: each row's set blocks in ascending order first, then the unset ones ascending
    (the order torch's ``create_block_mask`` produces)."""
    m = blocks_BHQK.to(torch.int32)
    idx = torch.argsort(m, dim=-1, descending=True, stable=True)
    return m.sum(-1, dtype=torch.int32), idx.to(torch.int32)


def flex_block_tiles(doc_BT: Optional[torch.Tensor], B: int, Tq: int, Tk: int, q_offset: int, device,
                     block: int = FLEX_BLOCK, doc_q_BT: Optional[torch.Tensor] = None):
    """(partial, full): bool ``[B, 1, ceil(Tq / block), ceil(Tk / block)]`` tiles of the mask of
    :func:`flex_block_mask`, computed from block bounds only (never a [Tq, Tk] tensor).

    Tile (i, j) holds queries ``[i*block, (i+1)*block)`` (positions ``q_offset + ...``) and keys
    ``[j*block, (j+1)*block)``. It is *full* when every entry is allowed: a complete tile (not
    cut by Tq or Tk) whose last key is not in the future of its first query, and whose queries
    and keys all carry one and the same document id. It is *partial* when it is not full and
    some key is not in the future of the tile's last query and the tile's query and key
    document-id ranges ``[min, max]`` overlap in that row. With document ids non-decreasing along
    each row (packed documents) this is exact: the tiles equal ``create_block_mask``'s (test:
    tests/test_flex_memory.py); with other ids a tile whose ranges overlap without a common id is
    marked partial where create_block_mask leaves it empty (the kernel then applies the
    per-entry mask there: same attention, some wasted work). Memory: O(B * T) for the per-tile
    min / max ids plus O(B * (Tq/block) * (Tk/block)) for the tiles; no device-to-host copy.
    ``doc_q_BT`` [B, Tq]: the queries' ids when they are not ``doc_BT[:, q_offset:q_offset + Tq]``
    (a key block of latent_attention: ``q_offset`` may then be negative or exceed Tk - Tq)."""
    nq, nk = -(-Tq // block), -(-Tk // block)
    qs = torch.arange(nq, device=device) * block
    ks = torch.arange(nk, device=device) * block
    qe, ke = (qs + block).clamp(max=Tq), (ks + block).clamp(max=Tk)
    first_q, last_q = q_offset + qs, q_offset + qe - 1                       # absolute positions
    some = ks[None, :] <= last_q[:, None]                                     # [nq, nk]
    every = ((ke - 1)[None, :] <= first_q[:, None]) & ((qe - qs) == block)[:, None] \
        & ((ke - ks) == block)[None, :]
    some, every = some.expand(B, nq, nk), every.expand(B, nq, nk)
    if doc_BT is not None:
        qmin, qmax = _chunk_minmax(doc_BT[:, q_offset:q_offset + Tq] if doc_q_BT is None else doc_q_BT, block)
        kmin, kmax = _chunk_minmax(doc_BT, block)                               # [B, nk]
        some = some & (kmin[:, None, :] <= qmax[:, :, None]) & (kmax[:, None, :] >= qmin[:, :, None])
        one_doc = (qmin == qmax)[:, :, None] & (kmin == kmax)[:, None, :] & (qmin[:, :, None] == kmin[:, None, :])
        every = every & one_doc
    return (some & ~every).unsqueeze(1), every.unsqueeze(1)


def flex_block_mask(doc_BT: Optional[torch.Tensor], B: int, Tq: int, Tk: int, q_offset: int, device):
    """The causal (same-document when ``doc_BT`` [B, Tk] is given) block mask of ``Tq`` queries at
    ``q_offset`` among ``Tk`` keys: key j is visible to query i iff ``j <= i + q_offset`` and both
    tokens belong to the same document (the mask of :func:`reference_attention`).

    Built with ``BlockMask.from_kv_blocks`` from :func:`flex_block_tiles`, not with
    ``create_block_mask`` (which, called eagerly, evaluates the mask on a dense int64 [B, 1, Tq,
    Tk] tensor: 32 GiB per row at T = 65,536). What it allocates is O(T) for the document bounds
    plus a block-level term of a few ``[B, 1, Tq/128, Tk/128]`` int32/int64 tensors (the tiles,
    their ordered indices and the transposed q-side indices FlexAttention's backward reads):
    a peak of 7.5 MiB per row at T = 65,536, growing 4x per doubling of T (tests/test_flex_memory.py
    prints it)."""
    key = (id(doc_BT), None if doc_BT is None else doc_BT._version, B, Tq, Tk, q_offset, str(device))
    if _block_mask_cache and _block_mask_cache[0][0] == key:
        return _block_mask_cache[0][2]
    bm = build_block_mask(doc_BT, B, Tq, Tk, q_offset, device)
    _block_mask_cache[:] = [(key, doc_BT, bm)]
    return bm


def build_block_mask(doc_BT, B: int, Tq: int, Tk: int, q_offset: int, device, doc_q_BT=None, offset_t=None):
    """:func:`flex_block_mask` without its cache; ``doc_q_BT`` as in :func:`flex_block_tiles`.
    ``offset_t``: ``q_offset`` as a 0-dim device tensor for the mask function (a compiled kernel
    then takes it as an input instead of recompiling for every offset)."""
    BlockMask = _flex_functions()[2]
    off = q_offset if offset_t is None else offset_t
    if doc_BT is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + off
    else:
        doc_q = doc_BT[:, q_offset:q_offset + Tq] if doc_q_BT is None else doc_q_BT

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + off) & (doc_q[b, q_idx] == doc_BT[b, kv_idx])
    partial, full = flex_block_tiles(doc_BT, B, Tq, Tk, q_offset, device, doc_q_BT=doc_q_BT)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(Tq, Tk))


def flex_document_attention(q_BHTK, k_BHTK, v_BHTV, scale: float, doc_ids_BT: Optional[torch.Tensor] = None,
                            q_offset: int = 0, compiled: bool = True) -> torch.Tensor:
    """Causal same-document attention by FlexAttention, the GPU form of :func:`chunked_attention`
    with the same arguments: the compiled kernel computes scores tile by tile and skips masked
    tiles, so no [Tq, Tk] tensor exists; the block mask is block-level ([B, 1, Tq/128, Tk/128],
    :func:`flex_block_mask`). ``compiled=False`` runs torch's eager FlexAttention (dense scores:
    for testing the mask on CPU, where torch 2.13's FlexAttention has no backward). Inputs keep
    their dtype (bf16 under autocast); the kernel's softmax statistics are fp32."""
    compiled_fn, eager_fn, _ = _flex_functions()
    B, _, Tq, _ = q_BHTK.shape
    doc = None if doc_ids_BT is None else doc_ids_BT.to(q_BHTK.device)
    bm = flex_block_mask(doc, B, Tq, k_BHTK.shape[2], q_offset, q_BHTK.device)
    return (compiled_fn if compiled else eager_fn)(q_BHTK, k_BHTK, v_BHTV, block_mask=bm, scale=scale)


def _flex_device(q: torch.Tensor) -> bool:
    """Whether ``attention`` sends documents / offsets to FlexAttention on q's device (CUDA)."""
    return q.is_cuda


def _flex_probe(q, k, v, scale: float, doc, q_offset: int) -> bool:
    """Run FlexAttention forward *and* backward once per call signature, on detached copies of the
    real inputs (so the compiled kernels the real call uses are the ones tried). On any exception:
    warn once, set ``_flex_failed`` and return False, so this call and every later one take
    ``chunked_attention`` for forward and backward alike; the real calls are never wrapped in a
    try (a failure that the probe did not see raises). The probe's saved tensors go through
    identity hooks, so inside an activation checkpoint the recomputation sees the same saved
    tensors as the forward."""
    global _flex_failed
    sig = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, str(q.device), doc is None, q_offset)
    if sig in _flex_probed:
        return True
    try:   # identity saved-tensor hooks: an enclosing activation checkpoint neither sees nor stores the probe
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            ins = [x.detach().requires_grad_() for x in (q, k, v)]
            o = flex_document_attention(*ins, scale, doc, q_offset)
            torch.autograd.grad(o, ins, torch.ones_like(o))
    except Exception as e:  # noqa: BLE001 - fall back to the chunked path for good
        _flex_failed = True
        warnings.warn(f"FlexAttention failed ({type(e).__name__}: {e}); using chunked_attention "
                      "for forward and backward")
        return False
    _flex_probed[sig] = True
    return True


def attention(q_BHTK, k_BHTK, v_BHTV, scale: float, doc_ids_BT: Optional[torch.Tensor] = None,
              q_chunk: int = DEFAULT_Q_CHUNK, k_chunk: int = DEFAULT_K_CHUNK, q_offset: int = 0) -> torch.Tensor:
    """Causal same-document attention: SDPA without documents or offset, FlexAttention on CUDA with
    them, ``chunked_attention`` elsewhere.

    Shapes in the module docstring; ``doc_ids_BT=None`` means one document per row. Chunk sizes apply
    to the chunked path only. A query offset (a CP rank's segment against the gathered keys) goes to
    FlexAttention on CUDA (its mask is offset like :func:`reference_attention`'s) and to the chunked
    path elsewhere (SDPA's ``is_causal`` aligns its mask top-left, so it cannot serve offsets).
    """
    _check(q_BHTK, k_BHTK, v_BHTV, doc_ids_BT, q_offset)
    offset = q_offset or q_BHTK.shape[2] != k_BHTK.shape[2]
    if doc_ids_BT is None and not offset:
        return F.scaled_dot_product_attention(q_BHTK, k_BHTK, v_BHTV, is_causal=True, scale=scale)
    if _flex_device(q_BHTK) and not _flex_failed and _flex_functions() is not None:
        doc = None if doc_ids_BT is None else doc_ids_BT.to(q_BHTK.device)
        if _flex_probe(q_BHTK, k_BHTK, v_BHTV, scale, doc, q_offset):
            return flex_document_attention(q_BHTK, k_BHTK, v_BHTV, scale, doc, q_offset)
    return chunked_attention(q_BHTK, k_BHTK, v_BHTV, scale, doc_ids_BT, q_chunk, k_chunk, q_offset)
