"""megak3's calls into fla's Triton chunk_kda (megak3/ops/kda/dispatch.py `kda`, kda_cp, the KDA layer).

Main suite (no Triton needed): a fake chunk_kda stands in for fla's and records what megak3 hands
it -- the layer's gate bound as lower_bound (fla's safe_gate tiles only for bounds in [-5, 0)), the
host offsets as cu_seqlens_cpu, and the same offsets tensor objects on every call (fla caches its
chunk indices by their identity) -- for packed rows and under context parallelism (2 threaded
ranks). The dispatcher takes its fla branch on CPU tensors when TRITON_INTERPRET=1 is set.

Triton's interpreter: `test_fla_kernels_under_triton_interpreter` runs tests/fla_interpret_check.py
(fla's real kernels vs the torch twin: forward, backward, cu_seqlens, initial state, kda_cp, gate
bound -12) in a subprocess per fla-core version, from the package dirs tools/ci_triton.sh installs.
It runs only with MEGAK3_REQUIRE_TRITON=1 (CI's second step, tools/ci_triton.sh; a missing package
dir then fails) and skips otherwise, saying how to run it.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import megak3.ops.kda.dispatch as kda_ops
from megak3.config import ModelConfig
from megak3.model.kda import KimiDeltaAttention
from megak3.model.seqinfo import make_seq_info
from megak3.ops.kda import chunk_kda
from parallel.context_parallel import ContextParallel
from parallel.testing import run_threaded

ROOT = Path(__file__).resolve().parents[1]
CI_SCRIPT = ROOT / "tools" / "ci_triton.sh"


# ------------------------------------------------------------------------------ fake fla chunk_kda
class FakeFla:
    """Records every call (keyword arguments, and the calling thread's CP rank) and answers with
    the torch twin, so the model runs on."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.calls.append({"rank": rank, **kw})
        cu = kw["cu_seqlens_cpu"] if kw.get("cu_seqlens_cpu") is not None else kw.get("cu_seqlens")
        return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu)


@pytest.fixture
def fake_fla(monkeypatch):
    fake = FakeFla()
    monkeypatch.setenv("TRITON_INTERPRET", "1")          # fla's branch on CPU tensors
    monkeypatch.setattr(kda_ops, "_FLA_TRIED", True)
    monkeypatch.setattr(kda_ops, "_FLA_CHUNK_KDA", fake)
    return fake


def _layer(lower_bound: float, hidden: int = 32) -> KimiDeltaAttention:
    cfg = ModelConfig()
    cfg.hidden_size, cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.gate_rank = hidden, 2, 16, 8
    cfg.kda.gate_lower_bound = lower_bound
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg)
    for _, p in layer.named_parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer


def _assert_offsets(calls, host_offsets: list):
    """Every call got int64 offsets equal to host_offsets, cu_seqlens_cpu on the host, and the same
    two tensor objects each time."""
    assert calls, "fla's chunk_kda was not called"
    for c in calls:
        assert c["cu_seqlens"] is not None and c["cu_seqlens_cpu"] is not None
        assert c["cu_seqlens"].dtype == torch.int64 and c["cu_seqlens_cpu"].dtype == torch.int64
        assert c["cu_seqlens_cpu"].device.type == "cpu"
        assert c["cu_seqlens"].tolist() == host_offsets and c["cu_seqlens_cpu"].tolist() == host_offsets
        assert c["cu_seqlens"] is calls[0]["cu_seqlens"], "a fresh offsets tensor defeats fla's cache"
        assert c["cu_seqlens_cpu"] is calls[0]["cu_seqlens_cpu"]


# ------------------------------------------------------------------------------------ main suite
@pytest.mark.parametrize("bound, safe", [(-5.0, True), (-12.0, False)])
def test_layer_passes_gate_bound_and_stable_host_offsets(fake_fla, bound, safe):
    layer = _layer(bound)
    B, T = 2, 24
    seq = make_seq_info(B, T, torch.tensor([0, 10, 48]))          # row end 24 merged in
    x = torch.randn(B, T, 32)
    for _ in range(2):                                               # two layers' worth of calls
        layer(x, seq).sum().backward()
    assert len(fake_fla.calls) == 2
    for c in fake_fla.calls:
        assert c["lower_bound"] == bound and c["safe_gate"] is safe
        assert c["cu_seqlens_cpu"] is seq.cu_seqlens_host             # the host offsets as they are
    _assert_offsets(fake_fla.calls, [0, 10, 24, 48])


def test_context_parallel_layer_passes_gate_bound_and_stable_host_offsets(fake_fla):
    """cp = 2: each rank's segment map goes to fla with the layer's bound and its local offsets,
    the same tensors on every call."""
    layer = _layer(-12.0)
    B, T, cp = 1, 48, 2
    ids = torch.zeros(B, T, dtype=torch.long)
    cu = torch.tensor([0, 10, 30, 48])                               # doc 1 crosses the boundary

    def rank_fn(group):
        r = dist.get_rank(group)
        _, _, seq = ContextParallel(group, cp, r).shard(ids, None, cu)
        x = torch.randn(B, T // cp, 32, generator=torch.Generator().manual_seed(r))
        for _ in range(2):
            layer(x, seq).sum().backward()
        return seq.cu_seqlens_host.tolist()

    local = run_threaded(cp, rank_fn)
    assert local == [[0, 10, 24], [0, 6, 24]]
    for r in range(cp):
        calls = [c for c in fake_fla.calls if c["rank"] == r]
        assert len(calls) == 2 and all(c["lower_bound"] == -12.0 and c["safe_gate"] is False for c in calls)
        _assert_offsets(calls, local[r])


def test_fla_offsets_keep_their_identity():
    cu32 = torch.tensor([0, 3, 7], dtype=torch.int32)
    a, b = kda_ops._fla_offsets(cu32, torch.device("cpu")), kda_ops._fla_offsets(cu32, torch.device("cpu"))
    assert a is b and a.dtype == torch.int64 and a.tolist() == [0, 3, 7]
    other = cu32.clone()
    assert kda_ops._fla_offsets(other, torch.device("cpu")) is not a      # keyed by object, not value
    cu64 = torch.tensor([0, 5])
    assert kda_ops._fla_offsets(cu64, torch.device("cpu")) is cu64          # already right: as given


def test_fla_safe_gate_range():
    assert [kda_ops.fla_safe_gate(b) for b in (-5.0, -4.0, -0.5)] == [True] * 3
    assert [kda_ops.fla_safe_gate(b) for b in (-5.01, -12.0, None)] == [False] * 3


def test_gate_lower_bound_must_be_finite_and_negative():
    for bad in (-math.inf, math.nan, 0.0, 1.0):
        cfg = ModelConfig()
        cfg.kda.gate_lower_bound = bad
        with pytest.raises(ValueError, match="model.kda.gate_lower_bound"):
            cfg.validate()
    cfg = ModelConfig()
    cfg.kda.gate_lower_bound = -12.0
    cfg.validate()


# ------------------------------------------------------------------------------ Triton interpreter
def _ci_versions() -> tuple[str, list[str]]:
    """(triton version, fla-core versions) from tools/ci_triton.sh, their one home."""
    text = CI_SCRIPT.read_text()
    triton = re.search(r'^TRITON_VERSION="([^"]+)"', text, re.M).group(1)
    fla = re.search(r'^FLA_VERSIONS="([^"]+)"', text, re.M).group(1).split()
    return triton, fla


TRITON_VERSION, FLA_VERSIONS = _ci_versions()


def _package_dir(name: str, version: str) -> Path:
    base = Path(os.environ.get("MEGAK3_TRITON_PACKAGES", ROOT / ".cache" / "triton-interp"))
    return base / f"{name}-{version}"


@pytest.mark.parametrize("fla_version", FLA_VERSIONS)
def test_fla_kernels_under_triton_interpreter(fla_version):
    dirs = [_package_dir("triton", TRITON_VERSION), _package_dir("fla-core", fla_version)]
    missing = [str(d) for d in dirs if not (d / ".installed").exists()]
    how = (f"`bash tools/ci_triton.sh` installs triton {TRITON_VERSION} and fla-core "
           f"{' '.join(FLA_VERSIONS)} and runs this test with MEGAK3_REQUIRE_TRITON=1")
    if os.environ.get("MEGAK3_REQUIRE_TRITON") != "1":   # ~30 s of CPU per version: CI's second step
        pytest.skip(f"Triton-interpreter check runs with MEGAK3_REQUIRE_TRITON=1: {how}"
                    + (f" (missing: {', '.join(missing)})" if missing else ""))
    if missing:
        pytest.fail(f"Triton-interpreter check needs {', '.join(missing)}: {how}")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(dirs[0]), str(dirs[1]), str(ROOT)])}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fla_interpret_check.py")],
                          env=env, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    print(out[-6000:])
    assert f"fla-core {fla_version} " in out, out[-3000:]
    assert proc.returncode == 0, out[-6000:]
