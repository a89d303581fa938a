"""The OLDER per-rank-part checkpoint format (``megak3.part.v2``), kept to read such checkpoints:
``tools/convert_checkpoint.py`` merges them and writes the per-shard format of
:mod:`megak3.train.shard_store`, which the trainer reads and writes now.

Every tensor a rank saves is tagged with its relation to the full single-process tensor of the
same canonical name:

    None           the full tensor (replicated over tensor and expert parallelism)
    ("tp", dim)    chunk ``tp_rank`` of ``tp_size`` along ``dim``  (tensor parallelism)
    ("ep", dim)    chunk ``ep_rank`` of ``ep_size`` along ``dim``  (expert parallelism: routed experts)

Pipeline stages hold disjoint parameter names, so parts are united by name. A part is::

    {"format": PART_FORMAT, "coords": {"tp": [rank, size], "ep": [rank, size], "pp": [rank, size], ...},
     "tags": {name: None | [axis, dim]}, "model": {name: tensor}, "optimizer": ShardedOptimizer.export_state()}

``merge_parts`` rebuilds full tensors (model and optimizer state) from any set of parts that
covers every shard of every name, and ``local_model_state`` / ``local_optimizer_state`` cut the
full state down to what one rank of the *current* layout holds, up to tensor parallelism: the TP
slicing is left to :func:`parallel.parallelize.load_full_state` and
:func:`parallel.data_parallel.load_consolidated_state`, which already do it. Limitation: the
merge materialises full tensors on every loading rank (fine up to k3_mini; at K3 scale a loader
would read only the slices it needs).

Which rank saves a model tensor: one per distinct shard, i.e. the data-parallel rank 0 of the
dense replicas (``dp_rank == 0``) for dense tensors and the expert-data-parallel rank 0
(``edp_rank == 0``) for expert-sharded ones; the optimizer state is saved by its ZeRO-1 owner.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from parallel.data_parallel import CANONICAL_FORMAT

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
