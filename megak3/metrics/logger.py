"""Training logger: tqdm progress bar, console lines, JSONL and offline Weights & Biases (rank 0).

Metric keys the console line knows about (others still go to JSONL and wandb): ``loss``, ``lr``,
``grad_norm``, ``tokens_per_s``, ``step_time_ms``, ``peak_memory_mb``, ``expert_load_max_violation``.
Values may be Python numbers or 0-d tensors.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

from tqdm import tqdm

from megak3.metrics.config import LoggingConfig

# (key, console label, format) in console order.
_CONSOLE_FIELDS = (
    ("loss", "loss", "{:.4f}"),
    ("lr", "lr", "{:.3e}"),
    ("grad_norm", "gnorm", "{:.3f}"),
    ("tokens_per_s", "tok/s", "{:,.0f}"),
    ("images_per_s", "img/s", "{:,.1f}"),
    ("vision_tokens", "vis tok", "{:,.0f}"),
    ("step_time_ms", "step", "{:.0f}ms"),
    ("tflops_per_rank", "TFLOP/s/rank", "{:.3f}"),
    ("mfu", "mfu", "{:.1%}"),
    ("peak_memory_mb", "mem", "{:,.0f}MB"),
    ("expert_load_max_violation", "maxvio", "{:.3f}"),
)
# Without a TTY (CI, log files) every refresh is a new line, so refresh rarely.
_NON_TTY_MININTERVAL_S = 30.0


def _plain(v: Any) -> Any:
    """JSON-friendly scalar: tensors / numpy scalars -> Python numbers; NaN/inf kept as floats."""
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        return v.item()
    return v


class TrainLogger:
    """Reports training progress; every method is a no-op on ranks other than 0.

    Args:
        run_dir: run directory; receives ``metrics.jsonl`` and wandb's ``wandb/`` folder.
        cfg: what to report (:class:`LoggingConfig`).
        total_steps: optimizer steps of the whole run (progress bar total, ETA).
        rank: global rank of this process.
        config_dict: the run's resolved config, stored as the wandb run config.
        start_step: step the run resumes from, so the bar and ETA count only what is left.
    """

    def __init__(self, run_dir, cfg: LoggingConfig, total_steps: int, rank: int = 0,
                 config_dict: Optional[dict] = None, start_step: int = 0):
        self.enabled = rank == 0
        self.cfg = cfg
        self._bar = None
        self._jsonl = None
        self._wandb_run = None
        if not self.enabled:
            return
        cfg.validate()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            # Append: a resumed run continues the same file (steps may repeat after a rollback).
            self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        # wandb first: its start-up takes seconds and must not count towards the bar's ETA.
        mode = cfg.resolved_wandb_mode()
        if mode != "disabled":
            self._init_wandb(mode, config_dict)
        if cfg.progress_bar:
            tty = sys.stderr.isatty()
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             file=sys.stderr, dynamic_ncols=tty, ncols=None if tty else 100,
                             mininterval=0.1 if tty else _NON_TTY_MININTERVAL_S, smoothing=0.05)

    def start_progress(self) -> None:
        """Restart the bar's clock (tqdm's ``unpause``): called when the training loop starts, so
        start-up and the first evaluation are not counted in its rate and ETA."""
        if self._bar is not None:
            self._bar.unpause()

    def step_done(self, step: int) -> None:
        """Advance the bar to optimizer step ``step`` (every step, between log windows too; a plain
        counter, no host sync)."""
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)

    # ------------------------------------------------------------------------------------ wandb
    def _init_wandb(self, mode: str, config_dict: Optional[dict]) -> None:
        try:
            import wandb

            self._wandb_run = wandb.init(project=self.cfg.wandb_project, dir=str(self.run_dir),
                                         mode=mode, config=config_dict or {},
                                         name=self.run_dir.name, reinit="finish_previous")
        except Exception as e:  # never let wandb stop training
            self._wandb_failed("init", e)

    def _wandb_failed(self, what: str, e: Exception) -> None:
        self._write(f"wandb {what} failed ({type(e).__name__}: {e}); continuing without wandb")
        self._wandb_run = None

    def _wandb_log(self, metrics: dict, step: int) -> None:
        if self._wandb_run is None:
            return
        try:
            self._wandb_run.log(metrics, step=step)
        except Exception as e:
            self._wandb_failed("log", e)

    # ---------------------------------------------------------------------------------- outputs
    def _write(self, line: str) -> None:
        """Print without breaking the progress bar."""
        if self._bar is not None:
            tqdm.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def _append_jsonl(self, record: dict) -> None:
        if self._jsonl is not None:
            # allow_nan: a NaN loss must be recorded, not crash the logger (Python reads it back).
            self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
            self._jsonl.flush()

    @staticmethod
    def format_line(step: int, metrics: dict, prefix: str = "step") -> str:
        """``step 120 | loss 2.3456 | lr 3.000e-04 | ...`` with the known keys that are present."""
        parts = [f"{prefix} {step}"]
        for key, label, fmt in _CONSOLE_FIELDS:
            v = metrics.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                parts.append(f"{label} {fmt.format(v) if math.isfinite(v) else v}")
        return " | ".join(parts)

    # ------------------------------------------------------------------------------- public API
    def write(self, line: str) -> None:
        """Print one informational line on rank 0 (kept out of the metrics file)."""
        if self.enabled:
            self._write(line)

    def log(self, step: int, metrics: dict) -> None:
        """Record the metrics of optimizer step ``step`` (call once per step, 1-based)."""
        if not self.enabled:
            return
        metrics = {k: _plain(v) for k, v in metrics.items()}
        self._append_jsonl({"step": step, "kind": "train", "time": time.time(), **metrics})
        self._wandb_log(metrics, step)
        if self._bar is not None:
            postfix = {}
            if isinstance(metrics.get("loss"), (int, float)):
                postfix["loss"] = f"{metrics['loss']:.4f}"
            if isinstance(metrics.get("tokens_per_s"), (int, float)):
                postfix["tok/s"] = f"{metrics['tokens_per_s']:,.0f}"
            self._bar.set_postfix(postfix, refresh=False)
        self.step_done(step)
        if step % self.cfg.log_interval == 0:
            self._write(self.format_line(step, metrics))

    def log_eval(self, step: int, metrics: dict) -> None:
        """Record evaluation metrics at ``step``: always printed; wandb keys get an ``eval/`` prefix."""
        if not self.enabled:
            return
        metrics = {k: _plain(v) for k, v in metrics.items()}
        self._append_jsonl({"step": step, "kind": "eval", "time": time.time(), **metrics})
        self._wandb_log({f"eval/{k}": v for k, v in metrics.items()}, step)
        extra = " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                           for k, v in metrics.items())
        self._write(f"eval {step} | {extra}")

    def close(self) -> None:
        """Finish wandb, close the bar and the JSONL file (idempotent)."""
        if not self.enabled:
            return
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish()
            except Exception as e:
                self._wandb_failed("finish", e)
            self._wandb_run = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> "TrainLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
