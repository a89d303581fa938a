"""Learning-rate schedules: linear warmup, then cosine, WSD or constant (K3_SPEC.md §9.5).

``step`` counts optimizer steps from 0 (the LR used for the first update). With W warmup steps,
steps 0..W-1 use ``lr·(step+1)/(W+1)``: step 0 is already nonzero so the first update learns, and
the ramp meets the post-warmup value ``lr`` at step W without a jump. Then, with
``min_lr = min_lr_ratio·lr``:

* cosine:   ``min_lr + (lr - min_lr)·(1 + cos(π·t))/2``, t = (step - W)/(max_steps - W), so
  ``min_lr`` exactly at ``step = max_steps`` (K3 used cosine: it beat WSD when both were tuned).
* wsd:      ``lr`` until the last ``round(decay_fraction·max_steps)`` steps, then a linear decay
  reaching ``min_lr`` at ``max_steps`` (K2 / Kimi Linear recipe).
* constant: ``lr``.

Steps beyond ``max_steps`` stay at the final value.
"""
from __future__ import annotations

import math

from .config import OptimConfig, wsd_decay_steps


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a ``max_steps``-step run."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    W = cfg.warmup_steps
    if step < W:
        return cfg.lr * (step + 1) / (W + 1)
    min_lr = cfg.min_lr_ratio * cfg.lr
    step = min(step, max_steps)
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        t = (step - W) / (max_steps - W)
        return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    if cfg.schedule == "wsd":
        decay = wsd_decay_steps(cfg, max_steps)
        start = max_steps - decay
        if step <= start:
            return cfg.lr
        return cfg.lr + (min_lr - cfg.lr) * (step - start) / decay
    raise ValueError(f"optim.schedule={cfg.schedule!r} must be one of ('cosine', 'wsd', 'constant')")


def set_lr(optimizer, lr: float) -> None:
    """Set ``lr`` on every param group (a torch optimizer or :class:`MuonWithAdamW`)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
