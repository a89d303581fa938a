"""tools/gpu_check.py: the no-GPU mode skips every part with one line and exits 0; the CPU dry pass
runs parts b-d at tiny shapes against their twins; a broken fast path makes it exit 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402


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
                      "host_syncs": "skip", "te_fp8": "skip", "apex_rms_norm": "skip"}
    att = report["parts"]["mla_attention"]["checks"]
    # fp32: the same math (attention() on CPU with documents is the chunked twin): ~1e-7
    assert att["fp32/docs/attention_vs_reference"]["rel_err"] < 1e-5
    assert att["fp32/docs/dq"]["rel_err"] < 1e-5
    # bf16 outputs: rounding of the output, ~2^-9, far from 0 and within the bf16 tolerance
    assert 1e-4 < att["bf16/docs/attention_vs_reference"]["rel_err"] < gpu_check.TOL_BF16
    gg = report["parts"]["grouped_gemm"]
    assert gg["checks"]["tiled_fp32/out"]["rel_err"] < 1e-6
    assert gg["checks"]["grouped_mm_bf16/dw"]["rel_err"] < gpu_check.TOL_BF16
    assert sum(1 for c in gg["checks"].values() if c["ok"]) == len(gg["checks"]) >= 9
    tp = report["parts"]["throughput"]
    assert tp["tokens_per_s"] > 0 and 0 < tp["mfu"] < 1
    # the planner's FLOPs per token of the model that ran
    from megak3.config import load_model_config
    from megak3.launch.planner import flops_per_token
    from parallel.parity import PARITY_MODEL

    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    assert tp["train_flops_per_token"] == pytest.approx(flops_per_token(cfg, tp["seq_len"])["train"])
    assert tp["losses"][-1] < tp["losses"][0]


def test_a_wrong_fast_path_fails_loudly(tmp_path, monkeypatch, capsys):
    import megak3.model.moe as moe

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
