"""The training program under expert parallelism (torchrun, gloo, fp32): ep2 x dp2 with MoonEP,
tp2 (+SP) x ep2 with MoonEP and with the baseline dispatcher reproduce the single-process losses;
an ep2 checkpoint resumes at ep4 with the same losses (one process: test_checkpoint_reshard.py); the run directory's
expert-load log renders with tools/expert_load.py."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_train_parallel import ROOT, _losses, _run

pytestmark = pytest.mark.slow


def test_expert_parallel_layouts_and_resume(corpus_dataset, tmp_path):
    _run.corpus = corpus_dataset
    ref = tmp_path / "single"
    _run(ref, 1, "train.max_steps=4", "logging.log_interval=1")
    want = _losses(ref)

    layouts = {"ep2dp2": ["parallel.ep=2"],
               "tp2sp_ep2": ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
               "tp2sp_ep2_baseline": ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                      "moonep.enabled=false"]}
    for name, extra in layouts.items():
        d = tmp_path / name
        _run(d, 4, "train.max_steps=2", "logging.log_interval=1", *extra)
        got = _losses(d)
        for s in (1, 2):
            assert abs(got[s] - want[s]) <= 1e-4 * abs(want[s]), (name, got, want)
        metrics = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
        train = [m for m in metrics if m.get("kind") == "train"]
        assert all("moe/rank_imbalance_after" in m for m in train), train[-1].keys()
        if "baseline" not in name:  # MoonEP computes exactly S*K rows on every rank
            assert all(m["moe/rank_imbalance_after"] <= 1e-9 for m in train), [m["moe/rank_imbalance_after"] for m in train]

    src = tmp_path / "ep2dp2"
    for name, nproc, extra in (("ep4", 4, ["parallel.ep=4"]),):  # one process: test_checkpoint_reshard.py
        d = tmp_path / f"resume_{name}"
        shutil.copytree(src / "checkpoints", d / "checkpoints")
        r = _run(d, nproc, "train.max_steps=4", "train.resume=auto", *extra)
        assert "resumed from" in r.stdout and "step_00000002" in r.stdout
        resumed = _losses(d)
        for s in (3, 4):
            assert abs(resumed[s] - want[s]) <= 1e-4 * abs(want[s]), (name, resumed, want)

    r = subprocess.run([sys.executable, "tools/expert_load.py", str(src), "--out", str(tmp_path / "plots")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list((tmp_path / "plots").glob("*.png")), r.stdout
