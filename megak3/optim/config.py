"""Optimizer + LR-schedule configuration (K3_SPEC.md §9).

Muon (Moonlight convention) for matrices, AdamW for everything else, one shared peak LR η and
weight decay λ: Moonlight's 0.2·sqrt(max(A, B)) scaling makes the Muon update RMS match AdamW's,
so a single η serves both. ``validate()`` raises ``ValueError`` naming ``optim.<field>``.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

SCHEDULES = ("cosine", "wsd", "constant")
OFFLOADS = ("none", "cpu")
OFFLOAD_IMPLS = ("auto", "deepspeed", "torch")
DEEPSPEED_INSTALL = "pip install -c tools/constraints.txt --no-build-isolation -e '.[offload]'"
"""how to install DeepSpeed for optim.offload_impl (the version setup.py's [offload] extra pins)"""
MAX_LR = 1e6
"""largest accepted peak learning rate: a run that diverges is caught by train.nonfinite; far larger
values (1e38) overflow the fp32 update itself"""


@dataclass
class OptimConfig:
    """Hyperparameters of :func:`megak3.optim.build_optimizer` and :func:`megak3.optim.lr_at`."""

    lr: float = 3e-3
    """peak learning rate η shared by Muon (RMS-matched) and AdamW"""
    min_lr_ratio: float = 0.1
    """final LR as a fraction of ``lr`` (end of the cosine / WSD decay)"""
    weight_decay: float = 0.1
    """decoupled weight decay λ: W <- W·(1 - η·λ) for the decayed groups"""
    muon_momentum: float = 0.95
    """Muon momentum μ in M = μ·M + G"""
    nesterov: bool = True
    """Muon orthogonalises G + μ·M (Nesterov) instead of M"""
    ns_steps: int = 5
    """Newton–Schulz iterations per Muon step"""
    adam_beta1: float = 0.9
    """AdamW β1"""
    adam_beta2: float = 0.95
    """AdamW β2"""
    adam_eps: float = 1e-8
    """AdamW ε (Moonlight value)"""
    ns_dtype: str = "bfloat16"
    """Newton–Schulz compute dtype: 'bfloat16' (Muon's default, fast on GPUs) or 'float32' (exact parity runs)"""
    per_head_muon: bool = True
    """orthogonalise the q/k/v (KDA) and q_b/kv_b (MLA) momentum per head (K3 Per-Head Muon, §9.3)"""
    schedule: str = "cosine"
    """LR schedule after warmup: 'cosine' | 'wsd' | 'constant'"""
    warmup_steps: int = 0
    """linear-warmup length in optimizer steps"""
    decay_fraction: float = 0.1
    """WSD only: fraction of max_steps spent in the final linear decay"""
    grad_clip: float = 1.0
    """max global gradient L2 norm applied by the training loop; 0 disables clipping"""
    offload: str = "none"
    """where the AdamW groups' state (exp_avg, exp_avg_sq, step) lives and is updated: 'none' (beside
    the params) | 'cpu' (host memory, megak3/optim/offload.py); Muon always stays with its params"""
    offload_impl: str = "auto"
    """offload=cpu kernel: 'deepspeed' (DeepSpeed's CPU Adam, the [offload] extra) | 'torch' (torch's
    fused CPU AdamW on the host tensors) | 'auto' (deepspeed when it loads, else torch with a warning)"""

    def validate(self, max_steps: int | None = None) -> "OptimConfig":
        """Check every field; the step-dependent checks run only when ``max_steps`` is given."""

        def need(ok: bool, field: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"optim.{field}={getattr(self, field)!r} {rule}")

        need(0 < self.lr <= MAX_LR, "lr", f"must be in (0, {MAX_LR:g}] (typical: 1e-4 to 1e-2)")
        need(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "must be in [0, 1]")
        need(0 <= self.weight_decay <= 1e3, "weight_decay", "must be in [0, 1000] (typical: 0.1)")
        need(0.0 <= self.muon_momentum < 1.0, "muon_momentum", "must be in [0, 1)")
        need(isinstance(self.ns_steps, int) and 1 <= self.ns_steps <= 100, "ns_steps", "must be an int in [1, 100]")
        need(0.0 <= self.adam_beta1 < 1.0, "adam_beta1", "must be in [0, 1)")
        need(0.0 <= self.adam_beta2 < 1.0, "adam_beta2", "must be in [0, 1)")
        need(0 < self.adam_eps < 1, "adam_eps", "must be in (0, 1) (typical: 1e-8)")
        need(self.ns_dtype in ("bfloat16", "float32"), "ns_dtype", "must be 'bfloat16' or 'float32'")
        need(self.schedule in SCHEDULES, "schedule", f"must be one of {SCHEDULES}")
        need(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "warmup_steps",
             "must be an int >= 0")
        need(0.0 < self.decay_fraction <= 1.0, "decay_fraction", "must be in (0, 1]")
        need(0 <= self.grad_clip < float("inf"), "grad_clip", "must be a finite number >= 0 (0 disables clipping)")
        need(self.offload in OFFLOADS, "offload", f"must be one of {OFFLOADS}")
        need(self.offload_impl in OFFLOAD_IMPLS, "offload_impl", f"must be one of {OFFLOAD_IMPLS}")
        if max_steps is None:
            return self
        if max_steps <= 0:
            raise ValueError(f"max_steps={max_steps} must be > 0")
        need(self.warmup_steps < max_steps, "warmup_steps", f"must be < train.max_steps={max_steps}")
        if self.schedule == "wsd":
            decay = wsd_decay_steps(self, max_steps)
            need(self.warmup_steps + decay <= max_steps, "decay_fraction",
                 f"gives {decay} decay steps; with optim.warmup_steps={self.warmup_steps} that "
                 f"exceeds max_steps={max_steps}")
        return self


def offload_error(cfg: OptimConfig) -> str | None:
    """Why this machine cannot run ``cfg``'s offload kernel (one line naming the field), or None.
    Checked where the job runs (megak3/job/compose.py check_local), not where it is composed."""
    if cfg.offload == "cpu" and cfg.offload_impl == "deepspeed" and find_spec("deepspeed") is None:
        return (f"optim.offload_impl='deepspeed' needs DeepSpeed, which is not installed: {DEEPSPEED_INSTALL}, "
                "or set optim.offload_impl=torch")
    return None


def wsd_decay_steps(cfg: OptimConfig, max_steps: int) -> int:
    """Length of the WSD decay phase: round(decay_fraction · max_steps), at least 1."""
    return max(1, round(cfg.decay_fraction * max_steps))
