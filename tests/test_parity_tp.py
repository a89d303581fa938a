"""Every (tp, sp, dp) layout reproduces the single-process loss and gradients (fp32, same seed)."""
import pytest
import torch

from megak3.train.parity import run_steps
from parallel.testing import PARITY_MODEL as MODEL, run_distributed


STEPS = 5
# Relative L2 error of the whole gradient (all parameters concatenated) and of each parameter.
# fp32 sums over different partitions round differently; small, cancelling gradients (e.g. a
# layer's dt_bias) reach ~1e-5 on their own, so the per-parameter bound is 5e-5.
GRAD_RTOL = 1e-5
PARAM_RTOL = 5e-5
LOSS_TOL = 1e-4


@pytest.fixture(scope="module")
def reference():
    return run_steps(0, 1, 1, 1, False, STEPS, MODEL)


def _compare(ref, got):
    assert got["grads"].keys() == ref["grads"].keys()
    worst, diff2, ref2 = 0.0, 0.0, 0.0
    for name, g_ref in ref["grads"].items():
        g = got["grads"][name]
        assert g.shape == g_ref.shape, name
        d = float((g.double() - g_ref.double()).norm())
        rel = d / max(float(g_ref.norm()), 1e-30)
        worst = max(worst, rel)
        diff2, ref2 = diff2 + d * d, ref2 + float(g_ref.double().norm()) ** 2
        assert rel <= PARAM_RTOL, (name, rel)
    assert (diff2 / ref2) ** 0.5 <= GRAD_RTOL
    assert abs(got["losses"][0] - ref["losses"][0]) <= 1e-6 * abs(ref["losses"][0])
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= LOSS_TOL, (got["losses"], ref["losses"])
    return worst


LAYOUTS = [(1, False, 2), (2, False, 1), (2, True, 1), (2, False, 2), (2, True, 2),
           (4, False, 1), (4, True, 1), (4, False, 2), (4, True, 2)]


@pytest.mark.parametrize("tp,sp,dp", LAYOUTS, ids=[f"tp{t}-{'sp' if s else 'nosp'}-dp{d}" for t, s, d in LAYOUTS])
def test_layout_matches_single_process(reference, tp, sp, dp):
    got = run_distributed(run_steps, tp * dp, tp, dp, sp, STEPS, MODEL, timeout_s=300)[0]
    _compare(reference, got)


def test_broken_collective_is_caught(reference):
    """Dropping the TP sum of replicated-parameter gradients must break parity."""
    got = run_distributed(run_steps, 2, 2, 1, True, 1, MODEL, break_collective=True, timeout_s=300)[0]
    with pytest.raises(AssertionError):
        _compare({"grads": reference["grads"], "losses": reference["losses"][:1]}, got)
