"""optim.offload=cpu: the host-memory AdamW (megak3/optim/offload.py) against torch's AdamW.

Kernels: the torch twin is bitwise ``torch.optim.AdamW(fused=True)``; DeepSpeed's CPU Adam is
within fp32 rounding of it (skipped when DeepSpeed is not installed). Both honour ``found_inf``,
and their state dicts load into each other and into torch's AdamW. Training: the production
RankStep (megak3/train/parity.py run_steps) with offload=cpu against offload=none, one process and
ZeRO-1 over dp=2, and a checkpoint saved without offload resumed with it (the Trainer).
"""
import re
import sys

import pytest
import torch

from conftest import SMALL_MODEL
from megak3.optim import OptimConfig
from megak3.optim.offload import DeepSpeedHostAdamW, HostAdamW, host_adamw
from megak3.train import parity
from megak3.train.parity import run_steps
from parallel.testing import PARITY_MODEL, run_distributed

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
SHAPES = [(64, 33), (7,), (1000,), (3, 5, 4)]
DS_ATOL = 2e-6
"""DeepSpeed vs torch after 5 steps at lr=1e-2 on N(0, 1) weights: measured 7.2e-7, a few ulp of
the largest weights (|w| in [2, 4): ulp 2.4e-7); DeepSpeed takes lr, betas and beta^t in fp32"""


def _deepspeed():
    return pytest.importorskip("deepspeed", reason="DeepSpeed not installed (pip install -e '.[offload]')")


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _groups(ps):
    return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _run(opt, ps, steps, first=0):
    for k in range(first, first + steps):
        for p, g in zip(ps, _grads(k)):
            p.grad = g.clone()
        opt.step()


def _make(kind, ps, **kw):
    if kind == "adamw":
        return torch.optim.AdamW(_groups(ps), fused=True, **HP)
    if kind == "deepspeed":
        _deepspeed()
        return DeepSpeedHostAdamW(_groups(ps), **HP, **kw)
    return HostAdamW(_groups(ps), **HP, **kw)


def _max_diff(a, b):
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("host_copy", [False, True])
def test_torch_twin_is_torch_adamw_bitwise(host_copy):
    """In place (CPU params) and through the host copies: every step, every param and state tensor
    equals torch.optim.AdamW(fused=True) exactly."""
    ref_p, twin_p = _params(), _params()
    ref, twin = _make("adamw", ref_p), _make("torch", twin_p, host_copy=host_copy)
    for k in range(5):
        _run(ref, ref_p, 1, k)
        _run(twin, twin_p, 1, k)
        for a, b in zip(ref_p, twin_p):
            assert torch.equal(a, b), k
    for a, b in zip(ref_p, twin_p):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ref.state[a][key], twin.state[b][key]), key
        assert twin.state[b]["exp_avg"].device.type == "cpu"


@pytest.mark.parametrize("host_copy", [False, True])
def test_deepspeed_matches_torch_per_step(host_copy):
    """DeepSpeed's CPU Adam within DS_ATOL of torch's AdamW after each of 5 steps; state keys equal."""
    ref_p, ds_p = _params(), _params()
    ref, ds = _make("adamw", ref_p), _make("deepspeed", ds_p, host_copy=host_copy)
    diffs = []
    for k in range(5):
        _run(ref, ref_p, 1, k)
        _run(ds, ds_p, 1, k)
        diffs.append(_max_diff(ref_p, ds_p))
    print(f"DeepSpeed CPU Adam vs torch AdamW, max |param diff| per step: {['%.2e' % d for d in diffs]}")
    assert 0 < max(diffs) <= DS_ATOL  # 0 would mean the kernel did not run
    for a, b in zip(ref_p, ds_p):
        assert ds.state[b].keys() == ref.state[a].keys()
        assert float(ds.state[b]["step"]) == float(ref.state[a]["step"]) == 5.0
        torch.testing.assert_close(ds.state[b]["exp_avg_sq"], ref.state[a]["exp_avg_sq"], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["torch", "deepspeed"])
def test_found_inf_changes_nothing(kind):
    """found_inf = 1 (GradScaler protocol): params, state and step count untouched, even with NaN
    gradients; found_inf = 0 steps normally."""
    ps = _params()
    opt = _make(kind, ps, host_copy=True)
    _run(opt, ps, 2)
    before = [p.detach().clone() for p in ps]
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in ps}
    for p in ps:
        p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones(())
    opt.step()
    for p, b in zip(ps, before):
        assert torch.equal(p, b)
        for k, v in opt.state[p].items():
            assert torch.equal(v, state[id(p)][k]), k
    opt.found_inf = torch.zeros(())
    _run(opt, ps, 1, 2)
    assert all(float(opt.state[p]["step"]) == 3.0 for p in ps)
    assert _max_diff(ps, before) > 0


@pytest.mark.parametrize("a, b", [("torch", "adamw"), ("adamw", "torch"), ("deepspeed", "adamw"),
                                  ("adamw", "deepspeed"), ("deepspeed", "torch")])
def test_state_dict_moves_between_offload_and_adamw(a, b):
    """3 steps with ``a``, its state_dict loaded into ``b`` over copies of the params, 2 more steps:
    the same weights as 5 steps of torch's fused AdamW (exactly when only it and the torch twin
    step). The loaded state lands in host memory as fresh tensors (stepping does not write into
    the dict)."""
    ref_p = _params()
    ref = _make("adamw", ref_p)
    _run(ref, ref_p, 5)
    pa = _params()
    opt_a = _make(a, pa)
    _run(opt_a, pa, 3)
    sd = opt_a.state_dict()
    saved = {i: {k: v.clone() for k, v in st.items()} for i, st in sd["state"].items()}
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    opt_b = _make(b, pb)
    opt_b.load_state_dict(sd)
    _run(opt_b, pb, 2, 3)
    if b != "adamw":  # (torch's own loader keeps CPU 'step' tensors of the dict: its behaviour, not checked)
        for i, st in sd["state"].items():
            for k, v in st.items():
                assert torch.equal(v, saved[i][k]), (i, k)
    for p in pb:
        assert float(opt_b.state[p]["step"]) == 5.0
    if "deepspeed" in (a, b):
        assert _max_diff(ref_p, pb) <= DS_ATOL
    elif b == "adamw":  # torch's loader takes the saved group's keys: no 'fused' -> AdamW's for-loop form
        assert opt_b.param_groups[0]["fused"] is None and _max_diff(ref_p, pb) <= 1e-7
    else:
        assert _max_diff(ref_p, pb) == 0


def test_build_optimizer_and_config_errors(monkeypatch):
    """optim.offload=cpu swaps the AdamW groups (Muon untouched); bad values and a missing
    DeepSpeed are one-line errors naming the field; 'auto' falls back to the torch twin."""
    from megak3.config import load_model_config
    from megak3.model.k3 import build_model
    from megak3.optim import build_optimizer
    from megak3.job.compose import check

    model = build_model(load_model_config("k3_tiny", **SMALL_MODEL))
    plain = build_optimizer(model, OptimConfig())
    opt = build_optimizer(model, OptimConfig(offload="cpu", offload_impl="torch"))
    assert type(opt.adamw) is HostAdamW and type(opt.muon) is type(plain.muon)
    assert [len(g["params"]) for g in opt.adamw.param_groups] == [len(g["params"]) for g in plain.adamw.param_groups]
    assert [g["weight_decay"] for g in opt.adamw.param_groups] == [g["weight_decay"] for g in plain.adamw.param_groups]
    for argv, needle in [("optim.offload=gpu", "optim.offload='gpu' must be one of ('none', 'cpu')"),
                         ("optim.offload_impl=fast", "optim.offload_impl='fast' must be one of")]:
        code, msg = check([argv], local=False)
        assert code == 2 and needle in msg and "\n" not in msg, msg
    monkeypatch.setattr("megak3.optim.config.find_spec", lambda name: None)
    OptimConfig(offload="cpu", offload_impl="deepspeed").validate()   # valid: checked where it runs
    code, msg = check(["optim.offload=cpu", "optim.offload_impl=deepspeed"])
    assert code == 2 and "\n" not in msg.strip(), msg
    assert re.search(r"optim.offload_impl='deepspeed' needs DeepSpeed, which is not installed: "
                     r"pip install .*\[offload\].*optim.offload_impl=torch", msg), msg
    assert check(["optim.offload=cpu", "optim.offload_impl=deepspeed"], local=False) == (0, None)
    assert check(["optim.offload=none", "optim.offload_impl=deepspeed"]) == (0, None)  # not used: not checked
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")] or ["deepspeed"]:
        monkeypatch.setitem(sys.modules, name, None)  # import deepspeed -> ImportError
    with pytest.raises(ValueError, match=r"^optim.offload_impl='deepspeed': DeepSpeed's CPU Adam did not load"):
        host_adamw(plain.adamw, "deepspeed")
    with pytest.warns(UserWarning, match="optim.offload_impl=auto: DeepSpeed's CPU Adam did not load"):
        assert type(host_adamw(plain.adamw, "auto")) is HostAdamW


@pytest.mark.parametrize("impl, cls", [("torch", HostAdamW), ("deepspeed", DeepSpeedHostAdamW)])
def test_zero1_rebuilds_the_same_kernel(impl, cls):
    """ShardedOptimizer re-creates the AdamW over its fp32 main copies with type(opt)(groups): the
    kernel class and every group hyperparameter survive."""
    from megak3.config import load_model_config
    from megak3.model.k3 import build_model
    from parallel.data_parallel import ShardedOptimizer

    if impl == "deepspeed":
        _deepspeed()
    model = build_model(load_model_config("k3_tiny", **SMALL_MODEL))
    cfg = OptimConfig(offload="cpu", offload_impl=impl, adam_beta2=0.9, adam_eps=1e-7)
    opt = ShardedOptimizer(model, cfg)
    assert type(opt.adamw) is cls
    for g in opt.adamw.param_groups:
        assert (g["betas"], g["eps"], g["lr"]) == ((0.9, 0.9), 1e-7, cfg.lr)
    assert sorted(g["weight_decay"] for g in opt.adamw.param_groups) == [0.0, cfg.weight_decay]


def test_memory_report_names_the_host_resident_state():
    """memory_report's optimizer_state_host_bytes: the AdamW state an offloaded optimizer keeps in
    host memory while the params sit on an accelerator (the device is stood in for: no GPU here)."""
    from megak3.config import load_model_config
    from megak3.model.k3 import build_model
    from parallel.data_parallel import ShardedOptimizer

    model = build_model(load_model_config("k3_tiny", **SMALL_MODEL))
    opt = ShardedOptimizer(model, OptimConfig(offload="cpu", offload_impl="torch"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.reduce_gradients()
    opt.step()
    rep = opt.memory_report()
    assert rep["optimizer_state_host_bytes"] == 0          # CPU params: host memory is the device
    adam = sum(t.numel() * t.element_size() for st in opt.adamw.state.values() for t in st.values())
    assert 0 < adam < rep["optimizer_state_bytes"]       # Muon momentum is the rest
    opt.device = torch.device("cuda")                     # the params' device, as a GPU run sees it
    assert opt.memory_report()["optimizer_state_host_bytes"] == rep["optimizer_state_bytes"]


def _offload_steps(rank, world, dp, offload, impl, steps):
    """run_steps (the production RankStep loop) with ``optim.offload`` / ``optim.offload_impl`` set."""
    make = parity.parity_job

    def job_with_offload(*a, **kw):
        job = make(*a, **kw)
        job.optim.offload, job.optim.offload_impl = offload, impl
        return job

    parity.parity_job = job_with_offload  # this process only (a test's, or a rank's)
    try:
        return run_steps(rank, world, 1, dp, False, steps, PARITY_MODEL)
    finally:
        parity.parity_job = make


def _assert_same_training(a, b, exact_first_norm=True):
    """Losses and global grad norms within fp32 noise; step 0 (same weights, same layout) exactly."""
    if exact_first_norm:
        assert a["losses"][0] == b["losses"][0] and a["grad_norms"][0] == b["grad_norms"][0]
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5, abs=1e-6)
    assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("impl", ["torch", "deepspeed"])
def test_training_offload_matches_none(impl):
    """4 production steps: optim.offload=cpu against offload=none, same losses and grad norms."""
    if impl == "deepspeed":
        _deepspeed()
    none = _offload_steps(0, 1, 1, "none", "auto", 4)
    cpu = _offload_steps(0, 1, 1, "cpu", impl, 4)
    print(f"offload=none losses {none['losses']}\noffload=cpu ({impl}) losses {cpu['losses']}")
    _assert_same_training(cpu, none)
    for n, g in none["grads"].items():  # step-0 gradients: same weights, same model
        assert torch.equal(g, cpu["grads"][n]), n


@pytest.mark.slow
def test_zero1_dp2_offload_matches_one_process():
    """ZeRO-1 over dp=2 (each rank steps the AdamW params it owns in host memory) against one
    process without offload."""
    ref = _offload_steps(0, 1, 1, "none", "auto", 3)
    dp2 = run_distributed(_offload_steps, 2, 2, "cpu", "auto", 3)[0]
    print(f"offload=none, 1 process: losses {ref['losses']}\noffload=cpu, ZeRO-1 dp=2: losses {dp2['losses']}")
    _assert_same_training(dp2, ref, exact_first_norm=False)


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [("none", "cpu"), ("cpu", "none")])
def test_checkpoint_moves_between_offload_and_none(corpus_dataset, tmp_path, before, after):
    """Trainer: 3 steps with optim.offload=``before`` (checkpoint at the end), resumed with
    ``after``: the loaded optimizer state is the saved one exactly (host tensors under offload),
    and the run goes on as 5 steps with ``before`` do: the same step-4 loss (same weights and
    data), step 5 (one update by the other kernel) within fp32 noise."""
    from test_train import make_job

    from megak3.train.trainer import Trainer

    def trainer(run, max_steps, offload, **kw):
        j = make_job(corpus_dataset, tmp_path / run, optim_lr=1e-3, max_steps=max_steps, eval_batches=0, **kw)
        j.optim.offload = offload
        return Trainer(j, tmp_path / run)

    full = trainer("full", 5, before)
    full.fit()
    first = trainer("split", 3, before)
    first.fit()
    saved = first.optimizer.export_state()["state"]
    probe = trainer("split", 5, after, resume="auto")
    probe.maybe_resume()
    loaded = probe.optimizer.export_state()["state"]
    assert saved.keys() == loaded.keys()
    for n, st in saved.items():
        assert st.keys() == loaded[n].keys(), n
        for k, v in st.items():
            assert torch.equal(v.cpu(), loaded[n][k].cpu()), (n, k)
    adamw = probe.optimizer.adamw
    assert isinstance(adamw, HostAdamW) == (after == "cpu")
    assert all(float(st["step"]) == 3.0 for st in adamw.state.values())
    if after == "cpu":
        assert all(v.device.type == "cpu" for st in adamw.state.values() for v in st.values())
    second = trainer("split", 5, after, resume="auto")
    second.fit()
    a = [h["loss"] for h in full.history]
    b = [h["loss"] for h in first.history] + [h["loss"] for h in second.history]
    assert a[:4] == b[:4]
    assert a[4] == pytest.approx(b[4], rel=1e-4)


def test_stale_jit_build_lock_is_cleared(tmp_path, monkeypatch):
    """A JIT-build lock left by a killed build would make every later DeepSpeed load wait forever
    (torch's FileBaton never expires); an old one is removed, a fresh one (a build running) kept."""
    import os
    import time
    import warnings

    from megak3.optim import offload

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        offload._clear_stale_build_lock("cpu_adam")          # fresh: a build may be running
    assert lock.exists()
    old = time.time() - offload.STALE_BUILD_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="JIT build lock"):
        offload._clear_stale_build_lock("cpu_adam")
    assert not lock.exists()
