"""Parallel layout configuration (``conf/parallel/``).

Degrees of the dense grid (tp x cp x dp x pp) and the expert grid (etp x ep x edp x pp). This
release trains on one rank; the multi-rank layouts are built in parallel/ by the parallel issues,
and a layout this build cannot run is rejected here, before any process group exists.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    """Parallel degrees (all 1 = a single process)."""

    tp: int = 1
    """tensor-parallel degree"""
    pp: int = 1
    """pipeline-parallel degree"""
    dp: int = 1
    """data-parallel degree"""
    cp: int = 1
    """context-parallel degree"""
    ep: int = 1
    """expert-parallel degree"""
    etp: int = 1
    """expert tensor-parallel degree"""
    backend: str = "auto"
    """process-group backend: 'auto' (nccl on CUDA, gloo on CPU), 'gloo' or 'nccl'"""

    def validate(self, world_size: int = 1) -> "ParallelConfig":
        for f in ("tp", "pp", "dp", "cp", "ep", "etp"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{f}={v!r} must be an integer >= 1")
            if v != 1:
                raise ValueError(f"parallel.{f}={v}: multi-rank layouts are not in this build yet "
                                 f"(single-rank trainer); set parallel.{f}=1")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"parallel.backend={self.backend!r}: choose 'auto', 'gloo' or 'nccl'")
        if world_size != 1:
            raise ValueError(f"WORLD_SIZE={world_size}: this build trains on one rank; launch with "
                             "`torchrun --nproc-per-node 1` or plain python")
        return self
