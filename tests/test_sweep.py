"""Layout sweeps: ``python -m megak3.train -m parallel=...`` runs each layout on its own torchrun
ranks, a layout that cannot run is recorded as failed without stopping the sweep, and
tools/sweep_report.py tabulates the jobs. Reference: the one-process job of the same sweep."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megak3.launch import sweep as S

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"hidden_size": 64, "dense_intermediate_size": 128, "kda.num_heads": 2, "kda.head_dim": 16,
         "kda.gate_rank": 8, "kda.chunk_size": 16, "mla.num_heads": 2, "mla.q_lora_rank": 32,
         "mla.kv_lora_rank": 16, "mla.qk_nope_head_dim": 8, "mla.qk_rope_head_dim": 8, "mla.v_head_dim": 8,
         "moe.num_experts": 8, "moe.top_k": 2, "moe.expert_intermediate_size": 32, "moe.latent_size": 32,
         "vision.enabled": False, "vocab_size": 512}


def _report():
    spec = importlib.util.spec_from_file_location("sweep_report", ROOT / "tools" / "sweep_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def common_overrides(prefix, tok):
    out = [f"data.path={prefix}", f"data.tokenizer={tok}", "data.seq_len=32", "data.valid_fraction=0.1",
           "train.global_batch_size=4", "train.micro_batch_size=1", "train.eval_batches=1",
           "train.eval_interval=0", "train.save_interval=0", "train.seed=3", "optim.warmup_steps=1",
           "optim.lr=1e-3", "optim.ns_dtype=float32", "logging.progress_bar=false", "logging.wandb=false",
           "logging.log_interval=1", "logging.nvml=false"]
    return out + [f"model.{k}={v}" for k, v in SMALL.items()]


def test_error_line_picks_the_cause():
    log = ("Traceback (most recent call last):\n  File x\nValueError: parallel.tp=4 does not divide 2\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\n")
    assert S.error_line(log) == "ValueError: parallel.tp=4 does not divide 2"
    assert S.error_line("foo\nmegak3.train: error: data.path=x: not found\nbar\n") == "data.path=x: not found"
    assert S.error_line("") == "no output"


def test_report_sorts_by_throughput_and_marks_failures(tmp_path):
    for name, tps, status in (("a", 100.0, "ok"), ("b", 300.0, "ok"), ("c", None, "failed")):
        d = tmp_path / name
        S.write_status(d, status, None if status == "ok" else "parallel.tp=8 too large", layout=name, nproc=2,
                       peak_memory_mb_per_rank=[10.0, 12.0] if tps else None)
        if tps:
            recs = [{"step": s, "kind": "train", "loss": 5.0 - s, "tokens_per_s": tps * (0.1 if s == 1 else 1),
                     "step_time_ms": 1000.0 / tps, "peak_memory_mb": 9.0} for s in (1, 2, 3)]
            (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    rep = _report()
    rows = rep.rows_of(tmp_path)
    assert [r["layout"] for r in rows] == ["b", "a", "c"]
    assert rows[0]["tokens_per_s"] == 300.0  # the first (warm-up) window is skipped
    assert rows[0]["final_loss"] == 2.0 and rows[0]["peak_memory_mb_per_rank"] == [10.0, 12.0]
    table = rep.format_table(rows)
    assert "failed: parallel.tp=8 too large" in table.splitlines()[-1]
    assert rep.main([str(tmp_path)]) == 0 and (tmp_path / "sweep_report.png").stat().st_size > 1000
    assert rep.main([str(tmp_path / "missing")]) == 2


@pytest.mark.slow
def test_real_sweep_three_layouts_and_a_failure(corpus_dataset, tmp_path):
    prefix, tok = corpus_dataset
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "megak3.train", "-m", "parallel=single,tp1_dp2,tp2_dp1,tp4_dp1",
           "train.max_steps=3", f"hydra.sweep.dir={sweep_dir}"] + common_overrides(prefix, tok)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    jobs = {S.read_status(d)["layout"]: d for d in S.find_jobs(sweep_dir)}
    assert sorted(jobs) == ["single", "tp1_dp2", "tp2_dp1", "tp4_dp1"]
    st = {k: S.read_status(d) for k, d in jobs.items()}
    for k in ("single", "tp1_dp2", "tp2_dp1"):
        assert st[k]["status"] == "ok", st[k]
    assert st["tp1_dp2"]["nproc"] == 2 and st["tp2_dp1"]["nproc"] == 2 and st["single"]["nproc"] == 1
    assert len(st["tp2_dp1"]["peak_memory_mb_per_rank"]) == 2
    # tp=4 cannot split 2 heads: failed with the reason, before any rank started, sweep went on
    assert st["tp4_dp1"]["status"] == "failed" and "parallel.tp" in st["tp4_dp1"]["error"]
    assert not (jobs["tp4_dp1"] / "train.log").exists()

    def losses(d):
        return {m["step"]: m["loss"] for m in S.read_metrics(d) if m.get("kind") == "train"}

    ref = losses(jobs["single"])
    assert sorted(ref) == [1, 2, 3]
    for k in ("tp1_dp2", "tp2_dp1"):  # each layout really trained the same model on its own ranks
        got = losses(jobs[k])
        for s in (1, 2, 3):
            assert abs(got[s] - ref[s]) <= 1e-4, (k, got, ref)
    rep = _report()
    rows = rep.rows_of(sweep_dir)
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "failed"]
    tps = [r["tokens_per_s"] for r in rows[:3]]
    assert tps == sorted(tps, reverse=True) and all(t > 0 for t in tps)
    assert rep.main([str(sweep_dir)]) == 0 and (sweep_dir / "sweep_report.png").exists()
