"""tools/gpu_check.py: the no-GPU mode skips every part with one line and exits 0; the CPU dry pass
runs parts b-d at tiny shapes against their twins; a broken fast path makes it exit 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402
from gpu_checks import attention as gpu_attention  # noqa: E402
from gpu_checks import common as gpu_common  # noqa: E402
from gpu_checks import training as gpu_training  # noqa: E402


def test_no_gpu_mode_prints_one_skip_line_per_part_and_exits_0(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")   # no GPU even on a GPU box
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(out)],
                       cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert [ln.split(":")[1].strip() for ln in lines] == list(gpu_check.PARTS), r.stdout
    assert all(ln.startswith("skip: ") for ln in lines), r.stdout
    report = json.loads(out.read_text())
    assert report["device"] == "none" and report["failures"] == []
    assert {p: v["status"] for p, v in report["parts"].items()} == {p: "skip" for p in gpu_check.PARTS}


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check") / "dry.json"
    rc = gpu_check.main(["--device", "cpu", "--out", str(out)])
    return rc, json.loads(out.read_text())


def test_cpu_dry_pass_runs_b_to_d_against_their_twins(dry_report):
    rc, report = dry_report
    assert rc == 0, report["failures"]
    status = {p: v["status"] for p, v in report["parts"].items()}
    assert status == {"fla_kda": "skip", "mla_attention": "ok", "grouped_gemm": "ok", "throughput": "ok",
                      "host_syncs": "skip", "te_fp8": "skip", "apex_rms_norm": "skip", "h2d": "skip"}
    att = report["parts"]["mla_attention"]["checks"]
    # fp32: the same math (attention() on CPU with documents is the chunked twin): ~1e-7
    assert att["fp32/docs/attention_vs_reference"]["rel_err"] < 1e-5
    assert att["fp32/docs/dq"]["rel_err"] < 1e-5
    # bf16 outputs: rounding of the output, ~2^-9, far from 0 and within the bf16 tolerance
    assert 1e-4 < att["bf16/docs/attention_vs_reference"]["rel_err"] < gpu_common.TOL_BF16
    # balanced CP's FlexAttention-with-lse form (eager on CPU, forward) vs its chunked twin
    assert report["parts"]["mla_attention"]["latent"]["path"] == "FlexAttention eager, forward only (CPU)"
    assert att["latent/fp32/flex_lse_vs_chunked_twin"]["rel_err"] < 1e-5
    assert att["latent/block/lse_masked_rows"]["ok"] and att["latent/block/lse"]["rel_err"] < 1e-5
    gg = report["parts"]["grouped_gemm"]
    assert gg["checks"]["tiled_fp32/out"]["rel_err"] < 1e-6
    assert gg["checks"]["grouped_mm_bf16/dw"]["rel_err"] < gpu_common.TOL_BF16
    assert sum(1 for c in gg["checks"].values() if c["ok"]) == len(gg["checks"]) >= 9
    tp = report["parts"]["throughput"]
    assert tp["tokens_per_s"] > 0 and 0 < tp["mfu"] < 1
    # the planner's FLOPs per token of the model that ran
    from megak3.config import load_model_config
    from megak3.launch.planner import flops_per_token
    from parallel.testing import PARITY_MODEL

    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    assert tp["train_flops_per_token"] == pytest.approx(flops_per_token(cfg, tp["seq_len"])["train"])
    # the repeated batch's loss falls every step and by a real margin (~10% over 5 steps here)
    losses = tp["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < (1 - 2 * gpu_training.LOSS_DROP_MIN) * losses[0], losses
    assert tp["checks"]["loss_falls_on_repeated_batch"]["ok"]
    # every grouped_mm call of the training path (forward, backward, deferred dW) within the CUDA rules
    assert gg["grouped_mm_calls"] == {"autocast": 3, "deferred": 3, "rules_broken": []}
    assert gg["checks"]["cuda_rules/calls"]["ok"] and gg["checks"]["deferred_dw_autocast/dw"]["ok"]


def test_a_wrong_fast_path_fails_loudly(tmp_path, monkeypatch, capsys):
    import megak3.ops.grouped_gemm as moe

    real = moe._tiled_grouped_linear
    monkeypatch.setattr(moe, "_tiled_grouped_linear", lambda x, w, r: real(x, w, r) * 1.001)
    out = tmp_path / "bad.json"
    rc = gpu_check.main(["--device", "cpu", "--parts", "grouped_gemm", "--out", str(out)])
    assert rc == 1
    text = capsys.readouterr().out
    assert "FAIL: grouped_gemm: tiled_fp32/out: relative error" in text
    report = json.loads(out.read_text())
    assert report["parts"]["grouped_gemm"]["status"] == "fail"
    assert report["parts"]["grouped_gemm"]["checks"]["tiled_fp32/out"]["rel_err"] == pytest.approx(1e-3, rel=1e-3)


def _fake_cuda_memory(monkeypatch, events):
    """torch.cuda's memory calls on a CPU box: recorded in ``events``; 0 bytes allocated, peak 123."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: events.append("reset_peak"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 123)
    monkeypatch.setattr(gpu_attention, "sync", lambda dev: None)


def test_attention_peak_memory_is_measured_cold(monkeypatch):
    """The measured call is the first attention() call at its shape: no warm-up call before it
    (a warm-up would cache the block mask and allocator pools and hide them), the allocator's
    cache emptied and the peak reset right before it."""
    from megak3.ops import attention as A

    events = []
    _fake_cuda_memory(monkeypatch, events)
    real = A.attention
    monkeypatch.setattr(A, "attention", lambda *a, **k: (events.append("attention"), real(*a, **k))[1])
    A._block_mask_cache[:] = [("stale", None, None)]
    assert gpu_attention._peak_bytes(torch.device("cpu"), 1, 2, 64, 8, 8, docs=True) == 123
    assert events.count("attention") == 1, events
    first = events.index("attention")
    assert "empty_cache" in events[:first] and events[first - 1] == "reset_peak", events
    assert A._block_mask_cache == []


def test_block_mask_checks_compare_with_create_block_mask(monkeypatch):
    """gpu_check's block-mask part (CUDA-only) on CPU with its memory calls faked: the equality with
    torch's create_block_mask is real, and a wrong mask fails it."""
    from megak3.ops import attention as A

    _fake_cuda_memory(monkeypatch, [])
    chk = gpu_common.Check()
    out = gpu_attention._block_mask_checks(torch.device("cpu"), 4096, chk)
    assert chk.failures == [] and out["peak_bytes"] == 123 and out["dense_int64_mask_bytes"] == 8 * 4096 ** 2
    real = A.flex_block_tiles
    monkeypatch.setattr(A, "flex_block_tiles", lambda *a, **k: tuple(t.clone().fill_(True) for t in real(*a, **k)))
    chk = gpu_common.Check()
    gpu_attention._block_mask_checks(torch.device("cpu"), 4096, chk)
    assert any("create_block_mask" in f for f in chk.failures)
