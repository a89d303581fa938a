"""MoonEP tolerance (moonep.tolerance), the replica lower bound, and the dispatcher paths of issue 19:
no replicas for near-uniform routing, exact balance kept under Zipf skew, lower bound <= plan,
torch == C++ with a capacity, and a layer under tolerance (no replicas, ranks receiving != S*K rows)
or with replicas in the persistent compute-dtype buffer, against one process."""
import pytest
import torch
import torch.distributed as dist

from moonep import _ext
from moonep.config import MoonEPConfig
from moonep.planner import capacity_rows, check_plan, plan_moonep, replica_lower_bound

R, E, K, S = 8, 64, 16, 4096      # 8 EP ranks, 8 experts each, S tokens/rank, top-16 (bench scale)
T = S * K


def counts_from(p_E, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.multinomial(p_E.expand(R, E).contiguous(), T, replacement=True, generator=g)
    return torch.zeros(R, E, dtype=torch.int64).scatter_add_(1, idx, torch.ones_like(idx))


def zipf(a, seed=0):
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** a
    return (p / p.sum())[torch.randperm(E, generator=torch.Generator().manual_seed(seed))]


def max_over_mean(c):
    load = c.sum(0).view(R, -1).sum(1).double()
    return float(load.max() / load.mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_routing_no_replicas_with_tolerance(seed):
    c = counts_from(torch.full((E,), 1.0 / E, dtype=torch.float64), seed)
    ratio = max_over_mean(c)
    assert 1.0 < ratio <= 1.02, ratio                  # near-uniform, but not exactly balanced
    exact = plan_moonep(c, T, backend="torch")
    assert int(exact.num_replicas) > 0                  # tolerance 0: replicas for <2% imbalance
    p = plan_moonep(c, T, backend="torch", tolerance=0.02)
    check_plan(p, c, T, tolerance=0.02)
    assert int(p.num_replicas) == 0 and bool(p.feasible)
    assert int(p.rows_SRJ.sum((0, 2)).max()) <= capacity_rows(T, 0.02)
    assert replica_lower_bound(c, T, 0.02) == 0 and replica_lower_bound(c, T) >= 1


@pytest.mark.parametrize("a", [1.0, 1.2])
def test_zipf_still_exact_with_tolerance(a):
    c = counts_from(zipf(a), 7)
    assert max_over_mean(c) > 1.1
    p = plan_moonep(c, T, backend="torch", tolerance=0.02)
    check_plan(p, c, T, tolerance=0.02)
    got = p.rows_SRJ.sum((0, 2)).double()
    assert bool(p.feasible) and float(got.max() / got.mean()) == 1.0
    assert int(p.num_replicas) >= replica_lower_bound(c, T, 0.02) >= 1


def test_lower_bound_hand_case_and_below_plan():
    # R=2, E=4, T=4: rank 0 holds 7 rows (e0: 6, e1: 1) -> moving 3 rows needs >= 1 replica;
    # rank 1 is under-loaded -> needs >= 1 replica; the plan uses exactly 1
    c = torch.tensor([[4, 0, 0, 0], [2, 1, 1, 0]])
    assert replica_lower_bound(c, 4) == 1 == int(plan_moonep(c, 4, backend="torch").num_replicas)
    # an over-loaded rank whose excess needs two experts: [3, 3 | 1, 1] at T=4 -> excess 2 from
    # 3+3: one expert suffices (3 >= 2): bound 1; [2, 2, 2 | 0, 0, 0] at T=3: excess 3 needs 2
    assert replica_lower_bound(torch.tensor([[2, 2, 0, 0], [1, 1, 1, 1]]), 4) == 1
    assert replica_lower_bound(torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 0, 0]]), 3) == 2
    for seed in range(20):
        c = counts_from(zipf(0.5 + seed / 10, seed), seed)
        p = plan_moonep(c, T, backend="torch")
        if bool(p.feasible):
            assert replica_lower_bound(c, T) <= int(p.num_replicas), seed


def test_bad_tolerance():
    with pytest.raises(ValueError, match="moonep.tolerance"):
        MoonEPConfig(tolerance=-0.1).validate()
    with pytest.raises(ValueError, match="moonep.tolerance"):
        capacity_rows(10, -1.0)


def test_cpp_matches_torch_with_capacity():
    mod = _ext.get()
    if mod is None:
        pytest.skip(f"C++ planner not built: {_ext.load_error}")
    try:
        mod.plan(torch.zeros(2, 4, dtype=torch.int64), 4, 2, 4)
    except TypeError:
        pytest.skip("the built C++ planner predates the capacity argument; rebuild it")
    for tol in (0.0, 0.02, 0.5):
        for seed, c in enumerate([counts_from(torch.full((E,), 1.0 / E, dtype=torch.float64), 3),
                                  counts_from(zipf(1.2), 4)]):
            a = plan_moonep(c, T, backend="torch", tolerance=tol)
            b = plan_moonep(c, T, backend="cpp", tolerance=tol)
            for x, y in zip(a.__dict__.values(), b.__dict__.values()):
                assert torch.equal(x, y), (tol, seed)


# ---- the dispatcher: tolerance path and replica buffers, against one process ---------------------

def _layer_case(rank, world, tolerance, autocast):
    from megak3.config import load_model_config
    from megak3.model.moe import LatentMoE
    from moonep.buffers import BufferPool
    from parallel.expert_parallel import full_expert_tensor, parallelize_ep
    from parallel.testing import PARITY_MODEL

    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    skew = torch.tensor([0.12, 0.09, 0.06, 0.0, 0.0, 0.0, 0.0, 0.0])

    def layer():
        torch.manual_seed(11)
        m = LatentMoE(cfg)
        m.gate.e_score_correction_bias.copy_(skew)
        return m

    g = torch.Generator().manual_seed(3)
    S_ = 16
    x, w = torch.randn(world * S_, cfg.hidden_size, generator=g), torch.randn(world * S_, cfg.hidden_size, generator=g)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else None

    def run(m, xs, ws):
        xs = xs.clone().requires_grad_(True)
        if ctx is not None:
            with ctx():
                y, _ = m(xs)
        else:
            y, _ = m(xs)
        (y.float() * ws).sum().backward()
        return y.detach().float(), xs.grad

    ref = layer()
    y_ref, gx_ref = run(ref, x, w)
    m = layer()
    plan = parallelize_ep(m, dist.group.WORLD, MoonEPConfig(tolerance=tolerance), pool=BufferPool())
    sl = slice(rank * S_, (rank + 1) * S_)
    d = plan.dispatchers[0]
    facts = []
    for _ in range(2):                                     # the second call reuses the buffers
        for p_ in m.parameters():
            p_.grad = None
        y, gx = run(m, x[sl], w[sl])
        facts.append(dict(d.last))
    rel = lambda a, b: float((a - b).norm() / b.norm())
    errs = {"y": rel(y, y_ref[sl]), "x.grad": rel(gx, gx_ref[sl])}
    for n, p_ in m.named_parameters():
        gr = p_.grad.float()
        gr = full_expert_tensor(gr, plan) if n.startswith("experts.") else (dist.all_reduce(gr) or gr)
        errs[n] = rel(gr, dict(ref.named_parameters())[n].grad.float())
    return errs, facts, d.replica_buffers.allocations, d.fallbacks, capacity_rows(S_ * cfg.moe.top_k, tolerance)


@pytest.mark.parametrize("tolerance,autocast", [(0.0, False), (10.0, False), (0.0, True)])
def test_dispatcher_tolerance_and_replica_buffer(tolerance, autocast):
    from parallel.testing import run_distributed

    # bf16 compute vs bf16 compute in another order: each bf16-rounded GEMM output (and each rank's
    # partial weight gradient) differs by its rounding, 2^-9 relative; measured <= 2.4e-3 in norm.
    # 4e-3 = 2 x 2^-9: one token of the 64 lost or weighted twice moves a gradient by ~1.5e-2.
    tol = 4e-3 if autocast else 1e-5
    for errs, facts, allocs, fallbacks, cap in run_distributed(_layer_case, 4, tolerance, autocast, timeout_s=300):
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] <= tol, (tolerance, autocast, worst)
        assert fallbacks == 0
        for f in facts:
            assert f["feasible"] and f["rows_computed"] <= cap
            if tolerance >= 10:
                assert f["num_replicas"] == 0
        if tolerance == 0:
            assert all(f["num_replicas"] > 0 for f in facts)
            assert allocs == 1                           # one persistent buffer for both calls
