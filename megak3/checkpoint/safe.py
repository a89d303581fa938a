"""Safe loading of checkpoint pickles: tensors, plain containers and primitives only.

Everything megak3 writes into a checkpoint (``state.pt``, the per-rank ``objects`` files, the older
format's parts) is saved with :func:`safe_dumps`, which refuses a value that would need the full
unpickler before anything is written, and read back with :func:`safe_load` (``torch.load(...,
weights_only=True)``). A file that needs the full unpickler is refused with :class:`UnsafeCheckpointError`
naming the file; a resume never skips over it to an older checkpoint.
"""
from __future__ import annotations

import io
import pickle

import torch

from .atomic import CheckpointError


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file needs the full unpickler (planted code): refused, never skipped over."""


def safe_load(data: bytes, name, map_location="cpu"):
    """Unpickle checkpoint bytes with torch's safe loader (``weights_only=True``: tensors, plain
    containers, primitives). A file that needs the full unpickler is refused with one line naming
    it: checkpoints travel between people and clusters and a manifest's hashes are not signatures,
    so a replaced pickle must never run."""
    try:
        return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UnsafeCheckpointError(f"checkpoint file {name} holds objects that only a full unpickler could load "
                                    f"(refused; nothing in it was run): {first[:160]}") from None


def safe_dumps(obj, what: str) -> bytes:
    """``torch.save`` bytes of ``obj``, checked to load with :func:`safe_load`: a value that would
    need the full unpickler is refused before anything is written, naming it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"checkpoint {what} must hold only tensors, plain containers and primitives "
                         f"(weights_only-loadable): {first[:160]}") from None
    return data
