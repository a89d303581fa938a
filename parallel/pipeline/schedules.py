"""Pipeline schedules as per-rank action lists, and an event simulator that checks and times them.

A schedule is, for every pipeline rank, the ordered list of compute actions it runs in one optimizer
step. ``Action(kind, chunk, mb)``: kind ``F`` (forward), ``B`` (backward: input gradients, plus the
weight gradients unless the schedule splits them off) or ``W`` (the deferred weight gradients of
one micro-batch). With ``vp`` model chunks per rank, chunk c of rank r is virtual stage
``v = c * p + r`` (Megatron-Core's interleaving): activations flow v -> v + 1, gradients back.

Schedules (``name``):
  ``afab``              all forwards, then all backwards (the reference; holds m micro-batches).
  ``1f1b``              p - 1 - r warm-up forwards, then one-forward-one-backward, then cool-down;
                        rank r holds at most p - r micro-batches.       bubble (p-1)/(m+p-1)
  ``interleaved_1f1b``  Megatron-Core's interleaved 1F1B over vp >= 2 chunks (m % p == 0): micro-
                        batches go through each chunk in groups of p; warm-up 2(p-1-r) + (vp-1)p.
                        bubble (p-1)/(vp*m+p-1)
  ``zb_h1``             zero bubble H1 (Qi et al., 2023): 1F1B order with B and W split, rank r
                        running each W r micro-batches late so W's fill the cool-down. With
                        t_F = t_B = t_W the bubble is (p-1)/(3m+p-1), a third of 1F1B's.

Any list that the simulator can run to completion is deadlock-free in the executor (engine.py),
under NCCL's rendezvous point-to-point too: the executor orders every rank's sends and receives by
the simulated end time of the producing action (``engine.message_plan``), so the least unmatched
message always has both ends posted. ``simulate`` also gives the theoretical bubble of a schedule
for measured op times.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

SCHEDULES = ("afab", "1f1b", "interleaved_1f1b", "zb_h1")


@dataclass(frozen=True)
class Action:
    kind: str   # "F", "B" or "W"
    chunk: int
    mb: int

    def __repr__(self):
        return f"{self.kind}{self.chunk}.{self.mb}"


def splits_weight_grad(name: str) -> bool:
    """Whether the schedule runs W separately from B."""
    return name == "zb_h1"


def check_schedule(name: str, pp: int, vp: int, m: Optional[int] = None) -> None:
    """Raise ValueError naming the config field and the fix for an impossible combination;
    m (micro-batches per step) is checked only when given."""
    if name not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={name!r}: choose one of {', '.join(SCHEDULES)}")
    if isinstance(vp, bool) or not isinstance(vp, int) or vp < 1:
        raise ValueError(f"parallel.vp={vp!r} must be an integer >= 1 (model chunks per pipeline rank)")
    if name == "interleaved_1f1b":
        if vp < 2:
            raise ValueError("parallel.pp_schedule=interleaved_1f1b needs parallel.vp >= 2 model chunks per "
                             "rank; set parallel.vp=2 or use pp_schedule=1f1b")
        if m is not None and m % pp:
            raise ValueError(f"parallel.pp_schedule=interleaved_1f1b needs the micro-batches per step ({m}) to be "
                             f"a multiple of parallel.pp={pp}; change train.global_batch_size or "
                             "train.micro_batch_size")
    elif vp > 1 and name != "afab":
        raise ValueError(f"parallel.vp={vp} needs parallel.pp_schedule=interleaved_1f1b (or afab); "
                         f"{name} runs one model chunk per rank")
    if m is not None and m < 1:
        raise ValueError("a pipeline step needs at least one micro-batch")


def build_schedule(name: str, pp: int, m: int, vp: int = 1) -> List[List[Action]]:
    """Per-rank action lists of one step."""
    check_schedule(name, pp, vp, m)
    if name == "afab":
        out = []
        for _r in range(pp):
            fwd = [Action("F", c, i) for i in range(m) for c in range(vp)]
            out.append(fwd + [Action("B", c, i) for i in range(m) for c in reversed(range(vp))])
        return out
    if name == "1f1b":
        return [_one_f_one_b(pp, m, r) for r in range(pp)]
    if name == "interleaved_1f1b":
        return [_interleaved(pp, m, vp, r) for r in range(pp)]
    return _zb_h1(pp, m)


def _one_f_one_b(p: int, m: int, r: int) -> List[Action]:
    warm = min(p - 1 - r, m)
    acts = [Action("F", 0, i) for i in range(warm)]
    for k in range(m - warm):
        acts += [Action("F", 0, warm + k), Action("B", 0, k)]
    return acts + [Action("B", 0, i) for i in range(m - warm, m)]


def _interleaved(p: int, m: int, vp: int, r: int) -> List[Action]:
    total = m * vp

    def unit(k: int, forward: bool) -> Tuple[int, int]:
        group = k % (p * vp)
        chunk = group // p if forward else vp - 1 - group // p
        return chunk, (k // (p * vp)) * p + k % p

    warm = min((p - 1 - r) * 2 + (vp - 1) * p, total)
    acts = [Action("F", *unit(k, True)) for k in range(warm)]
    for k in range(total - warm):
        acts += [Action("F", *unit(warm + k, True)), Action("B", *unit(k, False))]
    return acts + [Action("B", *unit(k, False)) for k in range(total - warm, total)]


def _zb_h1(p: int, m: int) -> List[List[Action]]:
    """1F1B's warm-up (p - 1 - r forwards) and F/B alternation, with rank r running each W r
    micro-batches after its B: the last stage sends its gradients upstream without waiting for its
    own weight gradients, and every rank's postponed W's fill its cool-down. With unit op times
    this reaches the ZB-H1 makespan 3m + p - 1 exactly (tests/test_pipeline_schedules.py); rank r
    holds at most p - r micro-batches between F and B plus r between B and W."""
    out = []
    for r in range(p):
        warm, lag = min(p - 1 - r, m), r
        acts = [Action("F", 0, i) for i in range(warm)]
        n_w = 0
        for k in range(m):
            if k < m - warm:
                acts.append(Action("F", 0, warm + k))
            acts.append(Action("B", 0, k))
            if k >= lag:
                acts.append(Action("W", 0, n_w))
                n_w += 1
        out.append(acts + [Action("W", 0, i) for i in range(n_w, m)])
    return out


def simulate(schedule: Sequence[Sequence[Action]], pp: int, vp: int, cost: Dict[str, float],
             split_w: bool = False, comm: float = 0.0):
    """Run the per-rank lists on an ideal machine; returns (timeline, makespan).

    cost: seconds of "F", "B" and "W" (one chunk of one micro-batch), or a list of such dicts, one
        per rank (unbalanced stages); when the schedule does not split W, a B costs cost["B"] +
        cost["W"]. comm: latency of one stage-to-stage transfer.
    timeline: per rank, [(action, start, end)] in execution order.
    Raises RuntimeError if the lists deadlock or miss a dependency (the schedules' unit test).
    """
    V = pp * vp
    done: Dict[Tuple[str, int, int], float] = {}   # (kind, virtual stage, mb) -> end time
    pos = [0] * pp
    t_free = [0.0] * pp
    timeline: List[List[tuple]] = [[] for _ in range(pp)]
    remaining = sum(len(s) for s in schedule)
    while remaining:
        best = None
        for r in range(pp):
            if pos[r] == len(schedule[r]):
                continue
            a = schedule[r][pos[r]]
            v = a.chunk * pp + r
            deps = []
            if a.kind == "F":
                if v > 0:
                    deps.append(("F", v - 1, a.mb, True))
            elif a.kind == "B":
                deps.append(("F", v, a.mb, False))
                if v < V - 1:
                    deps.append(("B", v + 1, a.mb, True))
            else:
                deps.append(("B", v, a.mb, False))
            ready = t_free[r]
            for kind, dv, mb, remote in deps:
                if (kind, dv, mb) not in done:
                    ready = None
                    break
                ready = max(ready, done[(kind, dv, mb)] + (comm if remote else 0.0))
            if ready is not None and (best is None or ready < best[0]):
                best = (ready, r, a, v)
        if best is None:
            nxt = [s[k] if k < len(s) else None for s, k in zip(schedule, pos)]
            raise RuntimeError(f"schedule deadlocks: next actions {nxt}")
        start, r, a, v = best
        c = cost[r] if isinstance(cost, (list, tuple)) else cost
        dur = c[a.kind] + (c.get("W", 0.0) if a.kind == "B" and not split_w else 0.0)
        end = start + dur
        key = (a.kind, v, a.mb)
        if key in done:
            raise RuntimeError(f"{a} runs twice on rank {r}")
        done[key] = end
        t_free[r] = end
        timeline[r].append((a, start, end))
        pos[r] += 1
        remaining -= 1
    makespan = max(t for tl in timeline for _, _, t in tl)
    return timeline, makespan


def theoretical_bubble(name: str, pp: int, m: int, vp: int = 1, cost=None) -> float:
    """Idle fraction of the simulated schedule (mean over ranks) for op times ``cost`` (default
    t_F = t_B = t_W = 1; for non-split schedules B then costs t_B + t_W; a list = one dict per rank)."""
    cost = cost or {"F": 1.0, "B": 1.0, "W": 1.0}
    sched = build_schedule(name, pp, m, vp)
    timeline, span = simulate(sched, pp, vp, cost, splits_weight_grad(name))
    busy = [sum(e - s for _, s, e in tl) for tl in timeline]
    return sum(1 - b / span for b in busy) / pp


def closed_form_bubble(name: str, pp: int, m: int, vp: int = 1):
    """The textbook bubble fraction (None where the schedule has no simple one)."""
    if name == "1f1b":
        return (pp - 1) / (m + pp - 1)
    if name == "interleaved_1f1b":
        return (pp - 1) / (vp * m + pp - 1)
    if name == "zb_h1":  # with t_F = t_B = t_W
        return (pp - 1) / (3 * m + pp - 1)
    return None
