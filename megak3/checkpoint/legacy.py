"""The OLDER checkpoint formats, kept to read (and convert) such checkpoints.

Format version 1 (:func:`save_checkpoint` / :func:`load_checkpoint`): one ``state.pt`` per checkpoint
directory plus per-rank parts ``rank_XXXXX.pt`` (:func:`prepare_staging`, :func:`write_part`,
:func:`commit_checkpoint`), every file listed in the manifest with its size and sha256, committed by
:mod:`.atomic`. Its per-rank parts (``megak3.part.v2``) tag every tensor with its relation to the full
single-process tensor of the same canonical name:

    None           the full tensor (replicated over tensor and expert parallelism)
    ("tp", dim)    chunk ``tp_rank`` of ``tp_size`` along ``dim``  (tensor parallelism)
    ("ep", dim)    chunk ``ep_rank`` of ``ep_size`` along ``dim``  (expert parallelism: routed experts)

Pipeline stages hold disjoint parameter names, so parts are united by name. A part is::

    {"format": PART_FORMAT, "coords": {"tp": [rank, size], "ep": [rank, size], "pp": [rank, size], ...},
     "tags": {name: None | [axis, dim]}, "model": {name: tensor}, "optimizer": ShardedOptimizer.export_state()}

:func:`merge_parts` rebuilds full tensors (model and optimizer state) from any set of parts that covers
every shard of every name; ``tools/convert_checkpoint.py`` writes them as a one-rank per-shard
checkpoint (:mod:`.writer`), which the trainer reads at any layout. ``local_model_state`` /
``local_optimizer_state`` cut the full state down to what one rank of a layout holds, up to tensor
parallelism. The merge materialises full tensors.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterable, List, Optional, Tuple

import torch

from parallel.data_parallel import CANONICAL_FORMAT

from . import atomic
from .atomic import MANIFEST_NAME, STATE_FILE, CheckpointError, check_keep_last, check_step
from .safe import safe_load


# ------------------------------------------------------------------- format version 1: state.pt + parts

class _HashingWriter:
    """Write-only file wrapper that counts bytes and computes sha256 as torch.save streams out,
    so a save never has to read its own (possibly huge) files back."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.nbytes = 0

    def write(self, b) -> int:
        self.sha256.update(b)
        self.nbytes += len(b)
        return self._f.write(b)

    def flush(self) -> None:
        self._f.flush()


def _write_torch_file(path: Path, obj: Any) -> dict:
    """torch.save ``obj`` to ``path`` durably; returns its manifest entry."""
    with open(path, "wb") as f:
        w = _HashingWriter(f)
        torch.save(obj, w)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": w.nbytes, "sha256": w.sha256.hexdigest()}


def save_checkpoint(root, step: int, state: dict[str, Any], meta: Optional[dict] = None,
                    keep_last: Optional[int] = None) -> Path:
    """Save ``state`` as checkpoint ``root/step_<step>/`` atomically and point ``latest`` at it.

    ``state`` is anything ``torch.save`` accepts (tensors, nested dicts/lists, numbers, strings;
    keep it to those so it loads with ``weights_only=True``). ``meta`` is a JSON-serialisable dict
    stored verbatim in the manifest (config, data position, ...). Saving a step that already
    exists replaces it. ``keep_last=N`` then deletes older complete checkpoints so that the N with
    the highest steps remain; the checkpoint just written is never deleted. Returns its path.
    """
    check_step(step)
    check_keep_last(keep_last)
    meta = dict(meta or {})
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint meta must be JSON-serialisable ({e}); put tensors in `state` "
                         f"and convert config objects with dataclasses.asdict") from e

    staging = prepare_staging(root, step)
    return commit_checkpoint(root, step, staging, state, meta=meta, keep_last=keep_last)


def prepare_staging(root, step: int) -> Path:
    """Create the (empty) staging directory of checkpoint ``step`` and return it.

    Multi-rank saves: one rank calls this, every rank writes its part with :func:`write_part`
    into it, and the same rank then calls :func:`commit_checkpoint` with the parts' entries.
    Stale staging directories of crashed saves are removed first.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    atomic.remove_stale(root)
    tmp = root / f".tmp-{atomic.step_dirname(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp


def write_part(staging, filename: str, obj: Any) -> dict:
    """torch.save one part (e.g. a rank's shard) into a staging directory; returns its manifest entry."""
    if "/" in filename or filename in (STATE_FILE, MANIFEST_NAME):
        raise ValueError(f"checkpoint part name {filename!r} must be a plain file name other than "
                         f"{STATE_FILE} and {MANIFEST_NAME}")
    return _write_torch_file(Path(staging) / filename, obj)


def commit_checkpoint(root, step: int, staging, state: dict[str, Any], parts: Optional[dict] = None,
                      meta: Optional[dict] = None, keep_last: Optional[int] = None) -> Path:
    """Write ``state`` and the manifest (listing ``parts``: name -> entry from write_part) into
    ``staging``, rename it to ``root/step_<step>/`` and point ``latest`` at it. Returns the path."""
    check_step(step)
    root, tmp = Path(root), Path(staging)
    meta = dict(meta or {})
    name = atomic.step_dirname(step)
    files = dict(parts or {})
    files[STATE_FILE] = _write_torch_file(tmp / STATE_FILE, state)
    manifest = {"format_version": atomic.FORMAT_VERSION, "step": step, "files": files,
                "meta": meta, "created_unix": time.time()}
    # The manifest goes last: a directory whose manifest parses had all its files written first.
    atomic.write_text_durably(tmp / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True))
    atomic.fsync_dir(tmp)
    return atomic.publish(root, tmp, name, keep_last)


def load_part(path, filename: str, map_location="cpu"):
    """Load one part of a checkpoint that :func:`load_checkpoint` has validated (safe loader)."""
    return safe_load((Path(path) / filename).read_bytes(), Path(path) / filename, map_location)


def load_checkpoint(path, map_location="cpu") -> tuple[dict, dict]:
    """Validate and load a checkpoint directory; returns ``(state, manifest)``.

    Raises ``CheckpointError`` naming the problem when the checkpoint is incomplete or corrupt.
    ``state.pt`` is read with :func:`safe_load` (tensors, containers and primitives: all that
    ``save_checkpoint`` callers store).
    """
    path = Path(path)
    ok, reason = atomic.validate_checkpoint(path)
    if not ok:
        raise CheckpointError(f"cannot load checkpoint {path}: {reason}")
    manifest = atomic.read_manifest(path)
    state = safe_load((path / STATE_FILE).read_bytes(), path / STATE_FILE, map_location)
    return state, manifest


# ------------------------------------------------------------------- per-rank parts (megak3.part.v2)

PART_FORMAT = "megak3.part.v2"
AXES = ("tp", "ep")

Tag = Optional[Tuple[str, int]]


def make_tags(names: Iterable[str], tp_shard_dim: Dict[str, Optional[int]], tp_size: int,
              ep_shard_dim: Optional[Dict[str, int]] = None, ep_size: int = 1) -> Dict[str, Tag]:
    """Per canonical name: ``("ep", dim)`` if expert-sharded, ``("tp", dim)`` if TP-sharded, else None."""
    ep_shard_dim = ep_shard_dim or {}
    tags: Dict[str, Tag] = {}
    for n in names:
        if ep_size > 1 and n in ep_shard_dim:
            tags[n] = ("ep", int(ep_shard_dim[n]))
        elif tp_size > 1 and tp_shard_dim.get(n) is not None:
            tags[n] = ("tp", int(tp_shard_dim[n]))
        else:
            tags[n] = None
    return tags


def build_part(coords: Dict[str, Tuple[int, int]], tags: Dict[str, Tag], model_state: Dict[str, torch.Tensor],
               optimizer_export: dict) -> dict:
    """One rank's part. ``model_state``: the canonical-named tensors this rank is the saver of."""
    for n in model_state:
        if n not in tags:
            raise ValueError(f"build_part: no shard tag for model tensor {n!r}")
    return {"format": PART_FORMAT, "coords": {k: [int(v[0]), int(v[1])] for k, v in coords.items()},
            "tags": {n: (None if t is None else [t[0], t[1]]) for n, t in tags.items()},
            "model": model_state, "optimizer": optimizer_export}


def _join(name: str, what: str, pieces: Dict[int, torch.Tensor], size: int, dim: int) -> torch.Tensor:
    if sorted(pieces) != list(range(size)):
        raise ValueError(f"checkpoint: {what} {name!r} has shards {sorted(pieces)} of {size}; the "
                         "checkpoint is incomplete (a rank's part is missing)")
    return torch.cat([pieces[r] for r in range(size)], dim=dim)


def _tagged(parts: List[dict], name: str):
    tag = None
    for p in parts:
        if name in p["tags"]:
            tag = p["tags"][name]
            break
    return tag


def merge_parts(parts: List[dict]) -> Tuple[Dict[str, torch.Tensor], dict]:
    """Full model tensors and the full canonical optimizer state from a checkpoint's parts."""
    for p in parts:
        if p.get("format") != PART_FORMAT:
            raise ValueError(f"checkpoint part format {p.get('format')!r} is not {PART_FORMAT!r}; it was "
                             "written by an older megak3")
    # ---- model: name -> axis rank -> tensor
    model_pieces: Dict[str, Dict[int, torch.Tensor]] = {}
    for p in parts:
        for n, t in p["model"].items():
            tag = p["tags"][n]
            r = 0 if tag is None else p["coords"][tag[0]][0]
            model_pieces.setdefault(n, {}).setdefault(r, t)
    full_model: Dict[str, torch.Tensor] = {}
    for n, pieces in model_pieces.items():
        tag = _tagged(parts, n)
        if tag is None:
            full_model[n] = pieces[0]
        else:
            size = next(p["coords"][tag[0]][1] for p in parts if n in p["model"])
            full_model[n] = _join(n, "model tensor", pieces, size, tag[1])
    # ---- optimizer: name -> axis rank -> (state, optimizer kind, hyperparameters)
    opt_pieces: Dict[str, Dict[int, tuple]] = {}
    sizes: Dict[str, int] = {}
    for p in parts:
        exp = p["optimizer"]
        if exp.get("format") != CANONICAL_FORMAT:
            raise ValueError(f"checkpoint optimizer export format {exp.get('format')!r} is not {CANONICAL_FORMAT!r}")
        for n, st in exp["state"].items():
            tag = p["tags"].get(n)
            r = 0 if tag is None else p["coords"][tag[0]][0]
            if tag is not None:
                sizes[n] = p["coords"][tag[0]][1]
            opt_pieces.setdefault(n, {}).setdefault(r, (st, exp["optimizer"][n], exp["hyperparameters"][n]))
    full_optim = {"format": CANONICAL_FORMAT, "state": {}, "optimizer": {}, "hyperparameters": {}}
    for n, pieces in opt_pieces.items():
        tag = _tagged(parts, n)
        first = pieces[min(pieces)]
        if tag is None:
            state = first[0]
        else:
            states = {r: pc[0] for r, pc in pieces.items()}
            keys = {frozenset(s) for s in states.values()}
            if len(keys) > 1:
                raise ValueError(f"checkpoint: the shards of {n!r} hold different optimizer state keys "
                                 f"{[sorted(s) for s in states.values()]}")
            state = {}
            for k, v in first[0].items():
                if torch.is_tensor(v) and v.ndim > 0:
                    state[k] = _join(n, f"optimizer state {k!r} of", {r: s[k] for r, s in states.items()},
                                     sizes[n], tag[1])
                else:
                    state[k] = v
        full_optim["state"][n] = state
        full_optim["optimizer"][n] = first[1]
        full_optim["hyperparameters"][n] = first[2]
    return full_model, full_optim


def _ep_slice(t: torch.Tensor, dim: int, ep_rank: int, ep_size: int) -> torch.Tensor:
    if t.shape[dim] % ep_size:
        raise ValueError(f"checkpoint tensor of shape {tuple(t.shape)} cannot be split {ep_size} ways along "
                         f"dim {dim} (parallel.ep must divide model.moe.num_experts)")
    return t.chunk(ep_size, dim=dim)[ep_rank].contiguous()


def local_model_state(full: Dict[str, torch.Tensor], names: Iterable[str], ep_shard_dim: Dict[str, int],
                      ep_rank: int, ep_size: int) -> Dict[str, torch.Tensor]:
    """The full tensors this rank's model holds (its pipeline stage), expert shards cut for ``ep_rank``."""
    out = {}
    for n in names:
        if n not in full:
            raise ValueError(f"checkpoint lacks model tensor {n!r}; it was saved from a different model config")
        t = full[n]
        if ep_size > 1 and n in ep_shard_dim:
            t = _ep_slice(t, ep_shard_dim[n], ep_rank, ep_size)
        out[n] = t
    return out


def local_optimizer_state(full: dict, names: Iterable[str], ep_shard_dim: Dict[str, int], ep_rank: int,
                          ep_size: int) -> dict:
    """The canonical optimizer state restricted to ``names`` with expert shards cut for ``ep_rank``."""
    out = {"format": CANONICAL_FORMAT, "state": {}, "optimizer": {}, "hyperparameters": {}}
    for n in names:
        if n not in full["state"]:
            raise ValueError(f"checkpoint lacks optimizer state for {n!r}; it was saved from a different model")
        st = full["state"][n]
        if ep_size > 1 and n in ep_shard_dim:
            st = {k: (_ep_slice(v, ep_shard_dim[n], ep_rank, ep_size) if torch.is_tensor(v) and v.ndim > 0 else v)
                  for k, v in st.items()}
        out["state"][n] = st
        out["optimizer"][n] = full["optimizer"][n]
        out["hyperparameters"][n] = full["hyperparameters"][n]
    return out
