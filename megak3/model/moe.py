"""Stable LatentMoE (K3_SPEC.md §7.1, §14 ``latent_moe``; NEMO ``KimiK3MoE``).

    route on full-width x:   w_TK, idx_TK, s_TE = Router(x_TD)
    z_TL  = routed_expert_down_proj(x_TD)                       D -> L (= D/2)
    u_TL  = sum_k w_TK * E_{idx_TK}(z_TL)                        SiTU-GLU experts L -> m -> L
    y_TD  = routed_expert_up_proj(RMSNorm_L(u_TL)) + shared_experts(x_TD)

Shape legend: T tokens, D model width, L latent width, E experts, K top-k slots, X = T*K routed
rows (one per (token, slot) pair), m expert width. The router weight multiplies each expert output
*after* the expert's down-projection, in fp32 (NEMO ``apply_router_weight_after_down``). There is
no auxiliary loss: balance comes from the router bias, updated by Quantile Balancing.

``permute`` / ``GroupedExperts`` / ``unpermute`` are independent of routing so expert parallelism
(moonep/) can put a dispatch between ``permute`` and the experts and a combine before ``unpermute``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megak3.config import ModelConfig
from megak3.ops.cuda_rules import GROUPED_MM_MAX_GROUPS
from megak3.ops.situ import situ_glu
from megak3.ops.weight_grad import active_store, deferred_grouped_linear

from .ffn import SiTUGLUMLP
from .norm import RMSNorm
from .router import Router


@dataclass
class MoEStats:
    """Router statistics of one LatentMoE call, consumed by Quantile Balancing and logging."""

    scores_TE: torch.Tensor
    """sigmoid router scores, fp32, detached"""
    tokens_per_expert_E: torch.Tensor
    """int64 number of (token, slot) selections per expert"""


# ---- routing-independent helpers (reused by expert parallelism) ------------------------------

def permute(indices_TK: torch.Tensor, num_experts: int):
    """Sort the T*K (token, slot) pairs by expert.

    Returns ``order_X`` (int64: row r of the sorted layout is flat pair ``order_X[r]`` = t*K + k),
    ``token_of_row_X`` (int64 token id of each sorted row) and ``tokens_per_expert_E`` (int64).
    The argsort is stable, so rows of one expert keep token order (deterministic layout).
    """
    if indices_TK.dim() != 2:
        raise ValueError(f"permute: indices must be [T, K], got {tuple(indices_TK.shape)}")
    flat_X = indices_TK.reshape(-1)
    order_X = torch.argsort(flat_X, stable=True)
    token_of_row_X = order_X // indices_TK.shape[1]
    tokens_per_expert_E = count_per_expert(flat_X, num_experts)
    return order_X, token_of_row_X, tokens_per_expert_E


def unpermute(y_sorted_XL: torch.Tensor, order_X: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """u_TL = sum_k weights_TK[t, k] * (row of pair (t, k)), in fp32 (at least); inverse of ``permute``.

    Rows are put back in (token, slot) order and reduced over K with a fixed-order sum instead of
    an index_add: the result is then bitwise reproducible on GPUs, where index_add uses atomics.
    """
    T, K = weights_TK.shape
    assert y_sorted_XL.shape[0] == order_X.numel() == T * K, "one sorted row per (token, slot) pair"
    inverse_X = torch.empty_like(order_X)
    inverse_X[order_X] = torch.arange(order_X.numel(), device=order_X.device)
    dt = torch.promote_types(weights_TK.dtype, torch.float32)
    rows_TKL = y_sorted_XL[inverse_X].to(dt).view(T, K, y_sorted_XL.shape[1])
    return (rows_TKL * weights_TK.to(dt).unsqueeze(-1)).sum(1)


# ---- experts ---------------------------------------------------------------------------------
#
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


def count_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [num_experts] selections per expert: a fixed-length scatter-add (``bincount`` sizes its
    output from the data, which is a host sync on CUDA)."""
    flat = indices.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64))


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


class GroupedExperts(nn.Module):
    """E SiTU-GLU experts applied to rows already sorted by expert.

    Parameters (stacked like nn.Linear weights, out x in): ``w1`` [E, m, L] gate, ``w3`` [E, m, L]
    up, ``w2`` [E, L, m] down. ``forward(z_sorted_XL, tokens_per_expert_E) -> y_XL``, where expert e
    gets the contiguous rows ``offsets[e-1]:offsets[e]``; y has z's dtype.

    Quantization-aware training hooks (megak3/quant/qat.py sets them; None = full precision):
    ``weight_quant(w) -> w_q`` is applied to w1, w3, w2 on every forward (masters stay high precision)
    and ``act_quant(a) -> a_q`` to both GEMM inputs (z rows and the SiTU-GLU hidden). Both see
    tensors whose last dim is the GEMM's reduction dim. They live on this module so quantization
    happens wherever the expert weights live (also under expert parallelism).
    """

    def __init__(self, num_experts: int, latent_size: int, intermediate_size: int,
                 beta1: float = 4.0, beta2: float = 25.0):
        super().__init__()
        self.num_experts = num_experts
        self.beta1, self.beta2 = float(beta1), float(beta2)
        self.use_grouped_mm: bool | str | None = None
        """GEMM implementation: None = automatic, or 'grouped_mm' | 'tiled' | 'loop' (see grouped_linear)"""
        self.weight_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate_size, latent_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate_size, latent_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, latent_size, intermediate_size))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, z_sorted_XL: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        L = self.w1.shape[2]
        if z_sorted_XL.dim() != 2 or z_sorted_XL.shape[1] != L:
            raise ValueError(f"GroupedExperts: rows must be [X, latent_size={L}], got {tuple(z_sorted_XL.shape)}")
        if tokens_per_expert_E.shape != (self.num_experts,):
            raise ValueError(f"GroupedExperts: tokens_per_expert must be [{self.num_experts}], "
                             f"got {tuple(tokens_per_expert_E.shape)}")
        return self.compute(self.w1, self.w3, self.w2, z_sorted_XL, tokens_per_expert_E)

    def compute(self, w1_GmL, w3_GmL, w2_GLm, z_sorted_XL, rows_per_group_G) -> torch.Tensor:
        """The expert math on explicit stacked weights (G groups of rows, e.g. home experts plus
        MoonEP replica slots), with this module's SiTU-GLU betas and QAT hooks."""
        gmm = self.use_grouped_mm
        w1, w3, w2 = w1_GmL, w3_GmL, w2_GLm
        if self.weight_quant is not None:
            w1, w3, w2 = self.weight_quant(w1), self.weight_quant(w3), self.weight_quant(w2)
        if self.act_quant is not None:
            z_sorted_XL = self.act_quant(z_sorted_XL)
        gate_Xm = grouped_linear(z_sorted_XL, w1, rows_per_group_G, gmm)
        up_Xm = grouped_linear(z_sorted_XL, w3, rows_per_group_G, gmm)
        h_Xm = situ_glu(gate_Xm, up_Xm, self.beta1, self.beta2)
        if self.act_quant is not None:
            h_Xm = self.act_quant(h_Xm)
        return grouped_linear(h_Xm, w2, rows_per_group_G, gmm)

    def extra_repr(self) -> str:
        E, m, L = self.w1.shape
        q = "" if self.weight_quant is None and self.act_quant is None else \
            f", weight_quant={self.weight_quant}, act_quant={self.act_quant}"
        return f"experts={E}, latent={L}, intermediate={m}, beta1={self.beta1}, beta2={self.beta2}{q}"


# ---- the layer -------------------------------------------------------------------------------

class LatentMoE(nn.Module):
    """Stable LatentMoE block: ``forward(x_TD) -> (y_TD, MoEStats)``; x must be 2-D [T, D]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        moe = cfg.moe
        D, L, m = cfg.hidden_size, moe.latent_size, moe.expert_intermediate_size
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.gate = Router(D, moe.num_experts, moe.top_k, moe.routed_scaling_factor)
        self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
        self.experts = GroupedExperts(moe.num_experts, L, m, cfg.situ_beta1, cfg.situ_beta2)
        self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps) if moe.use_latent_norm else None
        self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
        self.shared_experts = (SiTUGLUMLP(D, moe.num_shared_experts * m, cfg.situ_beta1, cfg.situ_beta2)
                               if moe.num_shared_experts > 0 else None)
        # Expert parallelism hook (moonep/, installed by parallel/expert_parallel.py): when set,
        # ``u_TL = expert_dispatch(z_TL, route, self.experts)`` replaces permute -> experts -> unpermute;
        # a dispatcher with ``overlaps = True`` also takes ``overlap=`` (the shared experts) and
        # returns ``(u_TL, overlap())``, running it while its own communication is in flight.
        self.expert_dispatch: Callable | None = None

    def forward(self, x_TD: torch.Tensor):
        route = self.gate(x_TD)                                   # validates x is [T, D]
        z_TL = self.routed_expert_down_proj(x_TD)
        shared_TD = None
        if self.expert_dispatch is not None:
            if self.shared_experts is not None and getattr(self.expert_dispatch, "overlaps", False):
                # the dispatcher runs the shared experts while its replica-weight fetch is in flight
                u_TL, shared_TD = self.expert_dispatch(z_TL, route, self.experts,
                                                       overlap=lambda: self.shared_experts(x_TD))
            else:
                u_TL = self.expert_dispatch(z_TL, route, self.experts)
            u_TL = u_TL.to(x_TD.dtype)
            tokens_per_expert_E = count_per_expert(route.indices_TK, self.num_experts)
        else:
            order_X, token_of_row_X, tokens_per_expert_E = permute(route.indices_TK, self.num_experts)
            y_sorted_XL = self.experts(z_TL[token_of_row_X], tokens_per_expert_E)
            u_TL = unpermute(y_sorted_XL, order_X, route.weights_TK).to(x_TD.dtype)
        if self.routed_expert_norm is not None:
            u_TL = self.routed_expert_norm(u_TL)
        y_TD = self.routed_expert_up_proj(u_TL)
        if self.shared_experts is not None:
            y_TD = y_TD + (self.shared_experts(x_TD) if shared_TD is None else shared_TD)
        return y_TD, MoEStats(route.scores_TE.detach(), tokens_per_expert_E)
