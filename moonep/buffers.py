"""Fixed communication buffers, allocated once per (shape, dtype, device) and reused by every layer.

MoonEP makes every EP rank receive exactly S*K rows, so the landing zone of a dispatch (and of a
combine, and of both backward exchanges) is one ``[S*K, L]`` tensor for the whole run. Its content
is consumed (copied into the expert-grouped batch, or into a gradient) before the next exchange
starts, so nothing autograd saves ever aliases it and layers can share it safely.

    pool = BufferPool()
    buf = pool.get((S * K, L), torch.bfloat16, device)   # same tensor on every later call
    pool.allocations                                      # how many tensors were ever allocated
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch


class BufferPool:
    """Dict of persistent tensors keyed by (shape, dtype, device); counts real allocations."""

    def __init__(self):
        self._buffers: Dict[Tuple, torch.Tensor] = {}
        self.allocations = 0

    def get(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        key = (tuple(int(s) for s in shape), dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(key[0], dtype=dtype, device=key[2])
            self._buffers[key] = buf
            self.allocations += 1
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


DEFAULT_POOL = BufferPool()
"""the process-wide pool used when a dispatcher is not given one"""
