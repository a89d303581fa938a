"""Materialise a parallelized meta-device model: allocate and initialise only this rank's shards.

Each parameter becomes ``init_slice(seed, canonical name, global shape, this rank's box)``
(:mod:`megak3.model.init`), so a rank's shard is bitwise equal to the same box of the
single-process initialisation while the rank never holds more than its shards plus one init tile.
Buffers start at zero (the only persistent buffer, the router's selection bias, is zero-initialised
by its module).
"""
from __future__ import annotations

import torch
from torch import nn

from megak3.model.init import init_slice

from .plan import ParallelPlan, canonical_name


@torch.no_grad()
def materialize(model: nn.Module, plan: ParallelPlan, seed: int, std: float, device="cpu") -> nn.Module:
    """Replace every meta parameter/buffer of ``model`` by its initialised local shard on ``device``."""
    device = torch.device(device)
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for local, p in list(mod.named_parameters(recurse=False)):
            name = canonical_name(prefix + local)
            s = plan.tensors[name]
            if tuple(p.shape) != s.local_shape:
                raise AssertionError(f"materialize: {name} is {tuple(p.shape)}, the plan says {s.local_shape}")
            val = init_slice(mod, local, name, s.global_shape, s.offsets, s.local_shape, p.dtype, seed, std)
            setattr(mod, local, nn.Parameter(val.to(device), requires_grad=p.requires_grad))
        for local, b in list(mod.named_buffers(recurse=False)):
            mod._buffers[local] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    return model
