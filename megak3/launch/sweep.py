"""Per-job status files of a run or sweep, and the summary ``tools/sweep_report.py`` prints.

Every job directory (Hydra's ``multirun/<time>/<num>/`` or a run's directory) gets
``status.json`` from ``python -m megak3.train``::

    {"status": "ok" | "failed" | "preempted", "error": "<one line>" | null, "layout": "tp2_dp2",
     "degrees": {"tp": 2, "dp": 2, ...}, "nproc": 4, "overrides": [...], "returncode": 0,
     "peak_memory_mb_per_rank": [...], "wall_s": 12.3}

next to the trainer's ``metrics.jsonl`` (rank 0's train/eval records).
"""
from __future__ import annotations

import json
import math
import re
import statistics
import time
from pathlib import Path
from typing import Optional

STATUS_FILE = "status.json"
STATUSES = ("ok", "failed", "preempted", "running")


def write_status(job_dir, status: str, error: Optional[str] = None, **extra) -> Path:
    """Write ``job_dir/status.json`` atomically (a reader never sees half a file)."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r} is not one of {STATUSES}")
    d = Path(job_dir)
    d.mkdir(parents=True, exist_ok=True)
    rec = {"status": status, "error": error, "time": time.time(), **extra}
    tmp = d / (STATUS_FILE + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    tmp.replace(d / STATUS_FILE)
    return d / STATUS_FILE


def read_status(job_dir) -> Optional[dict]:
    p = Path(job_dir) / STATUS_FILE
    if not p.exists():
        return None
    return json.loads(p.read_text())


_ERR = re.compile(r"^(?:\[[^\]]*\]:?\s*)?(?:[\w.]+\.)?(\w*(?:Error|Exception|Interrupt|Exit)\b.*)$")


def error_line(log_text: str) -> str:
    """The most telling line of a failed job's output: the trainer's ``megak3.train: error: ...``
    line, else the last ``XxxError: ...`` line that is not torchrun's ChildFailedError wrapper,
    else the last non-empty line."""
    lines = [l.strip() for l in log_text.splitlines() if l.strip()]
    for l in reversed(lines):
        if "megak3.train: error:" in l:
            return l.split("megak3.train: error:", 1)[1].strip()
    for l in reversed(lines):
        m = _ERR.match(l)
        if m and "ChildFailedError" not in l and ":" in m.group(1):
            return m.group(1)
    return lines[-1] if lines else "no output"


def read_metrics(job_dir) -> list:
    p = Path(job_dir) / "metrics.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a half-written last line of a killed job
    return out


def summarize_job(job_dir) -> dict:
    """One row of the report: layout, tokens/s, step time, peak memory per rank, losses, status.

    Throughput is the median over the logged windows after the first one (which pays start-up
    costs) when there are several; a job with no train records gets None."""
    job_dir = Path(job_dir)
    st = read_status(job_dir) or {"status": "failed", "error": "no status.json (job never started or was killed)"}
    recs = read_metrics(job_dir)
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    timed = [r for r in train if isinstance(r.get("tokens_per_s"), (int, float))]
    if len(timed) > 1:
        timed = timed[1:]

    def med(key):
        vals = [r[key] for r in timed if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return statistics.median(vals) if vals else None

    per_rank = st.get("peak_memory_mb_per_rank") or []
    if not per_rank:
        mem = [r["peak_memory_mb"] for r in train if isinstance(r.get("peak_memory_mb"), (int, float))]
        per_rank = [max(mem)] if mem else []
    layout = st.get("layout") or job_dir.name
    return {
        "job": job_dir.name, "dir": str(job_dir), "layout": layout, "degrees": st.get("degrees"),
        "nproc": st.get("nproc"), "status": st.get("status", "failed"), "error": st.get("error"),
        "tokens_per_s": med("tokens_per_s"), "step_time_ms": med("step_time_ms"),
        "peak_memory_mb_per_rank": per_rank,
        "final_loss": train[-1]["loss"] if train and "loss" in train[-1] else None,
        "final_val_loss": evals[-1].get("val_loss") if evals else None,
        "steps": train[-1]["step"] if train else 0,
    }


def find_jobs(sweep_dir) -> list:
    """Job directories under a sweep directory: every folder holding status.json or metrics.jsonl
    (the sweep directory itself when it is a single run)."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise ValueError(f"sweep directory {root} does not exist")
    dirs = {p.parent for pat in (STATUS_FILE, "metrics.jsonl") for p in root.rglob(pat)}
    dirs = {d for d in dirs if "checkpoints" not in d.parts and "wandb" not in d.parts}

    def key(d):
        name = d.relative_to(root).as_posix()
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]

    return sorted(dirs, key=key)
