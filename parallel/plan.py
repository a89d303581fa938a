"""The parallel plan: everything a consumer of a parallelized model needs, derived once.

:func:`parallel.parallelize.parallelize` builds a :class:`ParallelPlan` while it applies the
transforms (tensor + sequence, expert, pipeline, context) to a model that is usually still on the
meta device; what TP does to each parameter comes from the table in parallel/sharding.py. The
trainer (megak3/train), parallel/materialize.py, the Hugging Face loader (megak3/interop/hf_load.py)
and tools/simulate_scale.py read shard boxes, gradient groups and norm partitions from the plan.
The planner (megak3/launch/planner/) builds no plan: it counts the same shards analytically from
the same sharding table, and tools/simulate_scale.py checks that the two agree.

Per tensor (parameters and persistent buffers, keyed by canonical single-process name) the plan
holds a :class:`Shard`: the global shape, this rank's box ``[offsets, offsets + local_shape)`` and
the axis that split it (``"tp"``, ``"ep"`` or ``None`` for a replica).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from torch import nn

from .state import ParallelState


def canonical_name(name: str) -> str:
    """The single-process name of a parameter of a parallelized model (wrappers add ``.inner.``)."""
    return name.replace(".inner.", ".")


@dataclass(frozen=True)
class Shard:
    """This rank's box of one global tensor."""

    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    axis: Optional[str] = None
    """'tp' or 'ep' (the axis whose ranks hold different boxes), None for a full replica"""
    dim: Optional[int] = None
    """the split dim of ``axis``"""

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


@dataclass
class ParallelPlan:
    """What :func:`parallelize` did to this rank's model, and how its training state is reduced.

    Gradient reduction: expert-sharded parameters reduce over expert-data-parallel ranks
    (``ps.edp_group``, which spans the CP ranks too), everything else over ``ps.dp_cp_group`` (the
    dense replicas: dp x cp; the dp group itself when cp = 1). Replicated parameters listed in
    ``partial_grad`` first sum their gradients over TP. The gradient norm sums squared norms over
    each ``norm_partitions`` group (ranks holding different parameters), in order.
    """

    ps: ParallelState
    sequence_parallel: bool
    tensors: Dict[str, Shard] = field(default_factory=dict)
    """canonical name -> this rank's shard, for every parameter and persistent buffer it holds"""
    buffers: List[str] = field(default_factory=list)
    """canonical names in ``tensors`` that are buffers (not trained, saved with the model)"""
    partial_grad: List[str] = field(default_factory=list)
    """replicated parameters whose gradients are partial sums over the TP group"""
    stage_chunks: List[range] = field(default_factory=list)
    """this pipeline rank's model chunks (layer ranges; one range when vp = 1; all layers when pp = 1)"""
    first_stage: bool = True
    last_stage: bool = True
    ep: object = None
    """the :class:`parallel.expert_parallel.EPPlan` (dispatchers, MoonEP buffer pool)"""
    load_recorder: object = None
    """the expert-load recorder every dispatcher reports to (None without EP)"""
    transforms: List[str] = field(default_factory=list)
    """names of the transforms applied, in order (e.g. ['tp', 'ep', 'pp'])"""

    # ---- derived views -------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.ps.tp_size

    @property
    def tp_rank(self) -> int:
        return self.ps.tp_rank

    @property
    def tp_shard_dim(self) -> Dict[str, Optional[int]]:
        """canonical parameter name -> TP-sharded dim (None = not TP-sharded): the optimizer's view"""
        return {n: (s.dim if s.axis == "tp" else None) for n, s in self.tensors.items() if n not in self.buffers}

    @property
    def ep_shard_dim(self) -> Dict[str, int]:
        return {n: s.dim for n, s in self.tensors.items() if s.axis == "ep"}

    def is_expert(self, name: str) -> bool:
        s = self.tensors.get(canonical_name(name))
        return s is not None and s.axis == "ep"

    def grad_group(self, name: str):
        """The group that reduces (sums) the gradient of ``name`` across data-parallel replicas."""
        return self.ps.edp_group if self.is_expert(name) else self.ps.dp_cp_group

    @property
    def norm_partitions(self) -> List[Tuple[object, bool]]:
        """(group, experts_only): groups whose ranks hold different parameters."""
        out = []
        if self.ps.ep_size > 1:
            out.append((self.ps.ep_group, True))
        if self.ps.pp_size > 1:
            out.append((self.ps.pp_group, False))
        return out

    @property
    def token_groups(self) -> list:
        """Groups whose ranks route different tokens (QB statistics and loads are summed over them):
        TP under SP, and the data- and context-parallel ranks (one dp x cp group)."""
        ps = self.ps
        return [g for g in (ps.tp_group if self.sequence_parallel else None, ps.dp_cp_group) if g is not None]

    def is_saver(self, name: str) -> bool:
        """Whether this rank writes ``name``'s shard to a checkpoint: one rank per distinct box, the
        data(x context)-parallel rank 0 of dense tensors and the expert-data-parallel rank 0 of expert
        shards."""
        return (self.ps.edp_rank if self.is_expert(name) else self.ps.dp_cp_rank) == 0

    def local_bytes(self, model: nn.Module) -> int:
        """Bytes of the tensors this rank's model holds (parameters and buffers)."""
        return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))

    def check_model(self, model: nn.Module) -> None:
        """Assert the model holds exactly the plan's tensors with the plan's local shapes."""
        seen = {}
        for n, t in list(model.named_parameters()) + list(model.named_buffers()):
            seen[canonical_name(n)] = tuple(t.shape)
        want = {n: s.local_shape for n, s in self.tensors.items()}
        if seen != want:
            diff = sorted(set(seen) ^ set(want)) or [n for n in seen if seen[n] != want[n]]
            raise AssertionError(f"model and plan disagree, e.g. {diff[:3]}")

    def make_grad_group_fn(self) -> Callable:
        return lambda name, _param: self.grad_group(name)
