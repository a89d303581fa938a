"""MoonEP planner: per-batch redundant experts so every EP rank computes exactly S*K rows.

Input: ``counts_RE[s, e]`` = rows source rank s routes to expert e this layer and batch (every rank
routes ``rows_per_rank`` = S*K rows). Expert e is homed on rank ``e // E_loc`` (slot ``e % E_loc``).
Output (:class:`Plan`): replica placements, the split of every (source, expert) block over the
expert's copies, and the receive offsets, such that every rank receives exactly ``rows_per_rank``
(or, within the tolerance of step 0, at most ``capacity`` rows with no replica at all).

The placement is a **greedy heuristic**, not a minimiser of the replica count (that is a
bin-packing-like problem): it is exact in rows, deterministic, vectorised, and uses at most
(#excess pieces + #spare ranks - 1) replicas. :func:`replica_lower_bound` gives a lower bound on
what any exact plan needs; tools/bench_moonep.py prints both (issue 19 reports a 10-expert case
planned with 4 replicas where 3 suffice: the line matching can cut a piece that an optimal plan
would place whole on another rank).

Algorithm (integer arithmetic only, identical on every rank, no host sync, any device):

0. **Tolerance.** If every rank's home load is <= ``capacity`` (``rows_per_rank`` + floor(
   ``tolerance`` * rows_per_rank), :func:`capacity_rows`), plan no replicas: every row stays on its
   home expert and a rank receives at most ``capacity`` rows (max/mean <= 1 + tolerance). With
   tolerance 0 this is the perfectly balanced case, so nothing changes.
1. **Keep at home.** Each rank orders its home experts by count ascending (ties: expert id) and keeps
   them whole until the target T = rows_per_rank is reached; the expert crossing T keeps part, the
   heavier ones keep nothing. The excess ``x_e`` therefore comes from the fewest, heaviest experts
   of each rank and an under-loaded rank keeps everything (tokens stay on their home expert).
2. **Match excess to spare on two lines.** Excess pieces (one per expert, heaviest first, ties by
   id) are laid end to end on one line, the spare capacities ``T - load_r`` of under-loaded ranks
   (largest first, ties by rank) on another. Every non-empty intersection of a piece with a rank's
   interval is one replica of that expert on that rank (``a_ER``). A piece is one interval, so an
   expert lands at most once per rank, and never on its (over-loaded, spare-free) home rank. The
   number of replicas is at most (#pieces + #spare ranks - 1).
3. **Replica bound.** A rank may hold at most M = ``max_replicas_per_rank`` replicas. If the line
   puts more on a rank (many small pieces on one big spare; e.g. one empty rank and every other rank
   slightly over), the rank keeps its M largest replicas (ties: expert id) and the dropped rows
   return to their home copy. The plan is still valid (every row is placed, invariants 1, 3-5 hold)
   but the home ranks of dropped pieces receive more than T rows: ``feasible`` is False and the
   caller must fall back (the dispatcher uses its dynamic-shape path or a larger M). The same holds
   when ``counts_RE`` does not sum to R*T (the target stays T: a smaller total leaves ranks under T,
   a larger one leaves excess at home) or contains negative entries.
4. **Split each copy's total over sources** by the same line trick: for expert e, sources occupy
   consecutive intervals (s order) of the line [0, c_e) and copies occupy consecutive intervals in
   copy order (home first, then replicas by rank); rows_SRJ[s, r, j] is the intersection length.
   So one source's rows of e, in its expert-sorted order, fill the copies in copy order.
5. **Receive offsets.** Rank r's buffer is slot-major (j), then source s: an exclusive cumsum.

The C++ twin (csrc/moonep_planner.cpp) implements the same steps with the same tie-breaking and
returns bit-identical tensors; ``backend="auto"`` uses it for CPU counts when it is built.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Plan:
    """A MoonEP plan for R ranks, J = E_loc + M slots per rank (see module docstring)."""

    slot_expert_RJ: torch.Tensor
    """int64 [R, J]: j < E_loc home expert r*E_loc + j; j >= E_loc replica expert id or -1 (unused)"""
    rows_SRJ: torch.Tensor
    """int64 [R, R, J]: rows source rank s sends to slot j of rank r"""
    recv_offset_SRJ: torch.Tensor
    """int64 [R, R, J]: first row of that block in rank r's buffer (slot-major, then source)"""
    num_replicas: torch.Tensor
    """int64 scalar: used replica slots over all ranks"""
    feasible: torch.Tensor
    """bool scalar: every rank receives exactly rows_per_rank rows within the replica bound"""


def _excl_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


def _check(counts_RE: torch.Tensor, rows_per_rank: int, max_replicas_per_rank: int | None,
           num_ranks: int | None = None):
    if not isinstance(counts_RE, torch.Tensor) or counts_RE.dim() != 2:
        raise ValueError("plan_moonep: counts_RE must be a 2-D [R, E] tensor of per-source, per-expert "
                         "row counts (gather each EP rank's tokens_per_expert_E)")
    if counts_RE.dtype.is_floating_point or counts_RE.dtype == torch.bool:
        raise ValueError(f"plan_moonep: counts_RE must be an integer tensor, got {counts_RE.dtype}")
    R, E = counts_RE.shape
    if R < 1 or E < 1 or E % R != 0:
        raise ValueError(f"plan_moonep: model.moe.num_experts ({E}) must be divisible by parallel.ep ({R}); "
                         f"choose an ep that divides the expert count")
    E_loc = E // R
    M = E_loc if max_replicas_per_rank is None else int(max_replicas_per_rank)
    if M < 0:
        raise ValueError(f"plan_moonep: moonep.max_replicas_per_rank must be >= 0, got {M}")
    if int(rows_per_rank) < 0:
        raise ValueError(f"plan_moonep: rows_per_rank (S*K) must be >= 0, got {rows_per_rank}")
    return R, E, E_loc, M


def _plan_torch(counts_RE: torch.Tensor, T: int, M: int, capacity: int | None = None) -> Plan:
    counts_RE = counts_RE.to(torch.int64)
    dev = counts_RE.device
    R, E = counts_RE.shape
    E_loc = E // R
    J = E_loc + M

    c_E = counts_RE.sum(0)
    c_RL = c_E.view(R, E_loc)
    load_R = c_RL.sum(1)

    # 0. tolerance: no replicas when the most loaded rank stays within capacity
    within = load_R.max() <= max(T if capacity is None else int(capacity), T)

    # 1. keep at home: light experts first, excess from the heaviest ones
    order_RL = torch.sort(c_RL, dim=1, stable=True).indices
    cs_RL = torch.gather(c_RL, 1, order_RL)
    keep_sorted_RL = torch.minimum(cs_RL, (T - _excl_cumsum(cs_RL, 1)).clamp(min=0))
    keep_RL = torch.empty_like(keep_sorted_RL).scatter_(1, order_RL, keep_sorted_RL)
    x_E = torch.where(within, 0, (c_RL - keep_RL).reshape(E))

    # 2. excess line (heaviest first) x spare line (largest first)
    p_order = torch.sort(-x_E, stable=True).indices
    p_start = torch.empty_like(x_E).scatter_(0, p_order, _excl_cumsum(x_E[p_order], 0))
    p_end = p_start + x_E
    sp_R = (T - load_R).clamp(min=0)
    r_order = torch.sort(-sp_R, stable=True).indices
    r_start = torch.empty_like(sp_R).scatter_(0, r_order, _excl_cumsum(sp_R[r_order], 0))
    r_end = r_start + sp_R
    a_ER = (torch.minimum(p_end[:, None], r_end[None, :]) -
            torch.maximum(p_start[:, None], r_start[None, :])).clamp(min=0)

    # 3. replica bound: keep each rank's M largest replicas (ties by expert id)
    used_ER = a_ER > 0
    need_R = used_ER.sum(0)
    col_order = torch.sort(-a_ER, dim=0, stable=True).indices
    arange_ER = torch.arange(E, device=dev, dtype=torch.int64)[:, None].expand(E, R)
    pos_ER = torch.empty_like(a_ER).scatter_(0, col_order, arange_ER.contiguous())
    used_ER = used_ER & (pos_ER < M)
    a_ER = torch.where(used_ER, a_ER, torch.zeros_like(a_ER))
    h_E = c_E - a_ER.sum(1)                                  # rows left on the home copy

    # slots: home j < E_loc; replicas of rank r in expert-id order after them
    slot_pos_ER = _excl_cumsum(used_ER.to(torch.int64), 0)
    r_ER = torch.arange(R, device=dev, dtype=torch.int64)[None, :].expand(E, R)
    dump = R * J
    flat_idx_ER = torch.where(used_ER, r_ER * J + E_loc + slot_pos_ER, torch.full_like(r_ER, dump))
    copy_start_ER = h_E[:, None] + _excl_cumsum(a_ER, 1)      # copy order: home, then replicas by rank
    e_ER = torch.arange(E, device=dev, dtype=torch.int64)[:, None].expand(E, R)

    def scatter_slots(val_ER: torch.Tensor, home_RL: torch.Tensor, fill: int) -> torch.Tensor:
        out = torch.full((dump + 1,), fill, dtype=torch.int64, device=dev)
        out.scatter_(0, flat_idx_ER.reshape(-1), val_ER.reshape(-1))
        out = out[:dump].view(R, J).clone()
        out[:, :E_loc] = home_RL
        return out

    slot_expert_RJ = scatter_slots(e_ER, torch.arange(E, device=dev, dtype=torch.int64).view(R, E_loc), -1)
    slot_amount_RJ = scatter_slots(a_ER, h_E.view(R, E_loc), 0)
    slot_start_RJ = scatter_slots(copy_start_ER, torch.zeros(R, E_loc, dtype=torch.int64, device=dev), 0)

    # 4. split every copy over sources (line of sources per expert)
    src_start_SE = _excl_cumsum(counts_RE, 0)
    e_safe = slot_expert_RJ.clamp(min=0).reshape(-1)
    s_start = src_start_SE[:, e_safe].view(R, R, J)            # [S, R, J]
    s_end = s_start + counts_RE[:, e_safe].view(R, R, J)
    lo = torch.maximum(s_start, slot_start_RJ[None])
    hi = torch.minimum(s_end, (slot_start_RJ + slot_amount_RJ)[None])
    rows_SRJ = (hi - lo).clamp(min=0)
    rows_SRJ = torch.where((slot_expert_RJ >= 0)[None], rows_SRJ, torch.zeros_like(rows_SRJ))

    # 5. receive offsets: rank r's buffer slot-major, then source
    rows_RJS = rows_SRJ.permute(1, 2, 0).reshape(R, J * R)
    recv_offset_SRJ = _excl_cumsum(rows_RJS, 1).view(R, J, R).permute(2, 0, 1).contiguous()

    num_replicas = used_ER.sum()
    feasible = ((need_R <= M).all() & (counts_RE >= 0).all() & (c_E.sum() == R * T)
                & ((rows_SRJ.sum((0, 2)) == T).all() | within))
    return Plan(slot_expert_RJ, rows_SRJ, recv_offset_SRJ, num_replicas, feasible)


def capacity_rows(rows_per_rank: int, tolerance: float = 0.0) -> int:
    """Rows a rank may receive when the plan keeps everything home: S*K + floor(tolerance * S*K)."""
    if not tolerance >= 0.0:
        raise ValueError(f"moonep.tolerance={tolerance!r} must be >= 0")
    return int(rows_per_rank) + int(math.floor(float(tolerance) * int(rows_per_rank)))


def plan_moonep(counts_RE: torch.Tensor, rows_per_rank: int, max_replicas_per_rank: int | None = None,
                backend: str = "auto", tolerance: float = 0.0) -> Plan:
    """Plan redundant experts and row splits for one MoE layer (see the module docstring).

    ``backend``: ``"auto"`` (the C++ extension for CPU counts when built, else torch), ``"torch"``
    (vectorised, any device, no host sync) or ``"cpp"`` (raises if the extension is not built).
    ``tolerance``: plan no replicas when max/mean rank load <= 1 + tolerance (step 0).
    """
    R, E, E_loc, M = _check(counts_RE, rows_per_rank, max_replicas_per_rank)
    if backend not in ("auto", "torch", "cpp"):
        raise ValueError(f"plan_moonep: moonep.planner_backend must be auto|torch|cpp, got {backend!r}")
    cap = capacity_rows(rows_per_rank, tolerance)
    if backend != "torch":
        from ._ext import get as cpp_planner  # read at call time: tests swap moonep._ext.get

        mod = cpp_planner()
        if mod is None and backend == "cpp":
            raise ValueError("plan_moonep: backend='cpp' but the C++ planner is not built; run "
                             "`pip install -e . --no-build-isolation` or set MEGAK3_BUILD_EXT=1 to JIT-build it")
        if mod is not None and (counts_RE.device.type == "cpu" or backend == "cpp"):
            dev = counts_RE.device
            counts = counts_RE.detach().to("cpu", torch.int64).contiguous()
            try:
                out = mod.plan(counts, int(rows_per_rank), M, cap)
            except TypeError:  # a build from before the capacity argument: same plan when cap == T
                if cap != int(rows_per_rank):
                    return _plan_torch(counts_RE, int(rows_per_rank), M, cap)
                out = mod.plan(counts, int(rows_per_rank), M)
            slot, rows, offs, nrep, feas = (t.to(dev) for t in out)
            return Plan(slot, rows, offs, nrep, feas)
    return _plan_torch(counts_RE, int(rows_per_rank), M, cap)


def replica_lower_bound(counts_RE: torch.Tensor, rows_per_rank: int, tolerance: float = 0.0) -> int:
    """A lower bound on the replicas ANY plan needs to give every rank exactly ``rows_per_rank`` rows
    (0 when step 0's tolerance applies). Host-side (for benchmarks and tests, not the hot path).

    Two necessary conditions, the bound is their max: (a) an over-loaded rank r must move
    load_r - T rows off its home experts, and every expert that moves rows needs >= 1 replica, so it
    needs at least the number of its heaviest experts whose counts reach that excess; summed over
    ranks (different experts). (b) every rank with load < T must host >= 1 replica to receive rows.
    """
    c = counts_RE.detach().to("cpu", torch.int64)
    R, E = c.shape
    T = int(rows_per_rank)
    c_RL = c.sum(0).view(R, E // R)
    load_R = c_RL.sum(1)
    if int(load_R.max()) <= capacity_rows(T, tolerance):
        return 0
    need_a = 0
    for r in range(R):
        excess = int(load_R[r]) - T
        if excess > 0:
            heavy = torch.sort(c_RL[r], descending=True).values.cumsum(0)
            need_a += int((heavy < excess).sum()) + 1
    need_b = int((load_R < T).sum())
    return max(need_a, need_b)


def check_plan(plan: Plan, counts_RE: torch.Tensor, rows_per_rank: int,
               max_replicas_per_rank: int | None = None, tolerance: float = 0.0) -> None:
    """Assert the plan invariants 0-4 (tests and debugging; host syncs). Raises AssertionError."""
    R, E, E_loc, M = _check(counts_RE, rows_per_rank, max_replicas_per_rank)
    counts_RE = counts_RE.to(torch.int64).cpu()
    slot = plan.slot_expert_RJ.cpu()
    rows = plan.rows_SRJ.cpu()
    offs = plan.recv_offset_SRJ.cpu()
    J = E_loc + M
    assert slot.shape == (R, J) and rows.shape == (R, R, J) and offs.shape == (R, R, J)
    assert (rows >= 0).all(), "negative row count"
    # 3. home slots, replica slots
    assert torch.equal(slot[:, :E_loc], torch.arange(E).view(R, E_loc)), "home slot moved"
    rep = slot[:, E_loc:]
    home_of = torch.where(rep >= 0, rep // max(E_loc, 1), -1)
    assert not (home_of == torch.arange(R)[:, None]).any(), "replica on its home rank"
    for r in range(R):
        used = slot[r][slot[r] >= 0]
        assert used.unique().numel() == used.numel(), f"expert twice on rank {r}"
    assert int((rep >= 0).sum()) == int(plan.num_replicas), "num_replicas mismatch"
    assert (rows[:, slot < 0] == 0).all(), "rows sent to an unused slot"
    # 1. conservation per (source, expert)
    e_flat = slot.clamp(min=0).reshape(-1)
    got = torch.zeros(R, E, dtype=torch.int64)
    got.index_add_(1, e_flat, (rows * (slot >= 0)).reshape(R, -1))
    assert torch.equal(got, counts_RE), "rows per (source, expert) not conserved"
    # 2. balance
    if bool(plan.feasible):
        got_R = rows.sum((0, 2))
        within = int(plan.num_replicas) == 0 and bool((got_R <= capacity_rows(rows_per_rank, tolerance)).all())
        assert (got_R == rows_per_rank).all() or within, "feasible plan is not balanced (nor within tolerance)"
        assert ((rep >= 0).sum(1) <= M).all()
    # offsets: slot-major then source, contiguous from 0
    expect = (torch.cumsum(rows.permute(1, 2, 0).reshape(R, -1), 1) - rows.permute(1, 2, 0).reshape(R, -1))
    assert torch.equal(offs, expect.view(R, J, R).permute(2, 0, 1)), "receive offsets"
    # 4. copy order: copies of e are (home, replicas by rank); over the line of sources (s order)
    # each copy takes the next contiguous range, so rows[s, copy k] = |source range ∩ copy range|
    for e in torch.nonzero(counts_RE.sum(0)).flatten().tolist():
        where = sorted((slot == e).nonzero().tolist(), key=lambda rj: (rj[0] != e // E_loc, rj[0], rj[1]))
        blk_SC = torch.stack([rows[:, r, j] for r, j in where], 1)
        s_hi = torch.cumsum(counts_RE[:, e], 0)
        c_hi = torch.cumsum(blk_SC.sum(0), 0)
        lo = torch.maximum((s_hi - counts_RE[:, e])[:, None], (c_hi - blk_SC.sum(0))[None, :])
        want_SC = (torch.minimum(s_hi[:, None], c_hi[None, :]) - lo).clamp(min=0)
        assert torch.equal(blk_SC, want_SC), f"copy order violated for expert {e}"
