"""Logging / telemetry configuration (the ``logging`` config group)."""
from __future__ import annotations

import os
from dataclasses import dataclass

WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class LoggingConfig:
    """What the training loop reports, and where."""

    log_interval: int = 10
    """print a console line every this many optimizer steps (JSONL / wandb get every logged step)"""
    progress_bar: bool = True
    """show a tqdm progress bar with ETA on stderr (rank 0 only)"""
    wandb: bool = True
    """log to Weights & Biases; a wandb failure never stops training, it only disables wandb"""
    wandb_project: str = "megak3"
    """wandb project name"""
    wandb_mode: str = "offline"
    """wandb mode: offline (files under the run dir), online, or disabled; env WANDB_MODE overrides"""
    jsonl: bool = True
    """append every metrics dict to <run_dir>/metrics.jsonl"""
    nvml: bool = True
    """sample GPU power / memory / utilisation through NVML when a driver is present"""

    def validate(self) -> "LoggingConfig":
        """Raise ``ValueError`` naming the field and the fix; returns self."""
        if not isinstance(self.log_interval, int) or self.log_interval < 1:
            raise ValueError(f"logging.log_interval={self.log_interval!r} must be an int >= 1")
        if self.wandb_mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb_mode={self.wandb_mode!r} must be one of {WANDB_MODES}")
        if self.wandb and not self.wandb_project:
            raise ValueError("logging.wandb_project is empty; set a project name or logging.wandb=false")
        return self

    def resolved_wandb_mode(self) -> str:
        """The wandb mode actually used: "disabled" if ``wandb`` is off, else env WANDB_MODE or
        ``wandb_mode``."""
        if not self.wandb:
            return "disabled"
        return os.environ.get("WANDB_MODE") or self.wandb_mode
