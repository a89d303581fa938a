"""The expert GEMM without a Python loop: grouped_mm and the fixed-shape tiled twin against the loop.

Unit cases: every implementation of ``grouped_linear`` against the per-expert loop (outputs and
gradients of x and w), fp32 and fp64 (tiled only: grouped_mm has no fp64), empty groups, no rows,
and bf16 under CPU autocast with fp32 masters. Layer cases: one LatentMoE (ep=1) and two chained
LatentMoE layers under MoonEP at ep 2/4/8 on 8 gloo ranks, the automatic path (grouped_mm on CPU)
against the same layers forced to the loop, outputs and every gradient within the EP parity
tolerance (1e-5 relative).
"""
import pytest
import torch
import torch.distributed as dist

from megak3.config import load_model_config
from megak3.model.moe import LatentMoE, count_per_expert
from megak3.ops.grouped_gemm import grouped_linear, grouped_weight_grad, pick_impl
from moonep.buffers import BufferPool
from moonep.config import MoonEPConfig
from parallel.expert_parallel import full_expert_tensor, parallelize_ep
from parallel.testing import PARITY_MODEL, run_distributed
from test_moonep_dispatch import _expert_groups  # (ep, edp) groups from init_parallel at dp = world
from test_moonep_dispatch import _run_layers  # forward through the layers, backward of (h * w).sum()

RTOL = 1e-5
COUNTS = [[3, 0, 5, 0, 1, 2], [0, 0, 11, 0, 0, 0], [1, 1, 1, 1, 1, 1], [7, 0, 0, 0, 0, 9], [0] * 6]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def _run(impl, x, w, counts, dy):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = grouped_linear(x, w, counts, impl)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("impl,dtype", [("grouped_mm", torch.float32), ("tiled", torch.float32),
                                        ("tiled", torch.float64)])
def test_impl_matches_loop(counts, impl, dtype):
    g = torch.Generator().manual_seed(sum(counts))
    counts = torch.tensor(counts)
    X, I, O = int(counts.sum()), 12, 20
    x = torch.randn(X, I, generator=g, dtype=dtype)
    w = torch.randn(6, O, I, generator=g, dtype=dtype)
    dy = torch.randn(X, O, generator=g, dtype=dtype)
    ref = _run("loop", x, w, counts, dy)
    got = _run(impl, x, w, counts, dy)
    tol = 1e-12 if dtype == torch.float64 else RTOL
    for name, a, b in zip(("y", "x.grad", "w.grad"), got, ref):
        assert a.dtype == dtype and a.shape == b.shape, name
        assert _rel(a, b) <= tol, (name, _rel(a, b))
    if X == 0:
        assert got[2] is not None and float(got[2].abs().sum()) == 0.0  # zero grads, not None


def test_auto_choice_and_counts():
    x32, w32 = torch.randn(4, 8), torch.randn(2, 8, 8)
    assert pick_impl(x32, w32) == "grouped_mm"                       # CPU fp32: torch's grouped GEMM
    assert pick_impl(x32.double(), w32.double()) == "tiled"          # no fp64 grouped_mm
    assert pick_impl(x32[:0], w32) == "tiled"                        # its backward rejects no rows
    assert pick_impl(x32, w32, False) == "loop" and pick_impl(x32, w32, True) == "grouped_mm"
    with pytest.raises(ValueError, match="impl="):
        pick_impl(x32, w32, "fast")
    idx = torch.tensor([[2, 0], [2, 1], [0, 2]])
    assert count_per_expert(idx, 5).tolist() == torch.bincount(idx.reshape(-1), minlength=5).tolist()


def test_autocast_bf16_with_fp32_masters():
    """fp32 masters under CPU autocast: bf16 compute through grouped_mm, close to the fp32 loop."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 9, 2])
    x = torch.randn(16, 32, generator=g)
    w = torch.randn(4, 24, 32, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_linear(x, w, counts)
        y_loop = grouped_linear(x, w, counts, "loop")
    assert y.dtype == torch.bfloat16 == y_loop.dtype
    # the reference: fp32 per-group GEMMs on the bf16-rounded operands; bf16 output rounding ~2^-9
    xr, wr = x.bfloat16().float(), w.detach().bfloat16().float()
    groups = torch.repeat_interleave(torch.arange(4), counts)
    y_ref = torch.einsum("ti,toi->to", xr, wr[groups])
    assert _rel(y.detach().float(), y_ref) < 4e-3 and _rel(y_loop.detach().float(), y_ref) < 4e-3
    dy = torch.randn(y.shape, generator=g)
    y.float().backward(dy)
    # dW[e] = dy_e^T x_e over the group's rows (the gradient reaches the fp32 master in fp32)
    gw_ref = torch.zeros_like(wr).index_add_(0, groups, dy.bfloat16().float()[:, :, None] * xr[:, None, :])
    assert w.grad.dtype == torch.float32 and _rel(w.grad, gw_ref) < 1e-2
    assert w.grad[1].abs().sum() == 0                                 # the empty group


# ---- layers ----------------------------------------------------------------------------------

T_LOC = 16
SKEW = [0.12, 0.09, 0.06, 0.0, 0.0, 0.0, 0.0, 0.0]   # forces MoonEP replicas


def _layers(impl):
    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    out = []
    for seed in (11, 12):
        torch.manual_seed(seed)
        moe = LatentMoE(cfg)
        moe.gate.e_score_correction_bias.copy_(torch.tensor(SKEW))
        moe.experts.use_grouped_mm = impl
        out.append(moe)
    return out, cfg


def test_layer_ep1_grouped_vs_loop():
    res = {}
    for impl in (None, "loop"):
        layers, cfg = _layers(impl)
        g = torch.Generator().manual_seed(3)
        x, w = torch.randn(64, cfg.hidden_size, generator=g), torch.randn(64, cfg.hidden_size, generator=g)
        y, gx = _run_layers(layers, x, w)
        res[impl] = [y, gx] + [p.grad for m in layers for p in m.parameters()]
    for a, b in zip(res[None], res["loop"]):
        assert _rel(a, b) <= RTOL


def _ep_cases(rank, world, eps):
    out = {}
    for ep in eps:
        groups = dict(zip(("ep", "edp"), _expert_groups(world, ep)))  # the production init_parallel
        res = {}
        for impl in (None, "loop"):
            layers, cfg = _layers(impl)
            plans = [parallelize_ep(m, groups["ep"], MoonEPConfig(), pool=BufferPool()) for m in layers]
            g = torch.Generator().manual_seed(3 + rank)
            x, w = torch.randn(T_LOC, cfg.hidden_size, generator=g), torch.randn(T_LOC, cfg.hidden_size, generator=g)
            y, gx = _run_layers(layers, x, w)
            grads = []
            for m, plan in zip(layers, plans):
                for n, p in m.named_parameters():
                    gr = p.grad.clone()
                    if n.startswith("experts."):
                        if groups["edp"] is not None:
                            dist.all_reduce(gr, group=groups["edp"])
                        gr = full_expert_tensor(gr, plan)
                    else:
                        dist.all_reduce(gr)
                    grads.append(gr)
            replicas = sum(d.last["num_replicas"] for p in plans for d in p.dispatchers)
            res[impl] = ([y, gx] + grads, replicas)
        errs = [_rel(a, b) for a, b in zip(res[None][0], res["loop"][0])]
        out[ep] = (max(errs), res[None][1])
    return out


def test_moonep_grouped_vs_loop_ep_2_4_8():
    res = run_distributed(_ep_cases, 8, (2, 4, 8), timeout_s=600)
    for rank_res in res:
        for ep, (err, _) in rank_res.items():
            assert err <= RTOL, (ep, err)
    assert sum(r[1] for r in res[0].values()) > 0, "the skewed routing never produced a replica"


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("impl,I", [("grouped_mm", 12), ("grouped_mm", 6), ("tiled", 12), (None, 12)])
def test_grouped_weight_grad_matches_autograd_of_the_loop(counts, impl, I):
    """grouped_weight_grad (the deferred W of zero-bubble pipelines) equals the weight gradient
    autograd gives the loop twin; I=6 (24-byte rows) cannot take grouped_mm and falls back to tiled."""
    g = torch.Generator().manual_seed(7 + sum(counts))
    counts = torch.tensor(counts)
    X, O = int(counts.sum()), 20
    x = torch.randn(X, I, generator=g)
    w = torch.randn(6, O, I, generator=g)
    dy = torch.randn(X, O, generator=g)
    ref = _run("loop", x, w, counts, dy)[2]
    got = grouped_weight_grad(x, dy, counts, 6, impl)
    assert got.shape == ref.shape and _rel(got, ref) <= RTOL, _rel(got, ref)


def test_deferred_grouped_gemm_has_no_host_sync():
    """Under a zero-bubble capture the routed-expert GEMM's B and W read no device value on the
    host (they read the counts with .tolist() before)."""
    from test_host_syncs import HostSyncSpy

    from megak3.ops.weight_grad import WeightGradStore

    g = torch.Generator().manual_seed(3)
    counts = torch.tensor([3, 0, 5, 0, 1, 2])
    x = torch.randn(11, 12, generator=g, requires_grad=True)
    w = torch.randn(6, 20, 12, generator=g, requires_grad=True)
    ref = torch.autograd.grad(grouped_linear(x, w, counts, "loop").pow(2).sum(), w)[0]
    for impl in ("grouped_mm", "tiled"):
        w.grad = None
        store, spy = WeightGradStore(), HostSyncSpy()
        with spy, store.capture():
            loss = grouped_linear(x, w, counts, impl).pow(2).sum()
            store.key = 0
            loss.backward()
            assert w.grad is None
            store.flush(0)
        assert spy.events == [], spy.events
        assert _rel(w.grad, ref) <= RTOL
