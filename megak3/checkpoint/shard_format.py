"""The per-shard checkpoint format (``megak3.shards.v1``): file names and the on-disk layout.

Every rank writes only its own shards (:mod:`.writer`); any layout reads only what it needs (:mod:`.reader`).

Data model. A checkpoint holds named global tensors (``"model/layers.0.mlp.experts.w1"``,
``"optim/layers.0.mlp.experts.w1/momentum_buffer"``, ...). A rank saves, per key, one box of the
global tensor: a :class:`.writer.ShardEntry` with the local tensor, the global shape and the offsets of the
box (``[offsets, offsets + local.shape)``; any dim may be sliced; the whole tensor is a replicated
one). The caller passes each distinct box from one rank only (e.g. the data-parallel rank 0 of its
replicas); identical duplicate boxes from several ranks are tolerated (the lowest rank's is kept),
partially overlapping boxes are refused at commit.

On disk (one directory per step, committed by :mod:`.atomic`, whose ``latest`` / ``find_latest`` /
``validate_checkpoint`` and pruning it shares with the older formats of :mod:`.legacy`)::

    root/
      .tmp-step_00000100/          staging dir, same name on every rank (created with exist_ok)
      step_00000100/               after the commit (the staging dir renamed)
        shard_00000.bin            rank 0's tensor bytes: each entry's C-contiguous bytes back to back
                                   in sorted key order, no padding (absent when the rank has no entries)
        shard_00000.obj.pt         torch.save of rank 0's ``objects`` (absent when it has none)
        shard_00000.json           rank 0's marker, written LAST by that rank (temp file + os.replace),
                                   folded into the index parts and removed at the commit:
                                   {"format", "rank", "world_size", "step", "seq",
                                    "bin": {"file", "bytes"} | null,
                                    "objects": {"file", "keys", "bytes", "sha256"} | null,
                                    "entries": {key: {"global_shape", "offsets", "shape", "dtype",
                                                      "byte_offset", "nbytes", "crc32"}}}
        shard_00001.* ...          the same for every rank
        state.pt                   torch.save of ``common`` (rank 0)
        index_00000.json ...       tensor index parts (:mod:`.key_index`), one per key group (a decoder
                                   layer's ``model/layers.N`` keys, ``optim/layers.N``, a top-level
                                   module): {"format", "entries": {key: {"global_shape", "dtype",
                                   "chunks": [{"file", "byte_offset", "nbytes", "offsets", "shape",
                                   "crc32"}]}}, "files": {payload file: {"bytes"}}}
        objects_00000.json ...     object index parts: {"format", "entries": {object key: the lowest
                                   rank's file holding it}, "files": {file: {"bytes", "sha256"}}}
        index.json                 {"format", "index_version": 2, "step", "world_size",
                                    "keys" / "object_keys": every key, natural order, front-coded,
                                    "parts" / "object_parts": [[group, sha256]] (part i: file
                                    index_0000i.json / objects_0000i.json)}
        manifest.json              the manifest of :mod:`.atomic`: "format_version": 2,
                                   "format": "megak3.shards.v1", "step", "meta", "created_unix",
                                   "files": {name: {"bytes"[, "sha256"]}} for state.pt, index.json
                                   (with sha256) and the parts (bytes; their sha256 is in index.json).
                                   The per-rank files are listed in the parts that name them, not
                                   here: no file a reader must read grows with the world size
      latest                       "step_00000100", replaced LAST

``dtype`` is the torch dtype's name (``"float32"``, ``"bfloat16"``, ...); the bytes are the tensor's
own, so every dtype round-trips bit for bit. ``crc32`` is zlib's over the chunk's bytes. ``seq``
counts the ``save()`` calls of the writing :class:`.writer.ShardedCheckpointer`; rank 0 accepts only markers
whose ``step``, ``world_size`` and ``seq`` equal its own, so the marker of an earlier failed attempt
"""
from __future__ import annotations

import numpy as np
import torch

from .atomic import CheckpointError, step_dirname

SHARDS_FORMAT = "megak3.shards.v1"
INDEX_NAME = "index.json"


def bin_name(rank: int) -> str:
    return f"shard_{rank:05d}.bin"


def obj_name(rank: int) -> str:
    return f"shard_{rank:05d}.obj.pt"


def marker_name(rank: int) -> str:
    return f"shard_{rank:05d}.json"


def staging_name(step: int) -> str:
    return f".tmp-{step_dirname(step)}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, str(name), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in a checkpoint index")
    return dt


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array sharing its memory."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()
