"""Process groups of a layout: `ParallelState` (immutable) and `init_parallel` / `destroy_parallel`.

The groups are passed explicitly to whoever needs them (no globals). An axis of size 1 has no group
(`None`, size 1, rank 0), so a collective on it is skipped at no cost.

    state = init_parallel(job.parallel)           # under torchrun, or plain python (one process)
    state.tp_group, state.tp_size, state.tp_rank   # e.g. <ProcessGroup>, 4, 1
    destroy_parallel()

Axes (group ranks from parallel/grid.py): dense tp, cp, dp, pp, dp_cp, tp_cp, tp_dp_cp; expert
etp, ep, edp, ep_etp (pp is shared by both grids).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from parallel.config import ParallelConfig
from parallel.grid import Layout

__all__ = ["AXES", "ParallelState", "destroy_parallel", "init_parallel", "local_device_index", "select_cuda_device"]

AXES = ("tp", "cp", "dp", "pp", "dp_cp", "tp_cp", "tp_dp_cp", "etp", "ep", "edp", "ep_etp")
"""attribute prefixes of ParallelState; grid.py spells composites with '-' (dp_cp <-> 'dp-cp')"""


@dataclass(frozen=True)
class ParallelState:
    """Every process group of one rank, with the group's size and this rank's index in it."""

    layout: Layout
    rank: int = 0
    world_size: int = 1
    # dense grid
    tp_group: Optional[ProcessGroup] = None
    tp_size: int = 1
    tp_rank: int = 0
    cp_group: Optional[ProcessGroup] = None
    cp_size: int = 1
    cp_rank: int = 0
    dp_group: Optional[ProcessGroup] = None
    dp_size: int = 1
    dp_rank: int = 0
    pp_group: Optional[ProcessGroup] = None
    pp_size: int = 1
    pp_rank: int = 0
    dp_cp_group: Optional[ProcessGroup] = None
    """data-parallel replicas of the dense weights (gradients reduce over dp and cp together)"""
    dp_cp_size: int = 1
    dp_cp_rank: int = 0
    tp_cp_group: Optional[ProcessGroup] = None
    tp_cp_size: int = 1
    tp_cp_rank: int = 0
    tp_dp_cp_group: Optional[ProcessGroup] = None
    tp_dp_cp_size: int = 1
    tp_dp_cp_rank: int = 0
    # expert grid
    etp_group: Optional[ProcessGroup] = None
    etp_size: int = 1
    etp_rank: int = 0
    ep_group: Optional[ProcessGroup] = None
    ep_size: int = 1
    ep_rank: int = 0
    edp_group: Optional[ProcessGroup] = None
    """data-parallel replicas of the routed-expert weights"""
    edp_size: int = 1
    edp_rank: int = 0
    ep_etp_group: Optional[ProcessGroup] = None
    """ranks that together hold one copy of all routed experts (token dispatch)"""
    ep_etp_size: int = 1
    ep_etp_rank: int = 0

    host_group: Optional[ProcessGroup] = None
    """every rank, on a host (gloo) backend: control flags such as the preemption request agree
    over it without waiting for the device (the world group itself unless the backend is nccl)"""

    @staticmethod
    def single() -> "ParallelState":
        """One process: every group None, every size 1, every rank 0."""
        return ParallelState(layout=Layout(world_size=1))

    def group(self, axis: str) -> Optional[ProcessGroup]:
        """The group of `axis` ('tp', 'dp_cp', 'dp-cp', ...)."""
        return getattr(self, f"{axis.replace('-', '_')}_group")


def _grid_groups(layout: Layout) -> dict:
    """{state axis: rank groups} for every axis, in a fixed order (every rank creates them alike)."""
    dense, expert = layout.dense_groups(), layout.expert_groups()
    out = {a: dense[a.replace("_", "-")] for a in AXES[:7]}
    out.update({a: expert[a.replace("_", "-")] for a in AXES[7:]})
    return out


def local_device_index(env: Mapping[str, str], device_count: int) -> int:
    """The CUDA device index this rank drives: ``LOCAL_RANK`` (torchrun, or the sbatch script's srun
    mode), else ``SLURM_LOCALID`` (a plain ``srun`` task without torchrun), else
    ``RANK % device_count``. With one visible device (a per-task GPU binding such as
    ``CUDA_VISIBLE_DEVICES`` or ``--gpus-per-task=1``) it is 0 whatever the local rank.

    Raises ValueError (naming the variable) when the local rank is not an integer or exceeds the
    visible devices: two ranks on one GPU fail later inside NCCL with a less useful message."""
    if device_count < 1:
        raise ValueError("parallel.backend=nccl but no CUDA device is visible to this process; check "
                         "CUDA_VISIBLE_DEVICES or use parallel.backend=gloo")
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if env.get(name, "").strip() != "":
            try:
                local = int(env[name])
            except ValueError:
                raise ValueError(f"{name}={env[name]!r} must be an integer (the rank's index on its node)") from None
            break
    else:
        return int(env.get("RANK", "0") or 0) % device_count
    if device_count == 1:
        return 0
    if not 0 <= local < device_count:
        raise ValueError(f"{name}={local} but this node has {device_count} visible CUDA devices: start at most "
                         f"{device_count} ranks per node (launcher.gpus_per_node / --nproc-per-node)")
    return local


def select_cuda_device(env: Optional[Mapping[str, str]] = None) -> torch.device:
    """``torch.cuda.set_device`` to :func:`local_device_index` and return that device. Under NCCL
    every rank must do this before its first collective: NCCL communicators, the object
    collectives (``all_gather_object``, ``broadcast_object_list``: they stage on
    ``torch.cuda.current_device()``) and a model placed on ``torch.device("cuda")`` all use the
    current device, which is GPU 0 until it is set."""
    index = local_device_index(os.environ if env is None else env, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def init_parallel(cfg: ParallelConfig, backend: Optional[str] = None,
                  timeout_s: Optional[float] = None, model_cfg=None,
                  init_method: str = "env://", ranks: Optional[int] = None) -> Optional[ParallelState]:
    """Create every process group of `cfg`'s layout; return this rank's ParallelState.

    cfg: the layout (dp=0 derives dp from the world size).
    backend: overrides cfg.backend ('auto': nccl on CUDA, gloo on CPU).
    timeout_s: overrides cfg.timeout_s; bounds the rendezvous and every collective of every group.
    model_cfg: when given, the layout's divisibility against the model is checked first.
    init_method: rendezvous when torch.distributed is not initialised yet; RANK and WORLD_SIZE
        come from the environment (torchrun sets them). Without WORLD_SIZE, or with WORLD_SIZE=1,
        and no initialised process group, this returns a one-process state (every group None,
        as ParallelState.single()) after checking that cfg fits one rank.
    ranks: the layout spans only the world's first `ranks` ranks (default: all of them), e.g. the trainer
        of an RL run whose rollout engines have ranks of their own (megak3/posttrain/placement.py); a rank
        beyond them creates the same groups (new_group is collective over the world) and gets None.
        Its `host_group` is a gloo group of those ranks.

    The layout is validated before any process group exists. Every rank calls dist.new_group for
    every group of every axis, in the same order, including groups it is not in (new_group is
    collective over the world); identical rank lists share one group, size-1 axes get none.
    """
    backend = _resolve_backend(backend or cfg.backend)
    timeout = timedelta(seconds=timeout_s if timeout_s is not None else cfg.timeout_s)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    span = world_size if ranks is None else ranks
    if not 1 <= span <= world_size:
        raise ValueError(f"init_parallel: ranks={ranks} must lie in [1, {world_size}] (the world's size)")
    layout = cfg.validate(span, model_cfg).to_layout(span)
    if world_size == 1 and not dist.is_initialized():
        return ParallelState(layout=layout)
    if not dist.is_initialized():
        if backend == "nccl":  # before the communicators exist (see select_cuda_device)
            select_cuda_device()
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)

    fields: dict = {}
    made: dict = {}  # tuple(ranks) -> group, so identical axes share one communicator
    inside = rank < span
    coords = layout.coords(rank) if inside else {}
    for axis, groups in _grid_groups(layout).items():
        size = len(groups[0])
        if inside:
            fields[f"{axis}_size"] = size
            fields[f"{axis}_rank"] = coords[axis.replace("_", "-")]
        if size == 1:
            continue
        for members in groups:
            key = tuple(members)
            if key not in made:
                made[key] = dist.new_group(list(members), timeout=timeout)
            if rank in members:
                fields[f"{axis}_group"] = made[key]
    if dist.get_backend() == "nccl" or span < world_size:
        host = dist.new_group(list(range(span)), timeout=timeout, backend="gloo")
    else:
        host = dist.group.WORLD
    if not inside:
        return None
    fields["host_group"] = host
    return ParallelState(layout=layout, rank=rank, world_size=span, **fields)


def destroy_parallel() -> None:
    """Destroy every process group (the default one included); a no-op when none exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
