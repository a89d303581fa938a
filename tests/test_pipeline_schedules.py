"""Pipeline schedules as action lists (no processes): every list runs to completion on the event
simulator (no deadlock, every F/B(/W) of every chunk and micro-batch exactly once, dependencies
respected), the simulated bubble equals the closed forms, 1F1B-style lists respect their
activation bound, and impossible combinations fail with the field to change."""
import pytest

from parallel.pipeline.schedules import (Action, build_schedule, check_schedule, closed_form_bubble, simulate,
                                         splits_weight_grad, theoretical_bubble)

CASES = [("afab", p, m, vp) for p in (2, 3, 4) for m in (1, 2, 5, 8) for vp in (1, 2)]
CASES += [("1f1b", p, m, 1) for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]
CASES += [("interleaved_1f1b", p, k * p, vp) for p in (2, 4) for k in (1, 2, 3) for vp in (2, 3)]
CASES += [("zb_h1", p, m, 1) for p in (2, 3, 4, 8) for m in (1, 2, 4, 8, 16)]


@pytest.mark.parametrize("name,p,m,vp", CASES)
def test_schedule_is_complete_and_deadlock_free(name, p, m, vp):
    sched = build_schedule(name, p, m, vp)
    kinds = "FBW" if splits_weight_grad(name) else "FB"
    for r, acts in enumerate(sched):
        assert sorted(map(repr, acts)) == sorted(repr(Action(k, c, i)) for k in kinds for c in range(vp)
                                                 for i in range(m)), (r, acts)
    timeline, span = simulate(sched, p, vp, {"F": 1.0, "B": 1.0, "W": 1.0}, splits_weight_grad(name))
    end = {}
    for r, tl in enumerate(timeline):
        for a, s, e in tl:
            end[(a.kind, a.chunk * p + r, a.mb)] = (s, e)
    V = p * vp
    for (kind, v, i), (s, _) in end.items():  # dependencies: F(v-1) < F(v) < B(v); B(v+1) < B(v); B < W
        if kind == "F" and v > 0:
            assert end[("F", v - 1, i)][1] <= s
        if kind == "B":
            assert end[("F", v, i)][1] <= s
            if v < V - 1:
                assert end[("B", v + 1, i)][1] <= s
        if kind == "W":
            assert end[("B", v, i)][1] <= s
    if name in ("1f1b", "zb_h1"):  # rank r holds at most p - r micro-batches between F and B
        for r, acts in enumerate(sched):
            held = peak = 0
            for a in acts:
                held += {"F": 1, "B": -1, "W": 0}[a.kind]
                peak = max(peak, held)
            assert peak <= p - r


@pytest.mark.parametrize("name,p,m,vp", [("1f1b", 4, 8, 1), ("1f1b", 2, 4, 1), ("interleaved_1f1b", 4, 8, 2),
                                         ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 4, 3),
                                         ("zb_h1", 4, 8, 1), ("zb_h1", 8, 16, 1), ("zb_h1", 2, 2, 1)])
def test_simulated_bubble_equals_closed_form(name, p, m, vp):
    assert theoretical_bubble(name, p, m, vp) == pytest.approx(closed_form_bubble(name, p, m, vp), abs=1e-12)


def test_zero_bubble_beats_1f1b_and_interleaving_helps():
    assert theoretical_bubble("zb_h1", 4, 8) < theoretical_bubble("1f1b", 4, 8) / 2
    assert theoretical_bubble("interleaved_1f1b", 4, 8, 2) < theoretical_bubble("1f1b", 4, 8)
    # with a slow W the simulation, not the closed form, is the theory
    assert theoretical_bubble("zb_h1", 4, 8, 1, {"F": 1, "B": 1, "W": 2}) > 0


def test_simulator_detects_deadlock():
    bad = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("B", 0, 0), Action("F", 0, 0)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(bad, 2, 1, {"F": 1, "B": 1, "W": 0})


def test_bad_combinations_name_the_field():
    with pytest.raises(ValueError, match="parallel.pp_schedule='zbv'"):
        check_schedule("zbv", 2, 1, 4)
    with pytest.raises(ValueError, match="needs parallel.vp >= 2"):
        check_schedule("interleaved_1f1b", 2, 1, 4)
    with pytest.raises(ValueError, match="multiple of parallel.pp=4"):
        check_schedule("interleaved_1f1b", 4, 2, 6)
    with pytest.raises(ValueError, match="parallel.vp=2 needs parallel.pp_schedule=interleaved_1f1b"):
        check_schedule("zb_h1", 2, 2, 4)
