"""The train-state adapter: one rank's model, ZeRO-1 optimizer and step/data state <-> a per-shard checkpoint.

Saving (:meth:`TrainCheckpoint.save`): every rank writes the boxes it is the saver of
(``plan.is_saver``: one rank per distinct shard) as ``model/NAME`` and the optimizer state of the
parameters it owns under ZeRO-1 as ``optim/NAME/STATE``, each with its global shape and offsets; the
optimizer's scalars and hyperparameters go into the rank's objects as ``optim_meta/NAME``; rank 0 adds
the common state (step, data position, RNG, layout) and commits (:mod:`.writer`).

Loading (:meth:`TrainCheckpoint.load`): for every tensor this rank holds in the CURRENT layout, only the
bytes of its box are read (:mod:`.reader`) straight into the model's tensors and the local optimizer
state of the parameters it owns, so any layout resumes. :meth:`TrainCheckpoint.resume` implements
``train.resume``: an explicit path, or ``auto`` with the ranks' agreed fallback to an older checkpoint.
"""
from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from parallel.plan import canonical_name

from . import atomic
from .atomic import CheckpointError, CheckpointWarning
from .reader import CheckpointReader
from .safe import UnsafeCheckpointError
from .writer import ShardedCheckpointer, ShardEntry


class TrainCheckpoint:
    """Saves and loads one rank's training state under ``root`` (``RUN_DIR/checkpoints``).

    ``model``: this rank's module (its shards of the parallel ``plan``); ``optimizer``: its
    ``ShardedOptimizer``; ``data``: the batcher whose ``state_dict`` is the data position; ``layout``:
    the parallel layout recorded in the common state; ``meta``: the JSON meta of every manifest
    (dataset, config). Construct it on every rank before the ranks' first collective (rank 0 removes
    leftover staging directories)."""

    def __init__(self, root, model, optimizer, plan, pstate, data, device, layout: dict, meta: dict,
                 keep_last: Optional[int] = None, async_save: bool = False):
        self.root = Path(root)
        self.model, self.optimizer, self.plan, self.ps, self.data = model, optimizer, plan, pstate, data
        self.device = device
        self.layout, self.meta = layout, meta
        self.async_save = bool(async_save)
        self.writer = ShardedCheckpointer(self.root, pstate.rank, pstate.world_size, keep_last=keep_last,
                                          async_save=async_save)
        self.load_stats: dict = {}
        """after :meth:`load`: payload and metadata bytes this rank read, and the bytes of its shards"""

    # ------------------------------------------------------------------------------------ save
    def _entries(self) -> tuple[dict, dict]:
        plan, E = self.plan, ShardEntry
        entries = {}
        state = {canonical_name(k): v for k, v in self.model.state_dict().items()}
        for n, v in state.items():
            if plan.is_saver(n):
                sh = plan.tensors[n]
                entries[f"model/{n}"] = E(v.detach(), sh.global_shape, sh.offsets)
        meta = {}
        exp = self.optimizer.export_state(canonical=True)
        for n, st in exp["state"].items():
            sh = plan.tensors[n]
            scalars = {}
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim > 0:
                    entries[f"optim/{n}/{k}"] = E(v, sh.global_shape, sh.offsets)
                else:
                    scalars[k] = v.cpu() if torch.is_tensor(v) else v
            meta[f"optim_meta/{n}"] = {"optimizer": exp["optimizer"][n],
                                       "hyperparameters": exp["hyperparameters"][n], "scalars": scalars}
        return entries, meta  # one object key per parameter: the reader unites the ranks' keys

    def save(self, step: int, nonfinite_steps: int = 0) -> None:
        """Collective: every rank writes its shards of checkpoint ``step``; rank 0 commits (in the
        background with ``async_save``, after a barrier otherwise)."""
        ps = self.ps
        entries, objects = self._entries()
        common = meta = None
        if ps.rank == 0:
            common = {"step": step, "train_data": self.data.state_dict(), "rng": capture_rng_state(),
                      "world_size": ps.world_size, "threads": torch.get_num_threads(),
                      "nonfinite_steps": nonfinite_steps, "layout": self.layout}
            meta = {"step": step, **self.meta}
        self.writer.save(step, entries, objects=objects, common=common, meta=meta)
        if not self.async_save and ps.world_size > 1:
            dist.barrier(group=ps.host_group)  # nobody reads the checkpoint directory before it is complete
            # (host_group: this layout's ranks, e.g. an RL trainer's beside engine ranks of their own)

    def wait(self) -> None:
        """Block until a background save has been written and committed (every rank)."""
        self.writer.wait()
        if self.async_save and self.ps.world_size > 1:
            dist.barrier(group=self.ps.host_group)

    @property
    def last_save_stats(self) -> dict:
        return self.writer.last_save_stats

    # ------------------------------------------------------------------------------------ load
    @torch.no_grad()
    def load(self, path) -> dict:
        """Read this rank's boxes of every tensor it holds (model and owned optimizer state), restore the
        data position and RNG; returns the common state (``step``, ``nonfinite_steps``, ...). A missing,
        corrupt or unsafe file raises CheckpointError (:meth:`resume` decides what follows); a
        checkpoint of another model raises ValueError."""
        path = Path(path)
        reader = CheckpointReader(path)
        plan = self.plan
        keys = set(reader.keys())
        own = {canonical_name(k): v for k, v in self.model.state_dict().items()}
        for n, dst in own.items():
            key = f"model/{n}"
            sh = plan.tensors[n]
            if key not in keys:
                raise ValueError(f"checkpoint {path} lacks model tensor {n!r}; it was saved from a different "
                                 "model config")
            if tuple(reader.global_shape(key)) != sh.global_shape:
                raise ValueError(f"checkpoint tensor {n} has shape {tuple(reader.global_shape(key))}, this model "
                                 f"needs {sh.global_shape}; it was saved from a different model config")
            reader.read(key, sh.offsets, sh.local_shape, out=dst)  # straight into the tensor when it can
        optim_bytes = self._load_optimizer(reader, path, keys)
        common = reader.common
        self.data.load_state_dict(common["train_data"])
        restore_rng_state(common["rng"])
        saved_threads = common.get("threads")
        if saved_threads is not None and saved_threads != torch.get_num_threads() and self.ps.rank == 0:
            print(f"warning: checkpoint was written with {saved_threads} torch threads, resuming with "
                  f"{torch.get_num_threads()}: CPU results are bit-identical only at the same thread count "
                  "(set train.threads)", flush=True)
        self.load_stats = {"bytes_read": reader.bytes_read, "meta_bytes_read": reader.meta_bytes_read,
                           "shard_bytes": sum(t.numel() * t.element_size() for t in own.values()) + optim_bytes}
        return common

    def _load_optimizer(self, reader: CheckpointReader, path: Path, keys: set) -> int:
        """The local Muon/AdamW state of every parameter this rank owns (ZeRO-1), read as its box of the
        saved global state, and the group hyperparameters saved with them; returns the state bytes read.

        Optimizer scalars and hyperparameters are read for the params this rank owns only, from the
        object files that hold them; the others need only exist, which the index's key lists tell (an
        index without them, or a converted one-rank checkpoint: everything is read)."""
        opt, plan = self.optimizer, self.plan
        opt.finish_param_gather()  # a gather landing later would overwrite what is loaded
        names = [canonical_name(sp.name) for sp in opt.specs]
        owned = {names[i] for i in opt.main}
        listed = reader.object_keys()
        wanted = sorted(owned) if listed is not None and "optim_meta" not in listed else names
        objs = reader.objects(["optim_meta"] + [f"optim_meta/{n}" for n in wanted])
        meta = dict(objs.get("optim_meta", {}))  # one-rank checkpoints (tools/convert_checkpoint.py)
        meta.update({k.split("/", 1)[1]: v for k, v in objs.items() if k.startswith("optim_meta/")})
        for n in names:
            if n not in meta and not (n not in owned and listed is not None and f"optim_meta/{n}" in listed):
                raise ValueError(f"checkpoint {path} lacks optimizer state for {n!r}; it was saved from a "
                                 "different model")
        state_keys: dict = {}  # name -> its saved tensor state keys
        for key in sorted(k for k in keys if k.startswith("optim/")):
            state_keys.setdefault(key[len("optim/"):].rsplit("/", 1)[0], []).append(key)
        groups = {id(p): (o, g) for o in opt.optimizers for g in o.param_groups for p in g["params"]}
        new_hyper: dict = {}  # id(param group) -> (first name, saved hyperparameters)
        nbytes = 0
        for i, m in opt.main.items():
            n, spec = names[i], opt.specs[i]
            if meta[n]["optimizer"] != spec.optimizer:
                raise ValueError(f"checkpoint {path}: {n!r} was optimised by {meta[n]['optimizer']}, here by "
                                 f"{spec.optimizer}")
            sh = plan.tensors[n]
            local = {k: v.clone() if torch.is_tensor(v) else v for k, v in meta[n]["scalars"].items()}
            for key in state_keys.get(n, ()):
                if tuple(reader.global_shape(key)) != sh.global_shape:
                    raise ValueError(f"checkpoint {path}: {key!r} has shape {tuple(reader.global_shape(key))}, "
                                     f"this model's {n!r} is {sh.global_shape}; it was saved from another model "
                                     "config (or holds a TP shard as the full tensor)")
                v = reader.read(key, sh.offsets, sh.local_shape)
                nbytes += v.numel() * v.element_size()
                if v.shape != m.shape:
                    raise ValueError(f"checkpoint {path}: {key!r} has shape {tuple(v.shape)} for this rank's "
                                     f"shard, the param is {tuple(m.shape)}; it was saved from another model config")
                local[key.rsplit("/", 1)[1]] = v.to(device=m.device, dtype=m.dtype)
            o, group = groups[id(m)]
            if local:
                o.state[m] = local
            else:
                o.state.pop(m, None)
            hp = meta[n]["hyperparameters"]
            prev = new_hyper.setdefault(id(group), (n, hp))
            if prev[1] != hp:
                raise ValueError(f"checkpoint {path}: {prev[0]!r} and {n!r} share a param group here but were "
                                 f"saved with different hyperparameters ({prev[1]} vs {hp})")
        for o in opt.optimizers:
            for g in o.param_groups:
                if id(g) in new_hyper:
                    g.update(new_hyper[id(g)][1])
        return nbytes

    # ---------------------------------------------------------------------------------- resume
    def resume(self, spec: str):
        """``train.resume``: ``(path, common)`` of the checkpoint loaded, or ``(None, None)``.

        ``"none"``: nothing. A path: that checkpoint, or a one-line ValueError (never substituted).
        ``"auto"``: the newest complete checkpoint under ``root``; when any rank cannot read its own
        shards of it (a file truncated or corrupted after the commit: each rank checks only the files it
        reads, so nothing here is O(world)), the ranks agree on that (one all-reduce per checkpoint tried)
        and fall back to the next older one together, with a CheckpointWarning. A file needing the full
        unpickler is never skipped over: every rank raises a one-line ValueError (the rank that read it
        names the file; the others name that rank), so no rank goes on to wait in a collective."""
        if spec == "none":
            return None, None
        explicit = spec != "auto"
        if explicit:
            path = Path(spec)
            ok, why = atomic.validate_checkpoint(path)
            if not ok:
                raise ValueError(f"train.resume={spec}: not a complete checkpoint ({why}); "
                                 "use train.resume=auto to pick the newest complete one")
        failed: set = set()
        while True:
            if not explicit:
                path = atomic.find_latest(self.root, exclude=failed)
                if path is None:
                    return None, None
            error, common, unsafe = None, None, False
            try:
                common = self.load(path)
            except UnsafeCheckpointError as e:
                error, unsafe = e, True
            except CheckpointError as e:
                error = e
            failed_any, unsafe_rank = self._agree(error is not None, self.ps.rank if unsafe else -1)
            if not failed_any:
                return path, common
            if unsafe_rank >= 0 or explicit:
                if error is not None:
                    raise ValueError(str(error)) from None
                why = (f"rank {unsafe_rank} refused a file of it that only a full unpickler could load (nothing "
                       "in it was run; see that rank's error)" if unsafe_rank >= 0 else
                       "another rank could not read its shards")
                raise ValueError(f"checkpoint {path}: {why}")
            warnings.warn(f"skipping checkpoint {path}: {error or 'another rank could not read its shards'}",
                          CheckpointWarning, stacklevel=2)
            failed.add(path)

    def _agree(self, failed: bool, unsafe_rank: int) -> tuple[bool, int]:
        """``(failed on any rank, the highest rank that met an unsafe file or -1)``: one all-reduce (MAX)
        over the host group, or the default group on this rank's device."""
        if self.ps.world_size == 1:
            return failed, unsafe_rank
        group = self.ps.host_group
        t = torch.tensor([float(failed), float(unsafe_rank)], device="cpu" if group is not None else self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return bool(t[0].item()), int(t[1].item())


# --------------------------------------------------------------------------------------------- RNG

def capture_rng_state() -> dict:
    """Snapshot of Python ``random``, NumPy's global RNG, torch CPU and (if available) all CUDA RNGs.

    Stored as tensors / plain containers only, so it round-trips through ``weights_only`` loading.
    """
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"],
                  "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                  "pos": int(np_state["state"]["pos"]),
                  "has_gauss": int(np_state["has_gauss"]), "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Restore a ``capture_rng_state`` snapshot (CUDA states only for the devices present)."""
    random.setstate(_to_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
                         "has_gauss": int(n["has_gauss"]), "gauss": float(n["gauss"])})
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device=i)


def _to_tuples(x):
    """``random.setstate`` needs tuples; a JSON or other round trip may have turned them into lists."""
    return tuple(_to_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
