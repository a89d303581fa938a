"""NVIDIA apex's fused RMSNorm (megak3/model/norm.py), checked on CPU: detection (no apex, PyPI's
unrelated 'apex', a Python-only NVIDIA build, a built one), routing (only CUDA inputs with matching
dtypes, never with model.norm_impl=torch, autocast off inside the call) and the model.norm_impl knob.

No CUDA here: the fused function is a recording stand-in that computes apex's formula on its own,
in float64 from the arguments it is given (reducing over ``normalized_shape``), not by calling the
torch twin; the routed results are compared with the twin's within fp32 rounding, so a wrong
weight, eps or normalized_shape passed to apex fails. ``norm._on_cuda`` is patched to say yes. tools/gpu_check.py part apex_rms_norm compares the real
kernel with the twin on a GPU.
"""
from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from megak3.config import load_model_config
from megak3.model import norm
from megak3.model.norm import RMSNorm, rms_norm, set_norm_impl, uses_apex

from conftest import SMALL_MODEL


def _apex_names():
    return [k for k in sys.modules if k in ("apex", "fused_layer_norm_cuda") or k.startswith("apex.")]


@pytest.fixture(autouse=True)
def apex_sandbox():
    """Whatever apex this machine has is hidden during a test and restored after it."""
    saved = {k: sys.modules.pop(k) for k in _apex_names()}
    path = list(sys.path)
    norm.apex_rms_norm_fn.cache_clear()
    yield
    for k in _apex_names():
        del sys.modules[k]
    sys.modules.update(saved)
    sys.path[:] = path
    importlib.invalidate_caches()
    norm.apex_rms_norm_fn.cache_clear()


def apex_formula(x, weight, normalized_shape, eps):
    """apex's fused_rms_norm_affine, written from its definition: x / sqrt(mean(x^2) + eps) * weight
    over the trailing ``normalized_shape`` dims, in float64, returned in x's dtype."""
    dims = tuple(range(-len(normalized_shape), 0))
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.square().mean(dims, keepdim=True) + eps) * weight.double()
    return y.to(x.dtype)


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


class Recorder:
    """Stands in for apex's fused_rms_norm_affine: records each call, returns apex_formula's numbers."""

    def __init__(self):
        self.calls, self.weights = [], []

    def __call__(self, x, weight, normalized_shape, eps, memory_efficient=False):
        self.weights.append(weight)
        self.calls.append({"shape": tuple(x.shape), "dtype": x.dtype, "normalized_shape": tuple(normalized_shape),
                           "eps": eps, "autocast": torch.is_autocast_enabled(x.device.type)})
        return apex_formula(x, weight, normalized_shape, eps)


def _nvidia_apex(fused, extension=True):
    """Modules shaped like NVIDIA apex: apex.normalization.fused_layer_norm (+ the compiled extension)."""
    apex, normalization = types.ModuleType("apex"), types.ModuleType("apex.normalization")
    fln = types.ModuleType("apex.normalization.fused_layer_norm")
    apex.__path__, normalization.__path__ = [], []
    fln.fused_rms_norm_affine = fused
    apex.normalization, normalization.fused_layer_norm = normalization, fln
    sys.modules.update({"apex": apex, "apex.normalization": normalization, "apex.normalization.fused_layer_norm": fln})
    # None in sys.modules makes `import fused_layer_norm_cuda` raise ImportError (a Python-only build)
    sys.modules["fused_layer_norm_cuda"] = types.ModuleType("fused_layer_norm_cuda") if extension else None


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(norm, "_on_cuda", lambda x: True)


# ---- detection ----------------------------------------------------------------------------------

def test_no_apex_means_the_torch_path(fake_cuda):
    sys.modules["apex"] = None                       # import apex -> ImportError, whatever is installed
    assert norm.apex_rms_norm_fn() is None
    m = RMSNorm(8)
    x = torch.randn(3, 8)
    assert not uses_apex(x, m.weight, "auto")
    assert torch.equal(m(x), rms_norm(x, m.weight, m.eps))


PYPI_APEX = {
    # PyPI's 'apex' (a Pyramid toolkit, Python 2 code): import raises SyntaxError on Python 3
    "raises_at_import": 'print "apex: authentication toolkit for Pyramid"\n',
    # an unrelated package that imports fine but has no apex.normalization
    "imports": '"""Toolkit for Pyramid, a Pylons project, to add authentication and authorization."""\n'
               "def includeme(config):\n    pass\n",
}


@pytest.mark.parametrize("kind", sorted(PYPI_APEX))
def test_pypi_apex_is_not_nvidia_apex(tmp_path, kind, fake_cuda):
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text(PYPI_APEX[kind])
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    with pytest.raises(SyntaxError if kind == "raises_at_import" else ModuleNotFoundError):
        importlib.import_module("apex.normalization")   # the package really is the unrelated one
    assert norm.apex_rms_norm_fn() is None
    x = torch.randn(2, 8)
    assert not uses_apex(x, torch.ones(8), "auto")
    assert norm.norm_impl_error("apex").startswith("model.norm_impl=apex: NVIDIA apex with its CUDA extensions")


def test_python_only_nvidia_build_counts_as_absent(fake_cuda):
    rec = Recorder()
    _nvidia_apex(rec, extension=False)
    assert norm.apex_rms_norm_fn() is None
    m = RMSNorm(8)
    m(torch.randn(2, 8))
    assert rec.calls == []


def test_built_apex_is_found():
    rec = Recorder()
    _nvidia_apex(rec)
    assert norm.apex_rms_norm_fn() is rec


# ---- routing -----------------------------------------------------------------------------------

def test_routes_to_apex_only_for_cuda_inputs_with_matching_dtypes(monkeypatch):
    rec = Recorder()
    _nvidia_apex(rec)
    g = torch.Generator().manual_seed(0)
    m = RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(1 + 0.1 * torch.randn(16, generator=g))
    x = torch.randn(4, 5, 16, generator=g)
    m(x)                                              # a CPU tensor: the twin
    assert rec.calls == []
    monkeypatch.setattr(norm, "_on_cuda", lambda x: True)
    y = m(x)
    assert rec.calls == [{"shape": (4, 5, 16), "dtype": torch.float32, "normalized_shape": (16,), "eps": 1e-6,
                          "autocast": False}]
    assert close(y, rms_norm(x, m.weight, 1e-6))
    # the comparison can fail: apex given no weight, or a wider normalized_shape, differs
    assert not close(y, apex_formula(x, torch.ones(16), (16,), 1e-6))
    assert not close(y, apex_formula(x, m.weight, (5, 16), 1e-6))
    # a bf16 input with the fp32 weight: apex has no bf16-in/fp32-weight kernel, the twin's result is fp32
    y = m(x.bfloat16())
    assert len(rec.calls) == 1 and y.dtype == torch.float32
    m.impl = "torch"
    m(x)
    assert len(rec.calls) == 1
    m.impl = "apex"
    mb = RMSNorm(16).bfloat16()
    mb.impl = "apex"
    for mod, inp in ((m, x), (mb, x.bfloat16())):
        mod(inp)
    assert [c["dtype"] for c in rec.calls[1:]] == [torch.float32, torch.bfloat16]
    m(x[:0])                                          # no tokens: the twin (apex would launch 0 blocks)
    assert len(rec.calls) == 3


def test_autocast_is_off_inside_the_fused_call(fake_cuda):
    """apex's wrapper would cast x and the weight to bf16 under autocast; ours keeps the twin's fp32."""
    rec = Recorder()
    _nvidia_apex(rec)
    m = RMSNorm(8)
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert rec.calls[0]["autocast"] is False and y.dtype == torch.float32
    assert close(y, rms_norm(x, m.weight, m.eps))


def test_every_weighted_norm_of_the_model_routes_and_the_loss_is_unchanged(fake_cuda):
    """A k3_tiny-structured model with an image: each RMSNorm call goes through apex's function, the
    loss and every gradient equal the torch path's; with norm_impl='torch' apex is never called."""
    from megak3.model.k3 import build_model

    rec = Recorder()
    _nvidia_apex(rec)
    cfg = load_model_config("k3_tiny", **{**SMALL_MODEL, "vision.enabled": True})   # k3_tiny's 2-layer tower
    model = build_model(cfg, seed=0)
    n_norms = sum(isinstance(m, RMSNorm) for m in model.modules())
    norm_calls = []
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.register_forward_hook(lambda mod, inp, out: norm_calls.append(mod))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, cfg.vocab_size, (2, 32), generator=g)
    n_img = model.vision.num_tokens(28, 28)
    ids[1, 4:4 + n_img] = cfg.media_placeholder_token_id
    labels = torch.roll(ids, -1, 1)
    image = torch.randn(3, 28, 28, generator=g)

    def loss_and_grads(impl):
        assert set_norm_impl(model, impl) == n_norms
        model.zero_grad(set_to_none=True)
        norm_calls.clear()
        rec.calls.clear()
        rec.weights.clear()
        loss = model(ids, labels=labels, images=[image]).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_a, grads_a = loss_and_grads("auto")
    # every RMSNorm.forward call went to apex, in order: the decoder, latent, MoE and vision norms
    # (the AttnRes sites use only their norm's weight, in attn_res_mix)
    assert [id(w) for w in rec.weights] == [id(m.weight) for m in norm_calls]
    called = {n for n, m in model.named_modules() if any(m is c for c in norm_calls)}
    assert {"norm", "layers.0.input_layernorm", "layers.3.self_attn.q_a_layernorm", "layers.1.self_attn.o_norm",
            "layers.1.mlp.routed_expert_norm", "vision.final_norm"} <= called, sorted(called)
    loss_t, grads_t = loss_and_grads("torch")
    assert rec.calls == [] and len(norm_calls) > 0
    assert close(loss_a, loss_t)
    assert grads_a.keys() == grads_t.keys()
    assert all(close(grads_a[n], grads_t[n]) for n in grads_t), max(
        ((grads_a[n] - grads_t[n]).abs().max().item(), n) for n in grads_t)


# ---- the model.norm_impl knob ------------------------------------------------------------------

def test_knob_values_and_one_line_errors():
    sys.modules["apex"] = None
    assert load_model_config("k3_tiny").norm_impl == "auto"
    assert load_model_config("k3_tiny", norm_impl="torch").norm_impl == "torch"
    with pytest.raises(ValueError) as e:
        load_model_config("k3_tiny", norm_impl="fused")
    assert str(e.value) == "invalid model config 'k3_tiny': model.norm_impl='fused': choose 'auto', 'torch' or 'apex'"
    # apex's presence is the running machine's business (compose.check_local): a config composed on
    # a login node without apex is valid; building the model here is what refuses it
    assert load_model_config("k3_tiny", norm_impl="apex").norm_impl == "apex"
    with pytest.raises(ValueError) as e:
        set_norm_impl(RMSNorm(4), "apex")
    msg = str(e.value)
    assert "\n" not in msg and "model.norm_impl=apex: NVIDIA apex with its CUDA extensions is not importable" in msg
    assert "APEX_CUDA_EXT=1" in msg and msg.endswith("or set model.norm_impl=auto")
    with pytest.raises(ValueError, match="norm_impl='fused'"):
        set_norm_impl(RMSNorm(4), "fused")
    _nvidia_apex(Recorder())
    norm.apex_rms_norm_fn.cache_clear()
    assert set_norm_impl(RMSNorm(4), "apex") == 1


def test_the_model_applies_its_norm_impl():
    from megak3.model.k3 import build_model

    model = build_model(load_model_config("k3_tiny", norm_impl="torch", **SMALL_MODEL), device="meta")
    impls = {m.impl for m in model.modules() if isinstance(m, RMSNorm)}
    assert impls == {"torch"}


def test_command_line_apex_without_apex_is_one_line(tmp_path, monkeypatch):
    from megak3.job.compose import check

    monkeypatch.chdir(tmp_path)
    sys.modules["apex"] = None
    code, msg = check(["model.norm_impl=apex"])
    assert code == 2 and "\n" not in msg.strip(), msg
    assert "model.norm_impl=apex: NVIDIA apex with its CUDA extensions is not importable here" in msg
    assert check(["model.norm_impl=torch"]) == (0, None)
    assert check(["model.norm_impl=apex"], local=False) == (0, None)   # e.g. a SLURM submit host
