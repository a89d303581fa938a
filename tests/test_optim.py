"""Tests for megak3.optim: Newton–Schulz, Muon block rules, the Muon/AdamW split, state, schedules.

Every model here is a small synthetic nn.Module tree following docs/INTERFACES.md names; every
number is checked against an independent reference (SVD, a float64 hand step, a hand AdamW, a
hand-computed LR value).
"""
from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from megak3.optim import (Muon, OptimConfig, build_optimizer, classify_parameters, lr_at, set_lr,
                          zeropower_via_newtonschulz5)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- synthetic model


class RMSNorm(nn.Module):
    """Stand-in for megak3.model.norm.RMSNorm (detected by class name)."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class ShortConv(nn.Module):
    def __init__(self, channels, width=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, width))


class FakeKDA(nn.Module):
    def __init__(self, d, H, K):
        super().__init__()
        P = H * K
        self.num_heads = H
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, P, bias=False) for _ in range(3))
        self.q_conv1d = ShortConv(P)
        self.o_norm = RMSNorm(K)
        self.o_proj = nn.Linear(P, d, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(P))

    def per_head_params(self):
        return {"q_proj.weight": self.num_heads, "k_proj.weight": self.num_heads,
                "v_proj.weight": self.num_heads}


class FakeExperts(nn.Module):
    def __init__(self, E, m, L):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, m, L))
        self.w3 = nn.Parameter(torch.randn(E, m, L))
        self.w2 = nn.Parameter(torch.randn(E, L, m))


class FakeMoE(nn.Module):
    def __init__(self, d, E, m, L):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(E))  # buffer: not optimised
        self.routed_expert_down_proj = nn.Linear(d, L, bias=False)
        self.experts = FakeExperts(E, m, L)
        self.routed_expert_norm = RMSNorm(L)
        self.routed_expert_up_proj = nn.Linear(L, d, bias=False)


class FakeAttnRes(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = RMSNorm(d)
        self.proj = nn.Linear(d, 1, bias=False)


class FakeLayer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.attn_res, self.mlp_res = FakeAttnRes(d), FakeAttnRes(d)
        self.input_layernorm = RMSNorm(d)
        self.self_attn = FakeKDA(d, H=2, K=4)
        self.mlp = FakeMoE(d, E=3, m=6, L=5)


class Scale(nn.Module):
    """Not an RMSNorm class: caught by the ``norm.weight`` suffix rule instead."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class FakeVision(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, kernel_size=2, stride=2)  # 4-D weight + bias
        self.norm1 = RMSNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)                               # weight + bias
        self.frozen = nn.Linear(d, d, bias=False)
        self.frozen.weight.requires_grad_(False)


class FakeK3(nn.Module):
    def __init__(self, d=8, V=11):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, d)
        self.layers = nn.ModuleList([FakeLayer(d)])
        self.output_attn_res = FakeAttnRes(d)
        self.norm = Scale(d)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.vision = FakeVision(d)


def fill_grads(model: nn.Module, seed: int) -> None:
    g = gen(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=g)


# ----------------------------------------------------------------------------- Newton–Schulz

# Rectangular Gaussian matrices (aspect >= 2) are well conditioned, so 5 quintic steps bring every
# singular value into the iteration's oscillation band: measured [0.670, 1.144] in bf16 over 20
# seeds per shape (fp32: [0.682, 1.134]; KellerJordan quotes "~U(0.5, 1.5)"). Band [0.6, 1.25]
# keeps margin for bf16 rounding.
RECT_SHAPES = [(64, 32), (32, 64), (256, 64), (16, 512), (3, 48, 96), (2, 96, 40)]


@pytest.mark.parametrize("shape", RECT_SHAPES)
def test_ns5_singular_values_and_polar_direction(shape):
    G = torch.randn(shape, generator=gen(1))
    O = zeropower_via_newtonschulz5(G)
    assert O.shape == G.shape and O.dtype == torch.bfloat16
    S = torch.linalg.svdvals(O.float())
    assert S.min() > 0.6 and S.max() < 1.25, (S.min(), S.max())
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    P = U @ Vh  # exact polar factor
    cos = (O.float() * P).sum((-2, -1)) / (O.float().norm(dim=(-2, -1)) * P.norm(dim=(-2, -1)))
    assert cos.min() > 0.95, cos  # measured >= 0.983


def test_ns5_square_matrix_direction():
    # A square Gaussian has singular values near 0 that 5 steps cannot lift (the slope at 0 is
    # a = 3.4445, so at most 3.4445**5 ≈ 490x), hence only the upper bound and the direction.
    G = torch.randn(128, 128, generator=gen(2))
    O = zeropower_via_newtonschulz5(G, dtype=torch.float32)
    assert torch.linalg.svdvals(O).max() < 1.25
    U, _, Vh = torch.linalg.svd(G)
    assert (O * (U @ Vh)).sum() / (O.norm() * (U @ Vh).norm()) > 0.95


def test_ns5_batched_equals_per_matrix():
    G = torch.randn(4, 10, 7, generator=gen(3))
    O = zeropower_via_newtonschulz5(G, dtype=torch.float32)
    ref = torch.stack([zeropower_via_newtonschulz5(g, dtype=torch.float32) for g in G])
    torch.testing.assert_close(O, ref, rtol=0, atol=5e-6)  # fp32 summation order only


# ----------------------------------------------------------------------------- Muon rules


def ns5_float64(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Independent, unbatched float64 Newton–Schulz for one [A, B] matrix (spec §9.1)."""
    X = G.double()
    if X.shape[0] > X.shape[1]:
        return ns5_float64(G.T, steps).T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_hand_step_matches(nesterov):
    lr, wd, mu = 0.02, 0.1, 0.95
    W0 = torch.randn(12, 20, generator=gen(4))
    grads = [torch.randn(12, 20, generator=gen(5 + t)) for t in range(3)]
    p = nn.Parameter(W0.clone())
    opt = Muon([p], lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov, ns_dtype="float32")
    W, M = W0.double(), torch.zeros(12, 20, dtype=torch.float64)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        M = mu * M + g.double()
        u = g.double() + mu * M if nesterov else M
        W = W * (1 - lr * wd) - lr * 0.2 * math.sqrt(20) * ns5_float64(u)
    torch.testing.assert_close(p.detach().double(), W, rtol=0, atol=2e-6)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), M, rtol=0, atol=1e-5)


def test_per_head_muon_equals_blockwise_whole_matrix():
    H, r, d_in, lr, wd, mu = 4, 8, 24, 0.05, 0.1, 0.95
    W0 = torch.randn(H * r, d_in, generator=gen(10))
    grads = [torch.randn(H * r, d_in, generator=gen(11 + t)) for t in range(2)]
    per_head, whole = nn.Parameter(W0.clone()), nn.Parameter(W0.clone())
    opt_h = Muon([{"params": [per_head], "heads": [H]}], lr=lr, weight_decay=wd, ns_dtype="float32")
    opt_w = Muon([whole], lr=lr, weight_decay=wd, ns_dtype="float32")
    blocks = [W0[h * r:(h + 1) * r].clone() for h in range(H)]
    bufs = [torch.zeros(r, d_in) for _ in range(H)]
    for g in grads:
        per_head.grad, whole.grad = g.clone(), g.clone()
        opt_h.step()
        opt_w.step()
        for h in range(H):  # reference: whole-matrix Muon on each [r, in] block on its own
            g_h = g[h * r:(h + 1) * r]
            bufs[h] = mu * bufs[h] + g_h
            o_h = zeropower_via_newtonschulz5(g_h + mu * bufs[h], dtype=torch.float32)
            blocks[h] = blocks[h] * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(r, d_in)) * o_h
    torch.testing.assert_close(per_head.detach(), torch.cat(blocks), rtol=0, atol=1e-6)
    # Whole-matrix Muon orthogonalises across heads and scales by sqrt(max(32, 24)): clearly different.
    assert (per_head.detach() - whole.detach()).abs().max() > 1e-2


def test_experts_3d_equals_loop_over_experts():
    E, A, B, lr = 3, 10, 6, 0.05
    W0 = torch.randn(E, A, B, generator=gen(20))
    grads = [torch.randn(E, A, B, generator=gen(21 + t)) for t in range(2)]
    stacked = nn.Parameter(W0.clone())
    singles = [nn.Parameter(W0[e].clone()) for e in range(E)]
    opt_s = Muon([stacked], lr=lr, ns_dtype="float32")
    opt_l = Muon(singles, lr=lr, ns_dtype="float32")
    for g in grads:
        stacked.grad = g.clone()
        for e in range(E):
            singles[e].grad = g[e].clone()
        opt_s.step()
        opt_l.step()
    torch.testing.assert_close(stacked.detach(), torch.stack([s.detach() for s in singles]),
                               rtol=0, atol=1e-6)


def test_conv4d_is_flattened_to_out_by_fan_in():
    W0 = torch.randn(6, 3, 2, 2, generator=gen(30))
    g = torch.randn(6, 3, 2, 2, generator=gen(31))
    conv, flat = nn.Parameter(W0.clone()), nn.Parameter(W0.reshape(6, 12).clone())
    conv.grad, flat.grad = g.clone(), g.reshape(6, 12).clone()
    Muon([conv], ns_dtype="float32").step()
    Muon([flat], ns_dtype="float32").step()
    assert torch.equal(conv.detach().reshape(6, 12), flat.detach())


def test_muon_rejects_bad_heads():
    with pytest.raises(ValueError, match="heads=3"):
        Muon([{"params": [nn.Parameter(torch.zeros(8, 4))], "heads": [3]}])


# ----------------------------------------------------------------------------- classification


def test_classification_follows_naming_contract():
    specs = classify_parameters(FakeK3())
    by = {s.name: s for s in specs}
    muon = {n for n, s in by.items() if s.optimizer == "muon"}
    adamw_wd = {n for n, s in by.items() if s.optimizer == "adamw" and s.weight_decay}
    adamw_no = {n for n, s in by.items() if s.optimizer == "adamw" and not s.weight_decay}
    L = "layers.0."
    assert muon == {
        L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight",
        L + "self_attn.o_proj.weight", L + "mlp.gate.weight", L + "mlp.routed_expert_down_proj.weight",
        L + "mlp.experts.w1", L + "mlp.experts.w2", L + "mlp.experts.w3",
        L + "mlp.routed_expert_up_proj.weight", "vision.patch_embed.weight", "vision.fc1.weight"}
    assert all(by[n].weight_decay for n in muon)
    assert adamw_wd == {"embed_tokens.weight", "lm_head.weight"}
    assert adamw_no == {
        L + "attn_res.norm.weight", L + "attn_res.proj.weight", L + "mlp_res.norm.weight",
        L + "mlp_res.proj.weight", L + "input_layernorm.weight", L + "self_attn.q_conv1d.weight",
        L + "self_attn.o_norm.weight", L + "self_attn.A_log", L + "self_attn.dt_bias",
        L + "mlp.routed_expert_norm.weight", "output_attn_res.norm.weight",
        "output_attn_res.proj.weight", "norm.weight", "vision.patch_embed.bias",
        "vision.norm1.weight", "vision.fc1.bias"}
    assert "vision.frozen.weight" not in by  # frozen: skipped
    heads = {n for n, s in by.items() if s.heads is not None}
    assert heads == {L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight",
                     L + "self_attn.v_proj.weight"}
    assert {by[n].heads for n in heads} == {2}
    assert all(s.heads is None for s in classify_parameters(FakeK3(), per_head_muon=False))


def test_build_optimizer_groups_lr_and_summary():
    model = FakeK3()
    opt = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.2))
    assert {(type(o).__name__) for o in opt.optimizers} == {"Muon", "AdamW"}
    wds = sorted((type(o).__name__, g["weight_decay"], len(g["params"]))
                 for o in opt.optimizers for g in o.param_groups)
    assert wds == [("AdamW", 0.0, 16), ("AdamW", 0.2, 2), ("Muon", 0.2, 12)]
    s = opt.summary()
    assert (s["muon_per_head"], s["muon_experts"], s["muon_matrix"]) == (3, 3, 6)
    assert (s["adamw_decay"], s["adamw_no_decay"]) == (2, 16)
    assert s["muon_experts_numel"] == 3 * 3 * 6 * 5
    set_lr(opt, 4e-4)
    assert [g["lr"] for g in opt.param_groups] == [4e-4] * 3


def test_adamw_part_matches_hand_adamw():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8)
    model = FakeK3()
    opt = build_optimizer(model, cfg)
    names = ["embed_tokens.weight", "norm.weight", "layers.0.self_attn.A_log"]  # decay, no, no
    params = dict(model.named_parameters())
    ref = {n: (params[n].detach().double().clone(), 0.0, 0.0) for n in names}
    for t in range(1, 4):
        fill_grads(model, seed=40 + t)
        opt.step()
        for n, wd in zip(names, (0.1, 0.0, 0.0)):
            w, m, v = ref[n]
            g = params[n].grad.double()
            m, v = 0.9 * m + 0.1 * g, 0.95 * v + 0.05 * g * g
            w = w * (1 - cfg.lr * wd) - cfg.lr * (m / (1 - 0.9 ** t)) / ((v / (1 - 0.95 ** t)).sqrt() + 1e-8)
            ref[n] = (w, m, v)
    for n in names:
        torch.testing.assert_close(params[n].detach().double(), ref[n][0], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- state round trip


def test_state_dict_round_trip_is_bit_identical():
    torch.manual_seed(0)
    cfg = OptimConfig()
    a = FakeK3()
    opt_a = build_optimizer(a, cfg)
    for t in range(3):
        fill_grads(a, seed=100 + t)
        opt_a.step()
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    b = copy.deepcopy(a)
    b.load_state_dict(saved["model"])
    opt_b = build_optimizer(b, cfg)
    opt_b.load_state_dict(saved["optim"])
    fresh = copy.deepcopy(a)  # same weights, no optimizer state: must diverge (the test can fail)
    opt_fresh = build_optimizer(fresh, cfg)
    for t in range(3, 6):
        for m, o in ((a, opt_a), (b, opt_b), (fresh, opt_fresh)):
            fill_grads(m, seed=100 + t)
            o.step()
            o.zero_grad()
    pa, pb, pf = (dict(m.named_parameters()) for m in (a, b, fresh))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not all(torch.equal(pa[n], pf[n]) for n in pa)
    assert all(p.grad is None for p in a.parameters())


# ----------------------------------------------------------------------------- schedules


def test_cosine_schedule_values():
    cfg = OptimConfig(lr=2e-3, min_lr_ratio=0.1, warmup_steps=4, schedule="cosine")
    cfg.validate(max_steps=104)
    expect = {0: 2e-3 / 5, 3: 2e-3 * 4 / 5, 4: 2e-3,
              29: 2e-4 + 1.8e-3 * 0.5 * (1 + math.sqrt(0.5)),  # a quarter of the way: cos(π/4)
              54: 1.1e-3, 104: 2e-4, 500: 2e-4}
    for step, lr in expect.items():
        assert lr_at(step, cfg, 104) == pytest.approx(lr, rel=1e-12), step


def test_wsd_and_constant_schedule_values():
    wsd = OptimConfig(lr=2e-3, min_lr_ratio=0.1, warmup_steps=10, schedule="wsd", decay_fraction=0.2)
    wsd.validate(max_steps=100)
    expect = {0: 2e-3 / 11, 10: 2e-3, 50: 2e-3, 80: 2e-3, 90: 1.1e-3, 95: 6.5e-4, 100: 2e-4}
    for step, lr in expect.items():
        assert lr_at(step, wsd, 100) == pytest.approx(lr, rel=1e-12), step
    const = OptimConfig(lr=1e-3, warmup_steps=2, schedule="constant")
    assert [lr_at(s, const, 10) for s in (0, 1, 2, 9)] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])
    assert lr_at(0, OptimConfig(lr=1e-3, schedule="constant"), 10) == 1e-3


@pytest.mark.parametrize("field,value,max_steps,msg", [
    ("lr", -1, None, r"optim.lr=-1 must be in \(0, 1e\+06\]"),
    ("schedule", "linear", None, r"optim.schedule='linear'"),
    ("muon_momentum", 1.0, None, r"optim.muon_momentum=1.0"),
    ("grad_clip", -0.5, None, r"optim.grad_clip=-0.5"),
    ("warmup_steps", 10, 10, r"optim.warmup_steps=10 must be < train.max_steps=10"),
])
def test_validate_names_the_field(field, value, max_steps, msg):
    cfg = OptimConfig(**{field: value})
    with pytest.raises(ValueError, match=msg):
        cfg.validate(max_steps)


def test_validate_wsd_overlap():
    cfg = OptimConfig(schedule="wsd", warmup_steps=95, decay_fraction=0.1)
    with pytest.raises(ValueError, match="optim.decay_fraction"):
        cfg.validate(max_steps=100)


# ---- the device-side non-finite skip (found_inf, torch's GradScaler protocol) -------------------
def test_fused_adamw_matches_the_foreach_form():
    """build_optimizer's AdamW is fused (it reads found_inf on the device); it equals the foreach
    form up to fp32 rounding (measured: <= 6e-8 on unit-scale weights after 5 steps at lr 1e-2;
    not bitwise: the kernels order the update's operations differently)."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(256, 64))
    b = nn.Parameter(a.detach().clone())
    fused = torch.optim.AdamW([a], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    foreach = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    for s in range(5):
        g = torch.randn(256, 64, generator=gen(s))
        a.grad, b.grad = g.clone(), g.clone()
        fused.step()
        foreach.step()
    assert float((a - b).detach().abs().max()) <= 2e-7
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    assert build_optimizer(model, OptimConfig()).adamw.param_groups[0]["fused"] is True


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_found_inf_zero_is_bitwise_the_plain_step_and_one_changes_nothing(nesterov):
    torch.manual_seed(1)
    w = [nn.Parameter(torch.randn(24, 40)) for _ in range(2)]
    w[1].data.copy_(w[0].data)
    plain, flagged = (Muon([p], lr=0.02, nesterov=nesterov, ns_dtype="float32") for p in w)
    flagged.found_inf = torch.zeros(())
    for s in range(3):
        g = torch.randn(24, 40, generator=gen(10 + s))
        w[0].grad, w[1].grad = g.clone(), g.clone()
        plain.step()
        flagged.step()
    assert torch.equal(w[0], w[1])
    before, buf = w[1].detach().clone(), flagged.state[w[1]]["momentum_buffer"].clone()
    flagged.found_inf = torch.ones(())
    w[1].grad = torch.full_like(w[1], float("nan"))
    w[1].grad[0, 0] = float("inf")
    flagged.step()
    assert torch.equal(w[1], before) and torch.equal(flagged.state[w[1]]["momentum_buffer"], buf)


def test_skipped_step_is_bitwise_a_step_that_never_happened():
    """RankStep: a step whose gradients hold a NaN is skipped on the device (no host read) and
    leaves params, optimizer state and QB biases exactly as if it had not run: the run with the
    poisoned step in the middle ends bitwise equal to the run without it."""
    from megak3.train.step import RankStep
    from parallel.testing import PARITY_MODEL, global_batch, local_rows
    from megak3.train.parity import parity_job
    from parallel.state import ParallelState

    def run(poison: bool):
        torch.manual_seed(0)
        job = parity_job(1, 1, False, dict(PARITY_MODEL), 2, 32, 5, 1e-3, 4)
        rs = RankStep(job, ParallelState.single(), "cpu", grad_accum=1)
        out = []
        for i in ([0, 1, 2] if poison else [0, 2]):
            ids, labels, _ = global_batch(i, 2, 32, job.model.vocab_size)
            ids, labels, cu = local_rows(ids, labels, 0, 1)
            rs.accumulate([{"input_ids": ids, "labels": labels, "cu_seqlens": cu}])
            if i == 1:
                next(p for p in rs.model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
            out.append(bool(rs.apply(i, 4)["skipped"]))
        state = {n: t.detach().clone() for n, t in rs.model.state_dict().items()}
        opt = [copy.deepcopy(o.state_dict()["state"]) for o in rs.optimizer.optimizers]
        return out, state, opt

    flags, state, opt = run(True)
    assert flags == [False, True, False]
    ref_flags, ref_state, ref_opt = run(False)
    assert ref_flags == [False, False]
    assert state.keys() == ref_state.keys()
    assert all(torch.equal(state[k], ref_state[k]) for k in state), \
        [k for k in state if not torch.equal(state[k], ref_state[k])]
    for a, b in zip(opt, ref_opt):
        for k in a:
            for key in a[k]:
                assert torch.equal(a[k][key], b[k][key]), (k, key)
