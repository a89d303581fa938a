"""K3-style QAT (megak3/quant/qat.py) and the FP8 dense-linear paths (megak3/quant/te.py), each against an
explicitly fake-quantized independent computation. The MXFP4 export of a QAT model (tools/convert_hf.py)
is tested in tests/test_hf_interop.py."""

import contextlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.model.k3 import build_model
from megak3.model.moe import GroupedExperts
from megak3.ops.situ import situ_glu
from megak3.quant import QuantConfig, apply_quantization
from megak3.quant.qat import MXFakeQuant, expert_modules, set_expert_qat
from megak3.quant.te import MXFP8Linear, TE_MISSING, dense_linear_names, te_available
from test_mx import ref_quantize

FP4, FP8 = "fp4_e2m1", "fp8_e4m3"
QAT = QuantConfig(qat="mxfp4_experts")


def fq(x, fmt, mode="floor"):
    """Fake quantization by the independent reference: tests/test_mx.py's NumPy implementation of the
    OCP MX rule (float64, blocks of 32 along the last dim; it shares no code with megak3/quant/mx.py)."""
    deq = ref_quantize(x.detach().double().numpy(), fmt, mode)[2]
    return torch.from_numpy(deq).reshape(x.shape).to(x.dtype)


def ste(x, fmt, mode="floor"):
    """fq(x) in the forward, the identity in the backward (straight-through)."""
    return x + (fq(x, fmt, mode) - x).detach()


def small_model(seed=0, **over):
    return build_model(load_model_config("k3_tiny", **{**SMALL_MODEL, **over}), seed=seed)


def tokens(seed=0, B=2, T=32, V=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, V, (B, T), generator=g)


# ---- GroupedExperts under QAT ----------------------------------------------------------------

def _experts_case(mode="floor"):
    torch.manual_seed(0)
    ex = GroupedExperts(num_experts=4, latent_size=64, intermediate_size=96)
    ex.use_grouped_mm = False
    set_expert_qat(ex, True, mode)
    counts = torch.tensor([7, 0, 20, 13])
    z = (torch.randn(int(counts.sum()), 64) * 3).requires_grad_()
    return ex, z, counts


def _explicit_forward(W1, W3, W2, Z, counts, hq_leaf=None, mode="floor"):
    """Per-expert loop on given (already quantized) tensors; returns (y, h, Hq)."""
    outs_h, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows = Z[start:start + n]; start += n
        outs_h.append(situ_glu(rows @ W1[e].T, rows @ W3[e].T))
    h = torch.cat(outs_h)
    Hq = fq(h.detach(), FP8, mode).requires_grad_() if hq_leaf is None else hq_leaf
    ys, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            ys.append(Hq[start:start + n] @ W2[e].T)
        start += n
    return torch.cat(ys), h, Hq


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_qat_forward_matches_explicit_fake_quant(mode):
    ex, z, counts = _experts_case(mode)
    y = ex(z, counts)
    W1, W3, W2 = (fq(w.detach(), FP4, mode) for w in (ex.w1, ex.w3, ex.w2))
    y_ref, _, _ = _explicit_forward(W1, W3, W2, fq(z.detach(), FP8, mode), counts, mode=mode)
    assert torch.equal(y, y_ref)
    assert not torch.equal(y, GroupedExperts.forward(_plain(ex), z, counts))   # QAT does something


def _plain(ex):
    """A hook-free copy sharing ex's parameters."""
    twin = GroupedExperts(ex.num_experts, ex.w1.shape[2], ex.w1.shape[1])
    twin.w1, twin.w3, twin.w2 = ex.w1, ex.w3, ex.w2
    twin.use_grouped_mm = False
    return twin


def test_qat_gradients_are_straight_through():
    """d/d(master) == d/d(quantized tensor) of the explicitly fake-quantized graph."""
    ex, z, counts = _experts_case()
    G = torch.randn(z.shape[0], 64)
    (ex(z, counts) * G).sum().backward()
    leaves = [fq(w.detach(), FP4).requires_grad_() for w in (ex.w1, ex.w3, ex.w2)]
    Zq = fq(z.detach(), FP8).requires_grad_()
    y, h, Hq = _explicit_forward(*leaves, Zq, counts)
    gW2, gHq = torch.autograd.grad((y * G).sum(), (leaves[2], Hq))
    gW1, gW3, gZ = torch.autograd.grad(h, (leaves[0], leaves[1], Zq), gHq)   # STE through fq(h)
    for got, want in ((ex.w1.grad, gW1), (ex.w3.grad, gW3), (ex.w2.grad, gW2), (z.grad, gZ)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert ex.w1.dtype == torch.float32                                      # masters stay fp32


def test_expert_weight_error_within_format_bounds():
    """Worst case: every MXFP4 element is within amax_block/4 of its input (FLOOR: amax in [4X, 8X),
    grid half-gaps <= X, saturation (6X, 8X) -> 6X loses < amax/4). Typical: E2M1 has 1 mantissa bit,
    relative rounding error ~U(+-1/4) of a value -> RMS ~ 0.25/sqrt(3) = 0.144 for values in the normal
    range; near-zero values cost less in norm, so Gaussian weights land below 0.144."""
    m = small_model()
    apply_quantization(m, QAT)
    for ex in expert_modules(m):
        for w in (ex.w1, ex.w3, ex.w2):
            w = w.detach()
            err = ex.weight_quant(w) - w
            amax = w.reshape(*w.shape[:-1], -1, 32).abs().amax(-1, keepdim=True)
            assert (err.reshape(amax.shape[:-1] + (32,)).abs() <= amax / 4).all()
            assert (err.norm() / w.norm()).item() < 0.144
            # MXFP8 (3 mantissa bits): the same argument gives 2^-4/sqrt(3) = 0.036
            assert ((ex.act_quant(w) - w).norm() / w.norm()).item() < 0.036


# ---- the whole model -------------------------------------------------------------------------

def _capture(model, names):
    out = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda mod, inp, o, n=n: out.__setitem__(n, (o[0] if isinstance(o, tuple) else o).detach().clone()))
        for n in names]
    return out, hooks


def test_switching_qat_on_changes_only_the_experts():
    m = small_model()
    x = tokens()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    names = ["layers.0.self_attn", "layers.0.mlp", "layers.1.self_attn", "layers.1.mlp.gate",
             "layers.1.mlp.routed_expert_down_proj", "layers.1.mlp.shared_experts", "layers.1.mlp.experts"]
    ref, hooks = _capture(m, names)
    with torch.no_grad():
        logits_fp = m(x).logits
    for h in hooks:
        h.remove()
    apply_quantization(m, QAT)                        # switch on an existing (e.g. resumed) model
    got, hooks = _capture(m, names)
    ex = m.get_submodule("layers.1.mlp.experts")
    seen = {}
    hooks.append(ex.register_forward_hook(lambda mod, inp, out: seen.update(z=inp[0].detach(), counts=inp[1])))
    with torch.no_grad():
        logits_q = m(x).logits
    for n in names[:-1]:
        assert torch.equal(got[n], ref[n]), n         # upstream of the first experts: bit-identical
    # the experts' output is the explicitly fake-quantized computation on the inputs they were given
    W1, W3, W2 = (fq(w.detach(), FP4) for w in (ex.w1, ex.w3, ex.w2))
    want, _, _ = _explicit_forward(W1, W3, W2, fq(seen["z"], FP8), seen["counts"])
    torch.testing.assert_close(got["layers.1.mlp.experts"], want, rtol=1e-5, atol=1e-6)
    rel = ((got["layers.1.mlp.experts"] - ref["layers.1.mlp.experts"]).norm()
           / ref["layers.1.mlp.experts"].norm()).item()
    assert rel > 1e-3                                 # and QAT changed it
    assert not torch.equal(logits_q, logits_fp)
    assert m.state_dict().keys() == before.keys()     # checkpoints stay interchangeable
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    for h in hooks:
        h.remove()
    apply_quantization(m, QuantConfig())              # and off again: back to the exact fp forward
    with torch.no_grad():
        assert torch.equal(m(x).logits, logits_fp)


def _train(model, steps=12, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = tokens(seed, B=4, T=32)
    losses = []
    for _ in range(steps):
        loss = model(x[:, :-1], labels=x[:, 1:]).loss
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
    return losses


def test_short_qat_run_learns_and_tracks_full_precision():
    fp = _train(small_model(seed=3))
    q = _train(apply_quantization(small_model(seed=3), QAT))
    assert q[0] == pytest.approx(fp[0], rel=1e-2)     # same init, QAT barely moves the start
    assert q[-1] < 0.8 * q[0]                         # it learns (memorises the fixed batch)
    assert abs(q[-1] - fp[-1]) < 0.1 * fp[-1]         # and stays close to the fp32 run
    assert q != fp                                    # but QAT really was active


def test_qat_config_errors_name_the_field():
    with pytest.raises(ValueError, match="quant.qat='mxfp4'"):
        QuantConfig(qat="mxfp4").validate()
    with pytest.raises(ValueError, match="quant.fp8"):
        QuantConfig(fp8="fp8").validate()
    m = small_model(**{"moe.latent_size": 48})
    with pytest.raises(ValueError, match="model.moe.latent_size=48"):
        apply_quantization(m, QAT)


def test_hooks_are_picklable_callables():
    import pickle

    q = MXFakeQuant(FP4, 32, "rceil")
    assert pickle.loads(pickle.dumps(q)) == q and "rceil" in repr(q)


# ---- FP8 dense linears -----------------------------------------------------------------------

def test_fp8_emulate_converts_exactly_the_dense_linears():
    m = small_model()
    x = tokens()
    with torch.no_grad():
        ref = m(x).logits
    params = dict(m.named_parameters())
    apply_quantization(m, QuantConfig(fp8="emulate"))
    names = dense_linear_names(m)
    kinds = {n.split(".", 2)[2] for n in names}
    # attention (KDA + MLA), dense FFN, shared experts, latent projections ...
    assert {"self_attn.q_proj", "self_attn.o_proj", "self_attn.q_a_proj", "self_attn.q_b_proj",
            "mlp.gate_proj", "mlp.down_proj", "mlp.shared_experts.up_proj",
            "mlp.routed_expert_down_proj", "mlp.routed_expert_up_proj"} <= kinds
    # ... but not the AttnRes queries, the per-head beta projection [H, D] or misaligned low-rank ones
    # (kv_b_proj has in=kv_lora_rank=16 here, not one 32-block)
    assert not kinds & {"attn_res.proj", "mlp_res.proj", "self_attn.b_proj", "self_attn.kv_b_proj"}
    assert all(isinstance(m.get_submodule(n), MXFP8Linear) for n in names)
    assert type(m.lm_head) is torch.nn.Linear and type(m.layers[0].self_attn.b_proj) is torch.nn.Linear
    assert all(p is params[k] for k, p in m.named_parameters())          # same Parameter objects
    lin = m.get_submodule(names[0])
    a = torch.randn(5, lin.in_features)
    assert torch.equal(lin(a), F.linear(fq(a, FP8), fq(lin.weight.detach(), FP8)))
    out = m(x).logits
    # the whole model against a copy whose same linears compute F.linear(fq(x), fq(W)) by the NumPy
    # reference, straight-through: logits and every gradient
    twin = small_model()
    for n in names:
        twin_lin = twin.get_submodule(n)
        twin_lin.forward = lambda a, l=twin_lin: F.linear(ste(a, FP8), ste(l.weight, FP8), l.bias)
    want = twin(x).logits
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert ((out - ref).norm() / ref.norm()).item() > 0.01       # and FP8 changed them
    out.float().square().mean().backward()
    want.float().square().mean().backward()
    grads = dict(twin.named_parameters())
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads[k].grad, rtol=1e-4, atol=1e-6, msg=k)
    assert lin.weight.grad.abs().sum() > 0
    apply_quantization(m, QuantConfig())                                  # revert
    assert not any(isinstance(mod, MXFP8Linear) for mod in m.modules())
    with torch.no_grad():
        assert torch.equal(m(x).logits, ref)


def test_fp8_te_without_te_or_cuda_raises_clearly(monkeypatch):
    """Runs everywhere: whatever Transformer Engine this machine has is hidden."""
    from megak3.quant.te import fp8_autocast_context

    for name in ("transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)   # import -> ImportError
    assert not te_available()
    with pytest.raises(ValueError, match="use quant.fp8=emulate on CPU"):
        apply_quantization(small_model(), QuantConfig(fp8="te"))
    with pytest.raises(ValueError, match=TE_MISSING.split(";")[0]):
        fp8_autocast_context(QuantConfig(fp8="te"))


def test_te_recipe_follows_the_gpu_and_refuses_the_stateful_one():
    """Recipes by compute capability; a TE with only DelayedScaling (an amax history that
    checkpoints would not carry) is refused with a one-line error."""
    import types

    from megak3.quant.te import TE_STATEFUL, _te_recipe

    def module(*names):
        return types.SimpleNamespace(**{n: type(n, (), {}) for n in names + ("DelayedScaling",)})

    full = module("MXFP8BlockScaling", "Float8BlockScaling", "Float8CurrentScaling")
    assert type(_te_recipe(full, 10)).__name__ == "MXFP8BlockScaling"
    assert type(_te_recipe(full, 9, 0, "12.9", "2.3.0")).__name__ == "Float8BlockScaling"
    assert type(_te_recipe(full, 9, 0, "12.8", "2.3.0")).__name__ == "Float8CurrentScaling"  # CUDA < 12.9
    assert type(_te_recipe(full, 8)).__name__ == "Float8CurrentScaling"
    assert type(_te_recipe(module("Float8CurrentScaling"), 9)).__name__ == "Float8CurrentScaling"
    with pytest.raises(ValueError, match="DelayedScaling") as e:
        _te_recipe(module(), 9)
    assert str(e.value) == TE_STATEFUL and "\n" not in TE_STATEFUL


def _fake_te(monkeypatch, capability=(9, 0), recipes=("Float8CurrentScaling", "Float8BlockScaling",
                                                      "MXFP8BlockScaling"), new_api=True):
    """A stand-in Transformer Engine (its Linear is a plain nn.Linear with TE's constructor; autocast
    records the recipe) and a CUDA device of ``capability``: the te path's plumbing on CPU. The real
    TE kernels are exercised on a GPU by tools/gpu_check.py."""
    entered = []

    class Linear(torch.nn.Linear):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)

    @contextlib.contextmanager
    def autocast(enabled, recipe):
        entered.append((enabled, type(recipe).__name__))
        yield

    @contextlib.contextmanager
    def fp8_autocast(enabled, fp8_recipe):
        entered.append((enabled, type(fp8_recipe).__name__))
        yield

    te, te_torch = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.pytorch")
    common, recipe = types.ModuleType("transformer_engine.common"), types.ModuleType("transformer_engine.common.recipe")
    te_torch.Linear = Linear
    if new_api:
        te_torch.autocast = autocast
    else:
        te_torch.fp8_autocast = fp8_autocast
    for n in recipes + ("DelayedScaling",):
        setattr(recipe, n, type(n, (), {}))
    te.pytorch, te.common, common.recipe = te_torch, common, recipe
    for name, mod in (("transformer_engine", te), ("transformer_engine.pytorch", te_torch),
                      ("transformer_engine.common", common), ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.version, "cuda", "12.9")          # Hopper block scaling needs CUDA >= 12.9
    monkeypatch.setattr("megak3.quant.te._te_version", lambda: "2.3.0")   # ... and TE >= 2.3
    return Linear, entered


def test_fp8_te_swaps_exactly_the_dense_linears_with_copied_weights(monkeypatch):
    from megak3.quant.te import fp8_autocast_context

    m = small_model()
    x = tokens()
    with torch.no_grad():
        ref = m(x).logits
    params = dict(m.named_parameters())
    Linear, entered = _fake_te(monkeypatch)
    apply_quantization(m, QuantConfig(fp8="te"))
    names = dense_linear_names(m)
    assert names and all(type(m.get_submodule(n)) is Linear for n in names)
    assert sum(type(mod) is Linear for mod in m.modules()) == len(names)
    for n in names:  # new Parameters holding the same values, under the same names
        new = m.get_submodule(n).weight
        assert new is not params[n + ".weight"] and torch.equal(new, params[n + ".weight"])
    assert dict(m.named_parameters()).keys() == params.keys()
    with fp8_autocast_context(QuantConfig(fp8="te")), torch.no_grad():
        assert torch.equal(m(x).logits, ref)      # the stand-in computes what nn.Linear does
    assert entered == [(True, "Float8BlockScaling")]  # Hopper's recipe


@pytest.mark.parametrize("capability,new_api,recipe", [((10, 0), True, "MXFP8BlockScaling"),
                                                       ((8, 9), False, "Float8CurrentScaling")])
def test_fp8_te_recipe_and_autocast_api_follow_the_machine(monkeypatch, capability, new_api, recipe):
    from megak3.quant.te import fp8_autocast_context

    _, entered = _fake_te(monkeypatch, capability, new_api=new_api)
    with fp8_autocast_context(QuantConfig(fp8="te")):
        pass
    assert entered == [(True, recipe)]


def test_fp8_te_refuses_old_gpus_and_stateful_te_before_swapping(monkeypatch):
    from megak3.quant.te import TE_STATEFUL

    m = small_model()
    Linear, _ = _fake_te(monkeypatch, capability=(8, 0))
    with pytest.raises(ValueError, match=r"needs an FP8 GPU \(sm89\+\), this one is sm80"):
        apply_quantization(m, QuantConfig(fp8="te"))
    _fake_te(monkeypatch, capability=(9, 0), recipes=())
    with pytest.raises(ValueError) as e:
        apply_quantization(m, QuantConfig(fp8="te"))
    assert str(e.value) == TE_STATEFUL
    assert not any(type(mod) is Linear for mod in m.modules())
