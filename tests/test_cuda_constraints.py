"""CUDA constraints checked on CPU (issue 24, findings 5 and 6).

* Every grouped GEMM the MoE makes (forward, autograd's backward, the deferred weight gradient of
  zero-bubble schedules, bf16 autocast over fp32 masters, MoonEP's home + replica groups) is
  recorded on CPU and checked against the CUDA kernel's rules (megak3/ops/cuda_rules.py, written
  from torch 2.13's GroupedMMUtils.h / GroupedBlas.cpp / GroupMM.cu / GroupMMCommon.cuh). The
  table itself is checked against torch's meta kernel (its static rules) and hand-made cases.
* The group limit: experts per rank plus MoonEP replica slots must stay <= 1023; a layout beyond
  it is a one-line config error before work starts.
* The Transformer Engine recipe per (compute capability, CUDA version, TE version), with the
  queries faked.
"""
from __future__ import annotations

import types

import pytest
import torch

from megak3.ops.cuda_rules import GROUPED_MM_MAX_GROUPS, GROUPED_MM_RULES, check_grouped_mm, record_grouped_mm

BF = torch.bfloat16


def _offs(*v):
    return torch.tensor(v, dtype=torch.int32)


# ---- the table --------------------------------------------------------------------------------

CASES = [  # (name, a, b, offs, broken rules)
    ("moe forward 2d-3d", torch.zeros(10, 16, dtype=BF), torch.zeros(3, 8, 16, dtype=BF).transpose(-2, -1),
     _offs(3, 3, 10), []),
    ("fp32 operands", torch.zeros(10, 16), torch.zeros(3, 16, 8), _offs(3, 3, 10), ["dtype_bf16"]),
    ("1024 groups", torch.zeros(10, 16, dtype=BF), torch.zeros(1024, 16, 8, dtype=BF),
     torch.full((1024,), 10, dtype=torch.int32), ["groups_lt_1024"]),
    ("1023 groups", torch.zeros(10, 16, dtype=BF), torch.zeros(1023, 16, 8, dtype=BF),
     torch.full((1023,), 10, dtype=torch.int32), []),
    ("24-byte rows", torch.zeros(10, 12, dtype=BF), torch.zeros(3, 12, 8, dtype=BF), _offs(3, 3, 10),
     ["stride_16B"]),
    ("int64 offsets", torch.zeros(10, 16, dtype=BF), torch.zeros(3, 16, 8, dtype=BF),
     torch.tensor([3, 3, 10]), ["offs"]),
    ("no offsets for 2d", torch.zeros(10, 16, dtype=BF), torch.zeros(3, 16, 8, dtype=BF), None, ["offs"]),
    ("neither layout", torch.zeros(10, 32, dtype=BF)[:, ::2], torch.zeros(3, 16, 8, dtype=BF), _offs(3, 3, 10),
     ["layout"]),
    ("misaligned pointer", torch.zeros(10 * 16 + 1, dtype=BF)[1:].view(10, 16), torch.zeros(3, 16, 8, dtype=BF),
     _offs(3, 3, 10), ["data_ptr_16B"]),
    ("dW 2d-2d, A col-major, empty group", torch.zeros(10, 8, dtype=BF).t(), torch.zeros(10, 16, dtype=BF),
     _offs(3, 3, 10), []),
    ("2d-2d, A row-major, empty group", torch.zeros(8, 16, dtype=BF), torch.zeros(16, 16, dtype=BF),
     _offs(8, 8, 16), ["empty_groups"]),
    ("2d-2d, A row-major, 3-row group", torch.zeros(8, 16, dtype=BF), torch.zeros(16, 16, dtype=BF),
     _offs(3, 16), ["ragged_16B"]),
    ("2d-2d, A row-major, 8-row groups", torch.zeros(8, 16, dtype=BF), torch.zeros(16, 16, dtype=BF),
     _offs(8, 16), []),
    ("offsets going back", torch.zeros(10, 16, dtype=BF), torch.zeros(3, 16, 8, dtype=BF), _offs(5, 3, 10),
     ["offs_monotone"]),
]


@pytest.mark.parametrize("name,a,b,offs,broken", CASES, ids=[c[0] for c in CASES])
def test_rule_table_cases(name, a, b, offs, broken):
    assert sorted(check_grouped_mm(a, b, offs)) == sorted(broken)
    assert set(broken) <= set(GROUPED_MM_RULES)


@pytest.mark.parametrize("name,a,b,offs,broken", [c for c in CASES if c[1].dtype == BF],
                         ids=[c[0] for c in CASES if c[1].dtype == BF])
def test_static_rules_agree_with_torch_meta_kernel(name, a, b, offs, broken):
    """torch's meta registration of _grouped_mm restates GroupedMMUtils.h's static checks (dtype,
    dims, layout, 16-byte strides, offsets): it refuses exactly the cases the table flags for those
    rules (the group count and the offsets' values are device-side, not in the meta kernel)."""
    static = {"dtype_bf16", "dims", "layout", "stride_16B", "offs", "no_bias"}
    meta = [x if x is None else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            for x in (a, b, offs)]
    try:
        torch._grouped_mm(*meta[:2], offs=meta[2])
        refused = False
    except RuntimeError:
        refused = True
    assert refused == bool(set(broken) & static), (name, broken)


# ---- the calls the MoE makes ------------------------------------------------------------------

def _experts(E=6, L=16, m=24, dtype=torch.float32, seed=0):
    from megak3.model.moe import GroupedExperts

    torch.manual_seed(seed)
    ex = GroupedExperts(E, L, m).to(dtype)
    counts = torch.tensor([5, 0, 9, 0, 3, 7])[:E]   # empty experts included
    z = torch.randn(int(counts.sum()), L, dtype=dtype, requires_grad=True)
    return ex, z, counts


def _run(ex, z, counts, autocast=False):
    with torch.autocast("cpu", dtype=BF, enabled=autocast):
        y = ex(z, counts)
    (y.float() * torch.linspace(-1, 1, y.shape[1])).sum().backward()
    return y


def _assert_clean(rec, n):
    assert len(rec.calls) == n, [c.shapes for c in rec.calls]
    for c in rec.calls:
        assert c.broken == [], (c.shapes, c.strides, c.dtypes, c.offs, c.broken)
        assert c.dtypes == (BF, BF)


def test_moe_grouped_mm_calls_forward_and_backward_bf16_follow_cuda_rules():
    """bf16 experts (auto impl: grouped_mm): 3 forward GEMMs, and per GEMM autograd's dX and dW
    (9 calls), each within every CUDA rule, with empty experts in the batch."""
    ex, z, counts = _experts(dtype=BF)
    with record_grouped_mm() as rec:
        _run(ex, z, counts)
    _assert_clean(rec, 9)
    assert sorted({c.groups for c in rec.calls}) == [6]


def test_moe_grouped_mm_calls_under_autocast_follow_cuda_rules():
    """fp32 masters under bf16 autocast (the training path): the operands reach the kernel as bf16."""
    ex, z, counts = _experts()
    with record_grouped_mm() as rec:
        _run(ex, z, counts, autocast=True)
    _assert_clean(rec, 9)
    assert ex.w1.grad is not None and ex.w1.grad.dtype == torch.float32


def test_deferred_weight_grad_calls_follow_cuda_rules():
    """Zero-bubble B/W split: B's input gradients and W's grouped dW (grouped_weight_grad) under
    autocast, all within the rules; W's dW equals the undeferred one."""
    from megak3.ops.weight_grad import WeightGradStore

    ex, z, counts = _experts()
    ref = _experts()[0]
    _run(ref, z, counts, autocast=True)
    z.grad = None
    store = WeightGradStore()
    store.key = 0
    with record_grouped_mm() as rec:
        with store.capture():
            _run(ex, z, counts, autocast=True)
        assert ex.w1.grad is None
        store.flush(0)
    _assert_clean(rec, 9)     # 3 forward, 3 dX in B, 3 dW in W
    for n in ("w1", "w2", "w3"):
        assert torch.allclose(getattr(ex, n).grad, getattr(ref, n).grad, rtol=2e-2, atol=1e-3)


def test_moonep_home_plus_replica_groups_follow_cuda_rules():
    """MoonEP's expert math on home experts plus replica slots (GroupedExperts.compute on G = E/ep +
    M stacked weights, some slots empty) stays within the rules."""
    ex, z, counts = _experts(dtype=BF)
    rep = [0, 2]   # replica slots hold copies of experts 0 and 2
    w = [torch.cat([p, p[rep]]) for p in (ex.w1, ex.w3, ex.w2)]
    rows = torch.cat([counts, torch.tensor([0, 0])])
    with record_grouped_mm() as rec:
        y = ex.compute(*w, z, rows)
        y.float().sum().backward()
    _assert_clean(rec, 9)
    assert {c.groups for c in rec.calls} == {8}


def test_more_than_1023_groups_never_reach_grouped_mm():
    """auto picks the tiled path past the limit (CPU included, so CPU runs what a GPU would);
    forcing grouped_mm there is a one-line ValueError."""
    from megak3.ops.grouped_gemm import grouped_linear, pick_impl

    x = torch.randn(4, 16, dtype=BF)
    w = torch.randn(GROUPED_MM_MAX_GROUPS + 1, 8, 16, dtype=BF)
    assert pick_impl(x, w[:GROUPED_MM_MAX_GROUPS]) == "grouped_mm"
    assert pick_impl(x, w) == "tiled"
    counts = torch.zeros(w.shape[0], dtype=torch.long)
    counts[[0, 700, 1023]] = torch.tensor([1, 2, 1])
    with record_grouped_mm() as rec:
        y = grouped_linear(x, w, counts)
    assert rec.calls == []
    ref = torch.cat([x[0:1] @ w[0].T, x[1:3] @ w[700].T, x[3:4] @ w[1023].T])
    assert torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="at most 1023"):
        pick_impl(x, w, "grouped_mm")


# ---- the group bound as a config error ----------------------------------------------------------

@pytest.mark.parametrize("argv,world,fragment", [
    ("model=k3_tiny model.moe.num_experts=1024", 1, "1024 experts per rank"),
    ("model=k3_tiny model.moe.num_experts=2048 parallel.ep=2", 2, "raise parallel.ep"),
    ("model=k3_tiny model.moe.num_experts=1536 parallel.ep=2", 2, "moonep.max_replicas_per_rank <= 255"),
])
def test_group_bound_is_a_one_line_config_error(argv, world, fragment, tmp_path, monkeypatch):
    from megak3.job.compose import check

    monkeypatch.chdir(tmp_path)
    env = {"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(world)}
    code, msg = check(argv.split(), env=env if world > 1 else {})
    assert code == 2 and "\n" not in msg and fragment in msg and "1023" in msg, msg


def test_group_bound_counts_replica_slots_only_under_moonep():
    from moonep.config import MoonEPConfig

    assert MoonEPConfig().groups_per_rank(1536, 2) == 1536
    assert MoonEPConfig(enabled=False).validate(1536, 2).groups_per_rank(1536, 2) == 768
    assert MoonEPConfig(max_replicas_per_rank=255).validate(1536, 2).groups_per_rank(1536, 2) == 1023
    MoonEPConfig().validate(896, 1)     # k3_full on one rank: 896 groups
    MoonEPConfig().validate(896, 2)     # 448 + 448
    with pytest.raises(ValueError, match="moonep.max_replicas_per_rank=256"):
        MoonEPConfig(max_replicas_per_rank=256).validate(1536, 2)


# ---- Transformer Engine recipe per (capability, CUDA, TE) ---------------------------------------

def _recipes(*names):
    return types.SimpleNamespace(**{n: type(n, (), {}) for n in names + ("DelayedScaling",)})


ALL = ("MXFP8BlockScaling", "Float8BlockScaling", "Float8CurrentScaling")
RECIPES = [  # (capability, torch.version.cuda, TE version, recipe classes, expected)
    ((9, 0), "12.9", "2.3.0", ALL, "Float8BlockScaling"),
    ((9, 0), "13.0", "2.18.0+abc", ALL, "Float8BlockScaling"),
    ((9, 0), "12.8", "2.3.0", ALL, "Float8CurrentScaling"),           # block scaling needs CUDA >= 12.9
    ((9, 0), "12.9", "2.2.1", ALL, "Float8CurrentScaling"),           # ... and TE >= 2.3
    ((9, 0), "12.9", "2.3.0", ("Float8CurrentScaling",), "Float8CurrentScaling"),
    ((10, 0), "12.8", "2.2.0", ALL, "MXFP8BlockScaling"),
    ((10, 3), "12.9", "2.5.0", ALL, "MXFP8BlockScaling"),
    ((12, 0), "12.9", "2.5.0", ALL, "Float8CurrentScaling"),          # TE refuses MXFP8 on sm120
    ((12, 1), "13.0", "2.18.0", ALL, "Float8CurrentScaling"),
    ((8, 9), "12.4", "2.2.0", ALL, "Float8CurrentScaling"),
    ((10, 0), "12.8", "2.2.0", ("Float8CurrentScaling",), "Float8CurrentScaling"),
]


@pytest.mark.parametrize("cap,cuda,te_version,names,expected", RECIPES)
def test_te_recipe_table(cap, cuda, te_version, names, expected, monkeypatch):
    """The recipe _te_recipe builds when the device, CUDA and TE queries report these values."""
    import megak3.quant.te as te

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(te, "_te_version", lambda: te_version, raising=False)
    assert type(te._te_recipe(_recipes(*names))).__name__ == expected


def test_te_recipe_refuses_a_delayed_scaling_only_te(monkeypatch):
    import megak3.quant.te as te

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(te, "_te_version", lambda: "2.1.0", raising=False)
    with pytest.raises(ValueError, match="DelayedScaling") as e:
        te._te_recipe(_recipes())
    assert str(e.value) == te.TE_STATEFUL and "\n" not in te.TE_STATEFUL
