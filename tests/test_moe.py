"""Router, GroupedExperts and Stable LatentMoE against the K3_SPEC.md §14 reference loop."""
import copy

import pytest
import torch
from torch.func import functional_call

from megak3.config import ModelConfig, MoEConfig
from megak3.model.init import init_model
from megak3.model.moe import GroupedExperts, LatentMoE, MoEStats, permute, unpermute
from megak3.model.router import Router

B1, B2 = 4.0, 25.0


# ---- independent references (written from the spec, not from the implementation) -------------

def ref_situ_glu(g, u):
    return B1 * torch.tanh(g / B1) * torch.sigmoid(g) * (B2 * torch.tanh(u / B2))


def ref_route(x, W, bias, k, scale=1.0):
    s = torch.sigmoid(x.double() @ W.double().T).to(torch.promote_types(x.dtype, torch.float32))
    idx = (s + bias[None]).topk(k, dim=-1).indices
    w = s.gather(1, idx)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scale, idx, s


def ref_latent_moe(moe: LatentMoE, x, k):
    """§14 latent_moe: per-expert loop with index_add; router weight after the expert down-proj."""
    p = dict(moe.named_parameters())
    s = torch.sigmoid(x @ p["gate.weight"].T)
    idx = (s + moe.gate.e_score_correction_bias[None]).topk(k, dim=-1).indices
    w = s.gather(1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    z = x @ p["routed_expert_down_proj.weight"].T
    u = torch.zeros_like(z)
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        ze = z[tok]
        h = ref_situ_glu(ze @ p["experts.w1"][e].T, ze @ p["experts.w3"][e].T)
        u.index_add_(0, tok, (h @ p["experts.w2"][e].T) * w[tok, slot, None])
    if "routed_expert_norm.weight" in p:
        u = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-5) * p["routed_expert_norm.weight"]
    y = u @ p["routed_expert_up_proj.weight"].T
    if "shared_experts.gate_proj.weight" in p:
        h = ref_situ_glu(x @ p["shared_experts.gate_proj.weight"].T, x @ p["shared_experts.up_proj.weight"].T)
        y = y + h @ p["shared_experts.down_proj.weight"].T
    return y, s, torch.bincount(idx.reshape(-1), minlength=moe.num_experts)


def small_cfg(**moe_kw):
    kw = dict(num_experts=8, top_k=3, num_shared_experts=2, expert_intermediate_size=16, latent_size=16)
    kw.update(moe_kw)
    return ModelConfig(hidden_size=32, moe=MoEConfig(**kw))


# ---- router -----------------------------------------------------------------------------------

def _router(scale=1.0, seed=0):
    torch.manual_seed(seed)
    r = Router(24, 10, 3, routed_scaling_factor=scale)
    r.weight.data.normal_(0, 0.5)
    return r, torch.randn(40, 24)


def test_router_matches_reference_and_sums_to_scale():
    r, x = _router(scale=2.5)
    r.e_score_correction_bias.normal_(0, 0.3)
    out = r(x)
    assert out.weights_TK.dtype == torch.float32 and out.indices_TK.dtype == torch.int64
    w, idx, s = ref_route(x, r.weight, r.e_score_correction_bias, 3, 2.5)
    assert torch.allclose(out.scores_TE, s, atol=1e-6)
    assert torch.equal(out.indices_TK.sort(-1).values, idx.sort(-1).values)
    order = out.indices_TK.argsort(-1)  # compare weights slot-aligned
    assert torch.allclose(out.weights_TK.gather(1, order), w.gather(1, idx.argsort(-1)), atol=1e-6)
    assert torch.allclose(out.weights_TK.sum(-1), torch.full((40,), 2.5), atol=1e-6)


def test_router_bias_changes_selection_not_weights():
    r, x = _router()
    base = r(x)
    r.e_score_correction_bias.fill_(0.7)  # a common shift keeps every top-k set
    shifted = r(x)
    assert torch.equal(shifted.indices_TK, base.indices_TK) and torch.equal(shifted.weights_TK, base.weights_TK)
    r.e_score_correction_bias.zero_()
    r.e_score_correction_bias[4] = 10.0  # forces expert 4 into every token's set
    forced = r(x)
    assert (forced.indices_TK == 4).any(-1).all()
    assert not torch.equal(forced.indices_TK.sort(-1).values, base.indices_TK.sort(-1).values)
    s = torch.sigmoid(x @ r.weight.T)  # the weights are the unbiased scores of the chosen experts
    picked = s.gather(1, forced.indices_TK)
    assert torch.allclose(forced.weights_TK, picked / picked.sum(-1, keepdim=True), atol=1e-6)
    forced.weights_TK.sum().backward()
    assert r.weight.grad is not None and r.e_score_correction_bias.grad is None


def test_router_bias_is_fp32_persistent_buffer():
    r, _ = _router()
    assert "e_score_correction_bias" in r.state_dict()
    assert all(n != "e_score_correction_bias" for n, _ in r.named_parameters())
    r.e_score_correction_bias.fill_(1e-4)
    r.to(torch.bfloat16)
    assert r.weight.dtype == torch.bfloat16 and r.e_score_correction_bias.dtype == torch.float32
    assert r.e_score_correction_bias[0].item() == pytest.approx(1e-4, rel=1e-6)


def test_router_gradcheck_float64():
    r, x = _router()
    r.e_score_correction_bias.normal_(0, 0.2)
    x = x[:6].double()
    W = r.weight.detach().double()[:, :].clone().requires_grad_()
    xg = x.clone().requires_grad_()
    f = lambda W_, x_: functional_call(r, {"weight": W_}, (x_,)).weights_TK
    assert f(W, xg).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (W, xg))


def test_router_bad_args():
    with pytest.raises(ValueError, match="top_k"):
        Router(8, 4, 5)
    r, _ = _router()
    with pytest.raises(ValueError, match=r"\[T, 24\]"):
        r(torch.randn(2, 3, 24))


# ---- permute / experts --------------------------------------------------------------------------

def test_permute_unpermute_roundtrip():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2]])
    order, tok, counts = permute(idx, 4)
    assert counts.tolist() == [2, 1, 3, 0]
    assert idx.reshape(-1)[order].tolist() == [0, 0, 1, 2, 2, 2]
    assert tok.tolist() == [0, 2, 1, 0, 1, 2]  # stable: token order inside each expert
    z = torch.randn(3, 5)
    w = torch.rand(3, 2)
    u = unpermute(z[tok] * 2.0, order, w)  # "expert" = doubling
    assert torch.allclose(u, 2.0 * z * w.sum(-1, keepdim=True))


def ref_experts(ge: GroupedExperts, z, counts):
    """Row-by-row reference: gather each row's expert weights and apply SiTU-GLU."""
    e_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    g = torch.einsum("xml,xl->xm", ge.w1[e_of_row], z)
    u = torch.einsum("xml,xl->xm", ge.w3[e_of_row], z)
    return torch.einsum("xlm,xm->xl", ge.w2[e_of_row], ref_situ_glu(g, u))


@pytest.mark.parametrize("counts", [[3, 0, 5, 0, 1, 2], [0, 0, 11, 0, 0, 0], [0] * 6, [1, 1, 1, 1, 1, 1]])
@pytest.mark.parametrize("use_gmm", [False, True])
def test_grouped_experts_vs_rowwise(counts, use_gmm):
    torch.manual_seed(0)
    ge = GroupedExperts(6, 16, 8)
    for p in ge.parameters():
        p.data.normal_(0, 0.4)
    ge.use_grouped_mm = use_gmm  # torch 2.13 runs grouped_mm on CPU for fp32; compare it to the loop
    counts = torch.tensor(counts)
    z = torch.randn(int(counts.sum()), 16, requires_grad=True)
    y = ge(z, counts)
    y_ref = ref_experts(ge, z, counts)
    assert y.shape == (z.shape[0], 16)
    assert torch.allclose(y, y_ref, atol=1e-5)
    y.sum().backward()  # an expanded gradient: the grouped_mm path must cope
    grads = [t.grad.clone() for t in (z, *ge.parameters())]
    for t in (z, *ge.parameters()):
        t.grad = None
    y_ref.sum().backward()
    for a, t in zip(grads, (z, *ge.parameters())):
        assert torch.allclose(a, t.grad, atol=1e-5)


def test_grouped_experts_bad_counts_shape():
    ge = GroupedExperts(4, 8, 8)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        ge(torch.randn(3, 8), torch.tensor([3, 0]))


# ---- LatentMoE ----------------------------------------------------------------------------------

def _moe(cfg, seed=0):
    moe = LatentMoE(cfg)
    init_model(moe, seed=seed, std=0.3)
    moe.routed_expert_norm is not None and moe.routed_expert_norm.weight.data.uniform_(0.5, 1.5)
    moe.gate.e_score_correction_bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return moe


@pytest.mark.parametrize("moe_kw", [{}, dict(use_latent_norm=False, num_shared_experts=0), dict(top_k=1)])
def test_latent_moe_matches_reference(moe_kw):
    cfg = small_cfg(**moe_kw)
    moe = _moe(cfg)
    names = [n for n, _ in moe.named_parameters()]
    assert ("shared_experts.gate_proj.weight" in names) == (cfg.moe.num_shared_experts > 0)
    assert moe.shared_experts is None or moe.shared_experts.gate_proj.weight.shape == (32, 32)  # 2 * m wide
    torch.manual_seed(1)
    x = torch.randn(37, 32, requires_grad=True)
    y, stats = moe(x)
    y_ref, s_ref, counts_ref = ref_latent_moe(moe, x, cfg.moe.top_k)
    assert isinstance(stats, MoEStats) and not stats.scores_TE.requires_grad
    assert torch.allclose(y, y_ref, atol=1e-5, rtol=1e-5)
    assert torch.allclose(stats.scores_TE, s_ref, atol=1e-6)
    assert torch.equal(stats.tokens_per_expert_E, counts_ref) and stats.tokens_per_expert_E.dtype == torch.int64
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *moe.parameters()], dy)
    want = torch.autograd.grad(y_ref, [x, *moe.parameters()], dy)
    for n, a, b in zip(["x", *names], got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), n


@pytest.mark.parametrize("T", [0, 1, 2])
def test_latent_moe_few_tokens(T):
    moe = _moe(small_cfg())
    x = torch.randn(T, 32, requires_grad=True)
    y, stats = moe(x)
    assert y.shape == (T, 32) and stats.tokens_per_expert_E.sum().item() == 3 * T
    if T:
        assert torch.allclose(y, ref_latent_moe(moe, x, 3)[0], atol=1e-5)
    y.sum().backward()
    assert moe.experts.w1.grad is not None  # zero, not None, even without tokens


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def test_latent_moe_bf16_runs_with_fp32_bias():
    """bf16 weights and input: the output and every gradient against the fp32 reference on the same
    (bf16-valued) weights and input, within bf16 rounding, with the same routing."""
    moe = _moe(small_cfg()).to(torch.bfloat16)
    ref = copy.deepcopy(moe).float()
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(3)).bfloat16().requires_grad_()
    x32 = x.detach().float().requires_grad_()
    y, stats = moe(x)
    assert y.dtype == torch.bfloat16 and stats.scores_TE.dtype == torch.float32
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    y_ref, _, counts_ref = ref_latent_moe(ref, x32, 3)
    assert torch.equal(stats.tokens_per_expert_E, counts_ref)            # routing agrees
    assert _rel(y.float(), y_ref) < 1e-2                                  # bf16: 8 mantissa bits
    dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad(y, [x, *moe.parameters()], dy.bfloat16())
    want = torch.autograd.grad(y_ref, [x32, *ref.parameters()], dy)
    names = ["x"] + [n for n, _ in moe.named_parameters()]
    for n, a, b in zip(names, got, want):
        assert a.dtype == (torch.bfloat16 if n == "x" else moe.get_parameter(n).dtype), n
        assert _rel(a.float(), b) < 2e-2, (n, _rel(a.float(), b))
