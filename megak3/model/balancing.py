"""Quantile Balancing (QB): K3's router-bias update, no auxiliary loss (K3_SPEC.md §7.3, REPORT Eq.13-14).

Shapes: m tokens (``T``), n experts (``E``), top-k ``k``; scores s in (0,1)^{m x n}; bias b [n]
(used only in the top-k selection). The target load is q = floor(m*k/n) tokens per expert.

    Eq.14   alpha_i = (k+1)-th largest of (s_i + b)              per-token cutoff
            margin_ij = s_ij - alpha_i
            b^_j    = -((q+1)-th largest of {margin_ij}_i)         per-expert quantile 1 - k/n
            b_new   = b^ - mean(b^)                                 a common offset changes no top-k

Why it balances: under b_new (before centring) token i picks j iff s_ij + b^_j > alpha_i, i.e. iff
margin_ij > -b^_j, and exactly q margins of column j lie above -b^_j. Iterating converges because
alpha moves as the bias moves (App C Alg.1 alternates the two duals of the assignment LP).
Fixed point: if expert j already holds q tokens under b, the q selected margins are > -b_j and the
rest are <= -b_j, so b^_j = b_j whenever j is some unselected token's (k+1)-th choice (that token's
margin is exactly -b_j); otherwise b^_j lands in the gap that keeps the same assignment.
Ties: at such a fixed point the cutoff token scores exactly alpha_i for two experts (the LP
optimum would split it fractionally), so top-k tie-breaking can leave an expert a token or so off
q; in small batches iterating may also stop at such a tie short of perfect balance.

For the global batch of a data-parallel step the exact quantile over millions of margins is
replaced by a histogram whose per-bin counts are all-reduced (:class:`QBAccumulator`);
:func:`resolve_qb_method` picks one of the two for ``model.moe.qb_method=auto``.
"""
from __future__ import annotations

from typing import Optional

import torch

__all__ = ["qb_update", "qb_alternating", "QBAccumulator", "max_violation", "token_margins", "resolve_qb_method",
           "QB_EXACT_MAX_BYTES", "QB_METHODS"]

QB_METHODS = ("auto", "exact", "histogram")
"""values of model.moe.qb_method"""
QB_EXACT_MAX_BYTES = 64 << 20
"""auto: exact QB while one layer's gathered fp32 margins (tokens_per_step x E x 4 B) fit in 64 MiB, a
small slice of accelerator memory that gathers in milliseconds; above it the [E, bins] histogram
(E x 4096 x 8 B = 28 MiB at E=896) costs less and stays within a bin width of exact"""


def resolve_qb_method(method: str, tokens_per_step: int, num_experts: int) -> str:
    """'exact' or 'histogram' for ``model.moe.qb_method`` (``auto``: exact unless the margins that
    exact QB gathers per MoE layer, tokens_per_step x num_experts x 4 bytes, exceed QB_EXACT_MAX_BYTES).

    tokens_per_step: tokens of one optimizer step over all data-parallel ranks (global batch x seq_len).
    """
    if method not in QB_METHODS:
        raise ValueError(f"model.moe.qb_method={method!r}: choose one of {', '.join(QB_METHODS)}")
    if method != "auto":
        return method
    return "histogram" if int(tokens_per_step) * int(num_experts) * 4 > QB_EXACT_MAX_BYTES else "exact"


def _target_rank(num_tokens: int, num_experts: int, top_k: int) -> int:
    """q + 1 with q = floor(m*k/n), clamped to [1, m].

    With k < n, q <= m - 1 always holds; the clamp only matters for k >= n (every expert takes
    every token), where the "(q+1)-th largest" does not exist and the smallest margin is used.
    """
    q = (num_tokens * top_k) // num_experts
    return max(1, min(q + 1, num_tokens))


def _check(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> None:
    if scores_TE.dim() != 2:
        raise ValueError(f"scores_TE must be [tokens, experts], got {tuple(scores_TE.shape)}")
    n = scores_TE.shape[1]
    if bias_E.shape != (n,):
        raise ValueError(f"bias_E must be [{n}] (one entry per expert), got {tuple(bias_E.shape)}")
    if not 1 <= top_k < n:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={n}): QB needs a (k+1)-th expert per token")


@torch.no_grad()
def token_margins(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """margin_TE = s - alpha_T, alpha = (k+1)-th largest of s + b per token; fp32 (fp64 stays fp64)."""
    _check(scores_TE, bias_E, top_k)
    dt = torch.promote_types(scores_TE.dtype, torch.float32)
    s_TE = scores_TE.to(dt)
    alpha_T1 = (s_TE + bias_E.to(device=s_TE.device, dtype=dt)).topk(top_k + 1, dim=1).values[:, -1:]
    return s_TE - alpha_T1


@torch.no_grad()
def qb_update(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """One Eq.14 step on a batch: returns the new mean-centred bias [E] (fp32 or the scores' fp64).

    With no tokens there is nothing to measure and ``bias_E`` is returned unchanged (a copy).
    """
    _check(scores_TE, bias_E, top_k)
    m, n = scores_TE.shape
    if m == 0:
        return bias_E.clone()
    margin_TE = token_margins(scores_TE, bias_E, top_k)
    rank = _target_rank(m, n, top_k)
    b_hat_E = -margin_TE.topk(rank, dim=0).values[-1]
    return b_hat_E - b_hat_E.mean()


@torch.no_grad()
def qb_alternating(scores_TE: torch.Tensor, top_k: int, iters: int) -> torch.Tensor:
    """App C Alg.1: alternate the token dual alpha and the expert dual beta ``iters`` times from beta=0.

        alpha = sort_desc(s - beta, dim=1)[:, k];  beta = sort_desc(s - alpha, dim=0)[q]

    Returns the bias b = -beta, mean-centred (selection is then topk(s + b)).
    """
    if iters < 1:
        raise ValueError(f"qb_alternating: iters={iters} must be >= 1")
    m, n = scores_TE.shape
    bias_E = torch.zeros(n, dtype=torch.promote_types(scores_TE.dtype, torch.float32), device=scores_TE.device)
    for _ in range(iters):
        # one alternation is exactly one Eq.14 step with b = -beta; centring b by c shifts alpha and
        # hence the next b^ by the same constant c, which the next centring removes again
        bias_E = qb_update(scores_TE, bias_E, top_k)
    return bias_E


def max_violation(tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """max_e load_e / mean(load) - 1 as a 0-dim fp32 tensor (0 for a perfectly balanced or empty batch)."""
    load_E = tokens_per_expert_E.float()
    if load_E.numel() == 0:
        return load_E.new_zeros(())
    mean = load_E.mean()  # no host sync: an all-zero load maps to 0 through the where
    return torch.where(mean > 0, load_E.max() / mean.clamp_min(1e-30) - 1.0, torch.zeros_like(mean))


class QBAccumulator:
    """Collects QB margins over the micro-batches of one optimizer step, then solves Eq.14 once.

    ``add(scores_TE, bias_E)`` per micro-batch (margins use the bias that routed that micro-batch,
    which is the same for a whole step), ``solve(bias_E)`` at the step end, ``reset()`` after it.
    The state lives on the device of the scores (``device``, or the first ``add``'s); ``reset``
    keeps it there.

    method='exact': keeps every margin; ``solve`` is Eq.14 on the concatenated batch (accumulating
      micro-batches equals one concatenated batch). Its state has a data-dependent size: across
      ranks it is all-gathered (parallel.moe_stats.reduce_balancer), tokens_per_step x E x 4 bytes.
    method='histogram': per-expert counts over ``bins`` equal bins of [lo, hi) (``counts`` [E, bins]
      int64, ``token_count`` [1] int64); ``state_tensors()`` lists the tensors a data-parallel layer
      sums across ranks before ``solve``. The per-expert quantile is located in the bin where the
      count from the top reaches q+1 and interpolated linearly inside it, so it is within one bin
      width (hi-lo)/bins of the exact value whenever that quantile lies in [lo, hi); margins outside
      are clamped into the outer bins (the counts from the top stay right for every inner bin).
      Range: by default it follows the step's bias, lo = -1 - max(b), hi = 1 - min(b), which holds
      every margin s - alpha of scores s in [0, 1] (alpha is the (k+1)-th largest s + b), so nothing
      is clamped however far |b| grows; bins are (2 + max b - min b)/bins wide. The bias is the
      same on every rank, and so is the range. It is fixed by the first ``add`` after a reset (or by
      ``solve``'s bias when this rank added nothing). Explicit ``lo``/``hi`` give a fixed range:
      [-1, 1) has 1.1-1.3x finer bins on k3_tiny's routers (tools/qb_deviation.py: no margin
      outside it there), but a quantile beyond it (|b| near 1 or more) lands in the edge bin.
      ``solve`` does not synchronise with the host.
    """

    def __init__(self, num_experts: int, top_k: int, method: str = "exact", bins: int = 4096,
                 lo: Optional[float] = None, hi: Optional[float] = None, device=None):
        if method not in ("exact", "histogram"):
            hint = (" ('auto' is resolved by resolve_qb_method(method, tokens_per_step, num_experts) first)"
                    if method == "auto" else "")
            raise ValueError(f"QBAccumulator: method={method!r}: choose 'exact' or 'histogram' "
                             f"(model.moe.qb_method){hint}")
        if not 1 <= top_k < num_experts:
            raise ValueError(f"QBAccumulator: top_k={top_k} must lie in [1, num_experts={num_experts})")
        if (lo is None) != (hi is None):
            raise ValueError(f"QBAccumulator: give both lo and hi (a fixed range) or neither (the range "
                             f"follows the bias), got lo={lo}, hi={hi}")
        if bins < 1 or (lo is not None and not hi > lo):
            raise ValueError(f"QBAccumulator: need bins >= 1 and hi > lo, got bins={bins}, lo={lo}, hi={hi}")
        self.num_experts, self.top_k, self.method = num_experts, top_k, method
        self.bins = int(bins)
        self.fixed_range = lo is not None
        self.lo = float(lo) if self.fixed_range else None
        self.hi = float(hi) if self.fixed_range else None
        self.bin_width = (self.hi - self.lo) / self.bins if self.fixed_range else None
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self.reset()

    @property
    def device(self) -> torch.device:
        """Where the state lives (and every tensor reduce_balancer communicates)."""
        return self._device

    def reset(self) -> None:
        """Forget everything added so far (call after each ``solve``); the state stays on ``device``."""
        self._margins: list[torch.Tensor] = []
        self.counts = torch.zeros(self.num_experts, self.bins if self.method == "histogram" else 0,
                                  dtype=torch.int64, device=self._device)
        self.token_count = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._host_tokens: Optional[int] = 0   # token_count on the host while known without a sync
        if not self.fixed_range:
            self.lo = self.hi = self.bin_width = None

    def _to(self, device: torch.device) -> None:
        if device != self._device:
            self._device = device
            self.counts = self.counts.to(device)
            self.token_count = self.token_count.to(device)
            self._margins = [m.to(device) for m in self._margins]
            if not self.fixed_range and torch.is_tensor(self.lo):
                self.lo, self.hi, self.bin_width = (t.to(device) for t in (self.lo, self.hi, self.bin_width))

    def _set_range(self, bias_E: torch.Tensor) -> None:
        """Bias-following range [-1 - max b, 1 - min b) as 0-dim fp32 tensors on ``device`` (no sync)."""
        b = bias_E.detach().to(device=self._device, dtype=torch.float32)
        self.lo, self.hi = -1.0 - b.max(), 1.0 - b.min()
        self.bin_width = (self.hi - self.lo) / self.bins

    @property
    def num_tokens(self) -> int:
        """Tokens added since the last reset (summed over ranks once reduced). A host sync only after
        the histogram state was handed out by ``state_tensors`` (its count may have been summed)."""
        if self._host_tokens is None:
            self._host_tokens = int(self.token_count.item())
        return self._host_tokens

    def set_token_count(self, total: int) -> None:
        """After merging exact margins across ranks: the step's total token count (known on the host)."""
        self._host_tokens = int(total)
        self.token_count = torch.full((1,), int(total), dtype=torch.int64, device=self._device)

    def state_tensors(self) -> list[torch.Tensor]:
        """Tensors to all-reduce (SUM) in place across data-parallel ranks before ``solve`` (histogram only)."""
        if self.method != "histogram":
            raise ValueError("QBAccumulator.state_tensors: method='exact' keeps per-token margins that cannot be "
                             "all-reduced (parallel.moe_stats.reduce_balancer all-gathers them); use "
                             "method='histogram' (model.moe.qb_method=histogram) for a fixed-size state")
        self._host_tokens = None  # the caller may sum token_count in place
        return [self.counts, self.token_count]

    @torch.no_grad()
    def add(self, scores_TE: torch.Tensor, bias_E: torch.Tensor) -> None:
        """Record one micro-batch: scores_TE [T, E] (fp32 router scores), bias_E [E] used to route it."""
        if scores_TE.dim() != 2 or scores_TE.shape[1] != self.num_experts:
            raise ValueError(f"QBAccumulator.add: scores must be [T, {self.num_experts}], got {tuple(scores_TE.shape)}")
        self._to(scores_TE.device)
        T = scores_TE.shape[0]
        self.token_count += T
        if self._host_tokens is not None:
            self._host_tokens += T
        if self.method == "histogram" and self.lo is None:
            self._set_range(bias_E)
        if T == 0:
            return
        margin_TE = token_margins(scores_TE.detach(), bias_E.detach(), self.top_k).float()
        if self.method == "exact":
            self._margins.append(margin_TE)
            return
        bin_TE = ((margin_TE - self.lo) / self.bin_width).floor().clamp_(0, self.bins - 1).long()
        flat = (bin_TE + torch.arange(self.num_experts, device=bin_TE.device) * self.bins).view(-1)
        # scatter_add_, not bincount: CUDA bincount reads the maximum back to the host
        one = torch.ones((), dtype=torch.int64, device=flat.device)
        self.counts.view(-1).scatter_add_(0, flat, one.expand_as(flat))

    def margins(self) -> torch.Tensor:
        """Every recorded margin [tokens, E] fp32 (method='exact'), one tensor."""
        if not self._margins:
            return torch.zeros(0, self.num_experts, device=self._device)
        if len(self._margins) > 1:
            self._margins = [torch.cat(self._margins)]
        return self._margins[0]

    @torch.no_grad()
    def cutoffs(self) -> torch.Tensor:
        """Per-expert (q+1)-th largest margin [E] fp32 over everything added (= -b^ before centring).

        Histogram: computed on the device (the rank q+1 from ``token_count``, no host sync); with no
        tokens the result is meaningless (``solve`` returns the old bias then)."""
        if self.method == "exact":
            m = self.num_tokens
            assert m > 0, "cutoffs() needs at least one token"
            return self.margins().topk(_target_rank(m, self.num_experts, self.top_k), dim=0).values[-1]
        assert self.lo is not None, "cutoffs(): no range yet (nothing added; solve(bias) sets it from the bias)"
        m = self.token_count                                            # [1] int64, on the device
        rank = ((m * self.top_k) // self.num_experts + 1).clamp_min(1).minimum(m.clamp_min(1))
        counts_EB = self.counts
        above_EB = counts_EB.flip(-1).cumsum(-1).flip(-1)          # tokens in this bin or higher
        # above_EB is non-increasing along bins, so the last bin whose count-from-top reaches the
        # target rank is (number of such bins) - 1; above_EB[:, 0] == m >= rank keeps it >= 0
        # (clamped for an empty accumulator, whose result solve discards)
        bin_E = ((above_EB >= rank).sum(-1) - 1).clamp_min(0)
        in_bin_E = counts_EB.gather(1, bin_E[:, None]).squeeze(1)
        higher_E = above_EB.gather(1, bin_E[:, None]).squeeze(1) - in_bin_E
        r_E = (rank - higher_E).float()                              # 1..in_bin: rank inside the bin, from its top
        top_edge_E = self.lo + (bin_E + 1).float() * self.bin_width
        # spread the bin's values evenly: the r-th from the top sits at (r - 0.5)/count of the bin
        return top_edge_E - (r_E - 0.5) / in_bin_E.clamp_min(1).float() * self.bin_width

    @torch.no_grad()
    def solve(self, bias_E: torch.Tensor) -> torch.Tensor:
        """New mean-centred fp32 bias [E] from everything added (Eq.14); ``bias_E`` unchanged if empty.

        Eq.14's b^ depends on the old bias only through the margins recorded by ``add``; ``bias_E``
        supplies the fallback and the device (and the histogram range when this rank added nothing).
        """
        old_E = bias_E.detach().float()
        if self.method == "exact":
            if self.num_tokens == 0:
                return old_E.clone()
            b_hat_E = -self.cutoffs()
            return (b_hat_E - b_hat_E.mean()).to(bias_E.device)
        self._to(bias_E.device)
        if self.lo is None:
            self._set_range(bias_E)
        b_hat_E = -self.cutoffs()
        return torch.where(self.token_count > 0, b_hat_E - b_hat_E.mean(), old_E)
