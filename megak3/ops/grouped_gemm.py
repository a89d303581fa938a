"""Grouped GEMMs: per-group ``x @ w[g]^T`` on rows sorted by group (the routed experts' GEMMs,
megak3.model.moe.GroupedExperts and moonep's expert slots) and their weight gradient.

    y_XO = grouped_linear(x_XI, w_EOI, tokens_per_expert_E)         # impl picked per call
    dW_EOI = grouped_weight_grad(x_XI, g_XO, tokens_per_expert_E, E)  # the deferred W of zero-bubble

Inside a ``megak3.ops.weight_grad.WeightGradStore.capture()`` a trainable grouped GEMM defers its
weight gradient to the store (:func:`deferred_grouped_linear`); this module imports weight_grad,
never the other way round.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .cuda_rules import GROUPED_MM_MAX_GROUPS
from .weight_grad import WeightRef, active_store

# Three implementations of one grouped GEMM (rows sorted by group, group g uses w[g]):
#
#   "grouped_mm"  torch's grouped GEMM (F.grouped_mm). On CUDA only its bf16 CUTLASS kernel (sm90 /
#                 sm100) is sync-free; its CUDA fallback for other dtypes reads the offsets on the
#                 host (offs.cpu()), so it is used on CUDA only for bf16 (the autocast compute dtype)
#                 on those GPUs. On CPU it runs fp32/bf16/fp16 (no device, so no sync).
#   "tiled"       a fixed-shape twin for everything else (fp64, CUDA fp32 without autocast, older
#                 GPUs): each group's rows are padded to tiles of t = ceil(X/G) rows, the tiles are
#                 one ``torch.bmm`` against the gathered weight of each tile. Shapes depend only on
#                 (X, G): at most X/t + G <= 2G tiles, so it costs at most 2x the FLOPs of the
#                 grouped GEMM plus a transient gather of <= 2G weight matrices, and no host sync.
#                 (On CUDA the weight gradient of the gather is an index_add: not bitwise
#                 reproducible there; the grouped_mm path is.)
#   "loop"        the reference twin: one GEMM per non-empty group, sizes read with ``.tolist()``
#                 (a host sync), kept for tests and for forcing an obviously-correct path.
#
# Under autocast both operands are cast to the autocast dtype first (as autocast does for
# ``matmul``), so fp32 masters train through the bf16 grouped GEMM: the cast is the only copy.

IMPLS = ("grouped_mm", "tiled", "loop")


def _compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.dtype.is_floating_point and x.dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, w.dtype)


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs these operands without a host sync (see the note above)
    and within CUDA's group limit (megak3/ops/cuda_rules.py; also applied on CPU, so CPU runs take
    the path a GPU would)."""
    if not hasattr(F, "grouped_mm") or x.shape[0] == 0:  # grouped_mm's backward rejects empty grads
        return False
    if w.shape[0] > GROUPED_MM_MAX_GROUPS:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return (x.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0  # 16-byte aligned rows for CUTLASS
            and torch.cuda.get_device_capability(x.device)[0] in (9, 10))


def pick_impl(x: torch.Tensor, w: torch.Tensor, impl=None) -> str:
    """Resolve ``impl``: None/'auto' -> 'grouped_mm' where sync-free, else 'tiled'; True ->
    'grouped_mm', False -> 'loop' (the old boolean switch); a name is kept. 'grouped_mm' (or True)
    with more than GROUPED_MM_MAX_GROUPS groups (w [G, O, I]) is a ValueError: CUDA's kernel
    refuses it (the MoonEP config check, moonep/config.py, keeps training layouts below it)."""
    if impl is None or impl == "auto":
        return "grouped_mm" if _grouped_mm_ok(x, w) else "tiled"
    if (impl is True or impl == "grouped_mm") and w.shape[0] > GROUPED_MM_MAX_GROUPS:
        raise ValueError(f"grouped_linear: impl=grouped_mm with {w.shape[0]} groups; CUDA's grouped GEMM takes at "
                         f"most {GROUPED_MM_MAX_GROUPS}: use impl='tiled' or fewer experts per rank")
    if impl is True:
        return "grouped_mm" if x.shape[0] > 0 else "tiled"
    if impl is False:
        return "loop"
    if impl not in IMPLS:
        raise ValueError(f"grouped_linear: impl={impl!r}; choose one of auto, {', '.join(IMPLS)}")
    return "tiled" if impl == "grouped_mm" and x.shape[0] == 0 else impl


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward
    rejects expanded gradients such as the one produced by ``y.sum().backward()``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _tile_layout(X: int, G: int, rows_G: torch.Tensor, dev):
    """The fixed-shape tile layout of "tiled": (t rows per tile, n tiles, dest_X = each row's slot
    in the padded [n * t] layout, group_N = each tile's group). Shapes depend only on (X, G)."""
    t = max(1, -(-X // G))                       # tile rows
    n = (X + G * (t - 1)) // t                   # >= sum_g ceil(rows_g / t): enough tiles
    rows_G = rows_G.to(device=dev, dtype=torch.int64)
    tiles_G = (rows_G + (t - 1)) // t
    tile_end_G = tiles_G.cumsum(0)
    group_X = torch.repeat_interleave(torch.arange(G, device=dev), rows_G, output_size=X)
    pos_X = torch.arange(X, device=dev) - (rows_G.cumsum(0) - rows_G)[group_X]
    dest_X = (tile_end_G - tiles_G)[group_X] * t + pos_X        # row slot in the padded tile layout
    group_N = torch.searchsorted(tile_end_G, torch.arange(n, device=dev), right=True).clamp_(max=G - 1)
    return t, n, dest_X, group_N


def _tiled_grouped_linear(x_XI: torch.Tensor, w_GOI: torch.Tensor, rows_G: torch.Tensor) -> torch.Tensor:
    """Fixed-shape grouped GEMM: group-aligned tiles of t rows through one bmm (see the note above)."""
    X, I = x_XI.shape
    G, O = w_GOI.shape[0], w_GOI.shape[1]
    t, n, dest_X, group_N = _tile_layout(X, G, rows_G, x_XI.device)
    x_pad = x_XI.new_zeros((n * t, I)).index_copy(0, dest_X, x_XI)
    y_NtO = torch.bmm(x_pad.view(n, t, I), w_GOI.index_select(0, group_N).transpose(1, 2))
    return y_NtO.reshape(n * t, O).index_select(0, dest_X)


def _strides_ok(*mats: torch.Tensor) -> bool:
    """grouped_mm's operand rule for 2-D operands: row- or column-major, the leading stride a
    multiple of 16 bytes."""
    def ok(m):
        (r, c), (sr, sc) = m.shape, m.stride()
        lead = sr if sc == 1 and sr >= max(1, c) else sc if sr == 1 and sc >= max(1, r) else 0
        return lead > 0 and lead * m.element_size() % 16 == 0
    return all(ok(m) for m in mats)


def grouped_weight_grad(x_XI: torch.Tensor, g_XO: torch.Tensor, rows_G: torch.Tensor, G: int,
                        use_grouped_mm=None) -> torch.Tensor:
    """dW [G, O, I] of :func:`grouped_linear`: ``dW[e] = g_e^T x_e`` over each group's rows, in the
    operands' dtype, without a host sync (the deferred W of zero-bubble pipelines,
    megak3/ops/weight_grad.py). 'grouped_mm': one grouped GEMM with the row offsets splitting the
    contraction dim; 'tiled': the tile layout of the forward, one bmm ``[n, O, t] @ [n, t, I]`` and
    an ``index_add`` of the tiles into their groups; 'loop': one GEMM per group (``.tolist()``)."""
    X, I, O = x_XI.shape[0], x_XI.shape[1], g_XO.shape[1]
    x_XI, g_XO = x_XI.contiguous(), g_XO.contiguous()   # expanded gradients (y.sum()) have stride 0
    impl = pick_impl(x_XI, x_XI.new_empty((G, O, I)), use_grouped_mm)
    a_OX = g_XO.transpose(0, 1)
    if impl == "grouped_mm" and _strides_ok(a_OX, x_XI):
        offs_G = rows_G.cumsum(0).to(torch.int32)
        with torch.autocast(x_XI.device.type, enabled=False):
            return F.grouped_mm(a_OX, x_XI, offs=offs_G)
    if impl == "loop":
        gw = x_XI.new_zeros((G, O, I))
        off = 0
        for e, n in enumerate(rows_G.tolist()):
            if n:
                gw[e] = g_XO[off:off + n].T @ x_XI[off:off + n]
            off += n
        return gw
    t, n, dest_X, group_N = _tile_layout(X, G, rows_G, x_XI.device)
    x_pad = x_XI.new_zeros((n * t, I)).index_copy(0, dest_X, x_XI).view(n, t, I)
    g_pad = g_XO.new_zeros((n * t, O)).index_copy(0, dest_X, g_XO).view(n, t, O)
    return x_XI.new_zeros((G, O, I)).index_add_(0, group_N, torch.bmm(g_pad.transpose(1, 2), x_pad))


def _loop_grouped_linear(x_XI: torch.Tensor, w_GOI: torch.Tensor, rows_G: torch.Tensor) -> torch.Tensor:
    """The reference twin: one GEMM per non-empty group (``.tolist()``: a host sync)."""
    counts = rows_G.tolist()
    assert sum(counts) == x_XI.shape[0], "tokens_per_expert must sum to the number of rows"
    outs = [chunk @ w_GOI[e].T for e, chunk in enumerate(torch.split(x_XI, counts)) if counts[e] > 0]
    if not outs:  # no rows at all: keep the weights in the graph (zero grads, not None)
        return x_XI @ w_GOI[0].T
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def grouped_linear(x_XI: torch.Tensor, w_EOI: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                   use_grouped_mm=None) -> torch.Tensor:
    """Per-group x @ w[e]^T on contiguous row groups: x_XI [X, I], w_EOI [E, O, I] -> [X, O].

    Rows ``offsets[e-1]:offsets[e]`` (offsets = cumsum of tokens_per_expert_E) use expert e.
    ``use_grouped_mm``: None/'auto' (grouped_mm where it is sync-free, else 'tiled'), 'grouped_mm',
    'tiled', 'loop', or the old booleans (True = grouped_mm, False = loop); see the note above.
    The result has the compute dtype (the autocast dtype under autocast, else x's).
    """
    store = active_store()  # zero-bubble pipelines defer the weight gradient (megak3/ops/weight_grad.py)
    if store is not None and w_EOI.requires_grad and x_XI.requires_grad and torch.is_grad_enabled():
        return deferred_grouped_linear(store, x_XI, w_EOI, tokens_per_expert_E, use_grouped_mm)
    dt = _compute_dtype(x_XI, w_EOI)
    x_XI, w_EOI = x_XI.to(dt), w_EOI.to(dt)
    impl = pick_impl(x_XI, w_EOI, use_grouped_mm)
    if impl == "loop":
        return _loop_grouped_linear(x_XI, w_EOI, tokens_per_expert_E)
    if impl == "tiled":
        return _tiled_grouped_linear(x_XI, w_EOI, tokens_per_expert_E)
    offs_E = tokens_per_expert_E.cumsum(0).to(torch.int32)
    with torch.autocast(x_XI.device.type, enabled=False):  # operands already in the compute dtype
        return _ContiguousGrad.apply(F.grouped_mm(x_XI, w_EOI.transpose(-2, -1), offs=offs_E))


class _DeferredGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_XI, counts, store, use_grouped_mm, weight: WeightRef):
        ctx.save_for_backward(x_XI, counts)
        ctx.store, ctx.gmm, ctx.weight = store, use_grouped_mm, weight.w
        y = grouped_linear(x_XI, weight.w.detach(), counts, use_grouped_mm)
        ctx.dt = y.dtype
        return y

    @staticmethod
    def backward(ctx, g_XO):
        x_XI, counts = ctx.saved_tensors
        w = ctx.weight
        gx = None
        if ctx.needs_input_grad[0]:  # g_e @ w_e = g_e @ (w_e^T)^T
            gx = grouped_linear(g_XO.contiguous(), w.detach().transpose(-2, -1).contiguous().to(g_XO.dtype),
                                counts, ctx.gmm)
        ctx.store.defer_gemm(w, x_XI, g_XO, _grouped_dw(counts, ctx.gmm, ctx.dt))
        ctx.weight = None
        return gx, None, None, None, None


def _grouped_dw(counts, impl, dt):
    """The W of one deferred grouped GEMM: dW = grouped_weight_grad formed in the forward's compute
    dtype ``dt`` (bf16 under autocast, as autograd's dW of grouped_mm; None: the weight's dtype),
    returned in the weight's dtype."""
    def dw(w, x_XI, g_XO):
        d = dt or w.dtype
        return grouped_weight_grad(x_XI.to(d), g_XO.to(d), counts, w.shape[0], impl).to(w.dtype)
    return dw


def deferred_grouped_linear(store, x_XI, w_EOI, tokens_per_expert_E, use_grouped_mm):
    """``grouped_linear`` whose weight gradient waits for ``store.flush`` (no host sync: the counts
    stay a device tensor, dW is :func:`grouped_weight_grad`)."""
    return _DeferredGroupedLinear.apply(x_XI, tokens_per_expert_E, store, use_grouped_mm, WeightRef(w_EOI))
