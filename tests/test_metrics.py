"""Training logger (JSONL, console, wandb offline), telemetry and throughput."""
import json
import math
import os
import sys

import pytest
import torch

from megak3.metrics import GPUTelemetry, LoggingConfig, Throughput, TrainLogger, peak_memory_source


def _cfg(**kw) -> LoggingConfig:
    kw.setdefault("wandb", False)
    return LoggingConfig(**kw)


def _train_metrics(step):
    return {"loss": torch.tensor(3.0 - 0.1 * step), "lr": 1e-3 * step, "grad_norm": 0.5,
            "tokens_per_s": 1000.0 * step, "step_time_ms": 12.5, "peak_memory_mb": 256.0,
            "expert_load_max_violation": 0.25}


def test_jsonl_records_every_step_and_console_every_interval(tmp_path, capsys):
    with TrainLogger(tmp_path, _cfg(log_interval=2), total_steps=5) as lg:
        for step in range(1, 6):
            lg.log(step, _train_metrics(step))
        lg.log_eval(5, {"loss": 2.25, "ppl": math.exp(2.25)})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5]
    assert [r["kind"] for r in records] == ["train"] * 5 + ["eval"]
    assert set(_train_metrics(1)) <= set(records[0])
    assert records[2]["loss"] == pytest.approx(2.7) and isinstance(records[2]["loss"], float)
    assert records[3]["lr"] == pytest.approx(4e-3)
    assert records[5]["ppl"] == pytest.approx(math.exp(2.25))
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" |")[0] for line in out] == ["step 2", "step 4", "eval 5"]
    assert "loss 2.8000" in out[0] and "tok/s 2,000" in out[0] and "maxvio 0.250" in out[0]


def test_resume_appends_and_bar_starts_at_resume_step(tmp_path):
    with TrainLogger(tmp_path, _cfg(), total_steps=10) as lg:
        lg.log(1, {"loss": 1.0})
    with TrainLogger(tmp_path, _cfg(), total_steps=10, start_step=7) as lg:
        assert lg._bar.n == 7
        lg.log(8, {"loss": 0.5})
        assert lg._bar.n == 8
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 8]


def test_nonzero_rank_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    lg = TrainLogger(run_dir, LoggingConfig(wandb=True, log_interval=1), total_steps=3, rank=1)
    lg.log(1, {"loss": 1.0})
    lg.log_eval(1, {"loss": 1.0})
    lg.close()
    assert not run_dir.exists()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_wandb_offline_run_lands_under_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    with TrainLogger(tmp_path, LoggingConfig(progress_bar=False), total_steps=2,
                     config_dict={"model": {"name": "k3_tiny"}}) as lg:
        assert lg._wandb_run is not None
        lg.log(1, {"loss": 1.5})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))


def test_wandb_failure_prints_one_notice_and_training_continues(tmp_path, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")

    def broken_init(**kw):
        raise RuntimeError("no wandb today")

    monkeypatch.setattr(wandb, "init", broken_init)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with TrainLogger(tmp_path, LoggingConfig(progress_bar=False, log_interval=1), total_steps=2) as lg:
        lg.log(1, {"loss": 1.0})
        lg.log(2, {"loss": 0.9})
    out = capsys.readouterr().out.splitlines()
    assert sum("no wandb today" in line for line in out) == 1
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_wandb_mode_resolution_and_validation(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert LoggingConfig().resolved_wandb_mode() == "offline"
    assert LoggingConfig(wandb=False).resolved_wandb_mode() == "disabled"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert LoggingConfig(wandb_mode="online").resolved_wandb_mode() == "disabled"
    with pytest.raises(ValueError, match="logging.log_interval"):
        LoggingConfig(log_interval=0).validate()
    with pytest.raises(ValueError, match="logging.wandb_mode"):
        LoggingConfig(wandb_mode="cloud").validate()


def test_gpu_telemetry_unavailable_is_quiet_and_empty(monkeypatch, capsys):
    pynvml = pytest.importorskip("pynvml")

    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    tel = GPUTelemetry()
    assert tel.available is False and tel.sample() == {} and tel.sample() == {}
    tel.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("NVML unavailable (") and "GPU telemetry skipped" in err[0]


def test_gpu_telemetry_on_this_machine():
    """CPU box: reports unavailable without raising; GPU box: the three readings, in range."""
    tel = GPUTelemetry(verbose=False)
    sample = tel.sample()
    if not tel.available:
        assert sample == {}
    else:
        assert 0 <= sample["gpu_util_pct"] <= 100 and sample["gpu_mem_used_mb"] > 0
        assert sample.get("gpu_power_w", 1.0) > 0
    tel.close()


def _rss_mb():
    """This process's current resident set (statm's second field, pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


_PEAK_CHILD = """
import json, torch
from megak3.metrics import peak_memory_mb
from tests.test_metrics import _rss_mb
before_peak, rss = peak_memory_mb(), _rss_mb()
size_mb = max(0.0, before_peak - rss) + 64  # above the old peak by 64 MiB
buf = torch.ones(int(size_mb * 2**20) // 4)  # written, so resident
print(json.dumps([before_peak, rss, size_mb, peak_memory_mb()]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_peak_memory_follows_a_known_allocation():
    """Independent reference: a tensor of known size, touched page by page, must lift the peak to
    at least the resident set before it plus its size (and not far past it). Measured in a fresh
    process: in a long-lived test worker the allocator can serve the tensor from memory that is
    already resident (freed by an earlier test), so neither RSS nor its peak would move."""
    import json
    import subprocess
    from pathlib import Path

    if peak_memory_source() != "host_peak_rss":
        pytest.skip("CUDA in use: peak_memory_mb reports torch.cuda.max_memory_allocated")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    before_peak, rss, size_mb, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert after >= rss + 0.98 * size_mb, (before_peak, rss, size_mb, after)
    assert after <= rss + size_mb + 32, (before_peak, rss, size_mb, after)


def test_throughput_from_clock_deltas():
    now = [100.0]
    tp = Throughput(clock=lambda: now[0])
    now[0] += 0.5
    assert tp.step(tokens=4096) == {"tokens_per_s": pytest.approx(8192.0), "step_time_ms": pytest.approx(500.0)}
    now[0] += 2.0
    r = tp.step(tokens=10_000, steps=4)  # an interval covering 4 steps
    assert r["tokens_per_s"] == pytest.approx(5000.0) and r["step_time_ms"] == pytest.approx(500.0)
    now[0] += 30.0
    tp.reset()  # e.g. after an eval pass
    now[0] += 1.0
    assert tp.step(tokens=100)["tokens_per_s"] == pytest.approx(100.0)


def test_console_line_skips_missing_and_nonfinite():
    line = TrainLogger.format_line(7, {"loss": float("nan"), "lr": 2e-4, "other": 1})
    assert line == "step 7 | loss nan | lr 2.000e-04"
