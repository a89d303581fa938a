"""Process-group helpers and the flat collectives of the ZeRO-1 optimizer.

Collectives used: ``reduce_scatter_single`` / ``all_gather_single`` (``reduce_scatter_tensor`` /
``all_gather_into_tensor`` before torch 2.13) and ``all_reduce``; gloo supports all of them in
torch 2.13 (checked with two gloo ranks), as does nccl. A group of size 1 (or ``None``) calls no
collective. Groups carry their own timeouts (parallel/state.py creates them).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

ProcessGroup = Optional[dist.ProcessGroup]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _size(group: ProcessGroup) -> int:
    return 1 if group is None else group.size()


def _rank(group: ProcessGroup) -> int:
    return 0 if group is None else group.rank()


def _timeout_of(group: ProcessGroup, device: torch.device):
    """The timeout ``group`` was created with (None: the default)."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
