"""What every part of tools/gpu_check.py shares: the tolerances, the :class:`Check` collector, the
:class:`Skip` signal, and timing."""
from __future__ import annotations

import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
"""the repository root"""


# tolerances: relative L2 error ||a - b|| / ||b||
TOL_FP32 = 1e-4          # same math in fp32, different kernels (no TF32: torch's default for matmul)
TOL_FP32_TRITON = 5e-3   # Triton kernels (FlexAttention) may use TF32 for fp32 dots
TOL_BF16 = 2e-2          # bf16 inputs / bf16 GEMM output vs an fp32 computation on the same values
TOL_BF16_ULP = 4e-3      # bf16 results of the same rounding steps: at most one bf16 ulp (2^-8) on every element
TOL_FP8_LOSS = 0.05      # FP8 vs bf16 training loss, relative, any of the steps


class Skip(Exception):
    """A part that cannot run here (missing package or device): reported, never a failure."""


class Check:
    """Collects the comparisons of one part; ``failures`` are the lines printed as FAIL."""

    def __init__(self):
        self.results: dict = {}
        self.failures: list = []

    def close(self, name: str, a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
        err = rel_err(a, b)
        self.results[name] = {"rel_err": err, "tol": tol, "ok": err <= tol}
        if not err <= tol:  # NaN fails too
            self.failures.append(f"{name}: relative error {err:.3g} > {tol:g}")
        return err

    def require(self, name: str, ok: bool, what: str) -> None:
        self.results[name] = {"ok": bool(ok), "what": what}
        if not ok:
            self.failures.append(f"{name}: {what}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double().to(a.device)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up run."""
    fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def _gen(dev, seed):
    return torch.Generator(device=dev).manual_seed(seed)
