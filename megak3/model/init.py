"""Deterministic initialisation: every parameter is a pure function of (seed, parameter name).

A parallel layout reproduces the single-process weights exactly by regenerating the same full
tensor from the same (seed, name) and keeping its shard. Modules customise their parameters by
defining ``init_param(local_name, param, generator, std) -> bool``; anything not handled gets
N(0, std) (Linear, Embedding, stacked expert weights). Buffers (e.g. router biases) are zeroed
by their owners' constructors and are not touched here.
"""
from __future__ import annotations

import hashlib

import torch
from torch import nn


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from a stable 63-bit hash of (seed, name)."""
    h = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


def init_full_tensor(module: nn.Module, local_name: str, full_name: str, shape, dtype, seed: int,
                     std: float) -> torch.Tensor:
    """Generate the full (unsharded) initial value of one parameter on CPU."""
    t = torch.empty(shape, dtype=torch.float32)
    p = nn.Parameter(t, requires_grad=False)
    gen = param_generator(seed, full_name)
    handler = getattr(module, "init_param", None)
    if handler is None or not handler(local_name, p, gen, std):
        p.data.normal_(0.0, std, generator=gen)
    return p.data.to(dtype)


@torch.no_grad()
def init_model(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """Initialise every parameter of ``model`` in place (works for models built on any device)."""
    for mod_name, mod in model.named_modules():
        for local, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{local}" if mod_name else local
            if p.device.type == "meta":
                continue
            val = init_full_tensor(mod, local, full, tuple(p.shape), p.dtype, seed, std)
            p.copy_(val.to(p.device))
    return model
