"""Apply a parallel layout to a K3Model from the outside: :func:`parallelize` and its TP transform.

The trainer builds the model on the meta device (shapes only, nothing allocated), :func:`parallelize`
cuts it to this rank's part and records every tensor's box in a :class:`parallel.plan.ParallelPlan`,
and :func:`parallel.materialize.materialize` then allocates and initialises only the local shards.
(On a model with real tensors, as some tests build it, the same transforms keep each rank's chunk of
the full tensors.)

What tensor parallelism does with each parameter is the table in parallel/sharding.py (column / row /
vocab splits, replicated, partial gradients); :func:`parallelize_tp` applies it. Model math is
untouched: attention and FFN modules keep plain ``nn.Linear`` layers that simply hold fewer heads /
channels, and each such module is wrapped in a :class:`TPRegion` that owns the two collectives of the
Megatron pattern:

    enter:  copy_to_tp        (fwd identity,  bwd all-reduce)        | SP: gather_from_sp (all-gather tokens)
    inner:  column shards (q/k/v/g/f_b/b, q_b/kv_b/g, gate/up) -> local heads -> row shard (o_proj, down_proj)
    exit:   reduce_from_tp    (fwd all-reduce, bwd identity)         | SP: reduce_scatter_to_sp

The regions: every layer's ``self_attn``, a dense layer's ``mlp`` and a MoE layer's
``mlp.shared_experts``. The embedding and lm_head are vocabulary-parallel (vocab-parallel cross
entropy through the model's :class:`megak3.model.k3.ParallelHooks`). Parameters that every TP rank
holds whole but that see only part of the work receive *partial* gradients, summed over the TP group
after backward (:func:`sync_partial_grads`; the table's ``region``, ``images`` and, under SP,
``replicated`` rules). Routed experts stay whole over TP (etp = 1: with SP each TP rank routes its
own token shard through them, which needs no collective); expert parallelism is
parallel/expert_parallel.py.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from megak3.model.ffn import SiTUGLUMLP
from megak3.model.kda import KimiDeltaAttention

from .plan import ParallelPlan, Shard, canonical_name
from .sharding import REGION, tp_rule
from .tensor_parallel import collectives as C
from .tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"cannot split dim {dim} of size {t.shape[dim]} into {size} tensor-parallel shards")
    return t.chunk(size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)  # own storage only


class TPRegion(nn.Module):
    """Wraps a module whose inputs are replicated (or sequence-sharded) and whose output is partial."""

    def __init__(self, inner: nn.Module, group, sequence_parallel: bool, sp_dim: int):
        super().__init__()
        self.inner = inner
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.sp_dim = sp_dim

    def forward(self, x, *args, **kwargs):
        if self.sequence_parallel:
            x = C.gather_from_sp(x, self.group, dim=self.sp_dim)
        else:
            x = C.copy_to_tp(x, self.group)
        y = self.inner(x, *args, **kwargs)
        if self.sequence_parallel:
            return C.reduce_scatter_to_sp(y, self.group, dim=self.sp_dim)
        return C.reduce_from_tp(y, self.group)


class VocabParallelHead(nn.Module):
    """lm_head with vocabulary rows sharded over TP; returns this rank's logits slice [.., V/tp]."""

    def __init__(self, lm_head: nn.Linear, group, rank: int, size: int, sequence_parallel: bool):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(_chunk(lm_head.weight.data, 0, rank, size))

    def forward(self, h_BTD: torch.Tensor) -> torch.Tensor:
        h = C.gather_from_sp(h_BTD, self.group, dim=1) if self.sequence_parallel else C.copy_to_tp(h_BTD, self.group)
        return torch.nn.functional.linear(h, self.weight)


def _shard_param(module: nn.Module, pname: str, dim: int, rank: int, size: int) -> None:
    p = getattr(module, pname)
    setattr(module, pname, nn.Parameter(_chunk(p.data, dim, rank, size), requires_grad=p.requires_grad))


def _shard_linear(lin: nn.Linear, dim: int, rank: int, size: int) -> None:
    """dim 0: column-parallel (output rows); dim 1: row-parallel (input columns). Bias-free only."""
    if lin.bias is not None:
        raise ValueError("tensor parallelism shards bias-free linears only (every K3 linear is bias-free)")
    _shard_param(lin, "weight", dim, rank, size)
    if dim == 0:
        lin.out_features //= size
    else:
        lin.in_features //= size


def _shard_region(region: nn.Module, prefix: str, rank: int, size: int) -> Dict[str, Optional[int]]:
    """Split every parameter of ``region`` (canonical names ``prefix``.local) as parallel/sharding.py
    says: column / row rules keep chunk ``rank`` of ``size`` along their dim (a linear's in/out
    features follow), ``region`` rules stay whole; anything else inside a TP region is refused.
    Returns {local name: split dim or None}."""
    dims: Dict[str, Optional[int]] = {}
    for local, _ in list(region.named_parameters()):
        name = canonical_name(f"{prefix}.{local}")
        rule = tp_rule(name)
        dims[local] = rule.tp_dim
        if rule.kind == REGION:
            continue
        if rule.tp_dim is None:
            raise ValueError(f"{name} sits inside a tensor-parallel region but its rule in parallel/sharding.py "
                             f"is {rule.kind!r}; give it a column, row or region rule")
        owner_name, _, attr = local.rpartition(".")
        owner = region.get_submodule(owner_name) if owner_name else region
        if isinstance(owner, nn.Linear) and attr == "weight":
            _shard_linear(owner, rule.tp_dim, rank, size)
        else:
            _shard_param(owner, attr, rule.tp_dim, rank, size)
    return dims


def _shard_attention(attn: nn.Module, prefix: str, rank: int, size: int) -> Dict[str, Optional[int]]:
    """A KDA or MLA module's heads split over TP (tp must divide them; checked before anything is
    split): :func:`_shard_region` and the local head count."""
    if attn.num_heads % size:
        kind = "kda" if isinstance(attn, KimiDeltaAttention) else "mla"
        raise ValueError(f"parallel.tp={size} does not divide model.{kind}.num_heads={attn.num_heads}")
    dims = _shard_region(attn, prefix, rank, size)
    attn.num_heads //= size
    return dims


def parallelize_tp(model: nn.Module, group, sequence_parallel: bool = False) -> None:
    """Shard ``model`` (a K3Model) over ``group`` in place: the TP regions, the vocabulary-parallel
    embedding and head, the parallel hooks, the vision tower's image split. What each parameter
    became is :func:`parallel.sharding.tp_rule` of its name (read by :func:`parallelize`)."""
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if size == 1:
        return
    sp = sequence_parallel
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        _shard_attention(attn, f"layers.{i}.self_attn", rank, size)
        layer.self_attn = TPRegion(attn, group, sp, sp_dim=1)
        if isinstance(layer.mlp, SiTUGLUMLP):
            _check_width(layer.mlp, size, "model.dense_intermediate_size")
            _shard_region(layer.mlp, f"layers.{i}.mlp", rank, size)
            layer.mlp = TPRegion(layer.mlp, group, sp, sp_dim=1)
        elif getattr(layer.mlp, "shared_experts", None) is not None:
            _check_width(layer.mlp.shared_experts, size, "shared-expert")
            _shard_region(layer.mlp.shared_experts, f"layers.{i}.mlp.shared_experts", rank, size)
            # the MoE sees flattened tokens [B*T_local, D]: the shared experts' SP axis is dim 0
            layer.mlp.shared_experts = TPRegion(layer.mlp.shared_experts, group, sp, sp_dim=0)
    V = model.embed_tokens.num_embeddings
    if V % size:
        raise ValueError(f"parallel.tp={size} does not divide model.vocab_size={V}")
    # Under SP the embedding's all-reduce becomes a reduce-scatter over tokens, unless images are
    # spliced into the full sequence first (then: all-reduce, splice, keep this rank's chunk).
    fused_sp = sp and getattr(model, "vision", None) is None
    model.embed_tokens = VocabParallelEmbedding.from_embedding(model.embed_tokens, group, sequence_parallel=fused_sp)
    model.lm_head = VocabParallelHead(model.lm_head, group, rank, size, sp)
    model.set_parallel_hooks(replace(
        model.parallel_hooks, loss_fn=lambda logits, labels: _vocab_parallel_loss(logits, labels, group),
        sequence_shard=(lambda x: C.scatter_to_sp(x, group, dim=1)) if sp and not fused_sp else None))
    if getattr(model, "vision", None) is not None:  # weights replicated, images split over the ranks
        from .tensor_parallel.image_split import ImageSplitTower

        model.vision = ImageSplitTower(model.vision, group)


def _check_width(mlp: SiTUGLUMLP, size: int, what: str) -> None:
    width = mlp.gate_proj.out_features
    if width % size:
        raise ValueError(f"parallel.tp={size} does not divide the {what} width {width}")


def _vocab_parallel_loss(logits_local, labels, group):
    n = (labels != -100).sum()  # a device tensor, as token_loss_sum's (no host read per micro-batch)
    loss = vocab_parallel_cross_entropy(logits_local.reshape(-1, logits_local.shape[-1]).float(),
                                        labels.reshape(-1), group, ignore_index=-100, reduction="sum")
    return loss, n


def sync_partial_grads(model: nn.Module, plan: ParallelPlan, group) -> None:
    """Sum the partial gradients of replicated parameters (``plan.partial_grad``) over the TP group
    ``group`` (one flat all-reduce; nothing on a group of one rank)."""
    if group is None or not plan.partial_grad or dist.get_world_size(group) == 1:
        return
    want = set(plan.partial_grad)
    C.sync_replicated_grads([p for n, p in model.named_parameters() if canonical_name(n) in want], group)


# ------------------------------------------------------------------------------ the one entry point
def parallelize(model: nn.Module, ps, parallel_cfg=None, moonep_cfg=None, model_cfg=None) -> ParallelPlan:
    """Apply this rank's layout to ``model`` (a K3Model, normally built on the meta device) in place
    and return the :class:`ParallelPlan` every consumer reads.

    ps: the :class:`parallel.state.ParallelState` (``ParallelState.single()`` for one process).
    parallel_cfg: a :class:`parallel.config.ParallelConfig` (sequence_parallel, pipeline layout,
        vp, split blocks); None = defaults. moonep_cfg: expert dispatch (MoonEP or the baseline).
    model_cfg: the model's :class:`megak3.config.ModelConfig` (default ``model.config``).

    Transforms, in order (each records what it did in the plan): ``tp`` (heads, FFN widths and
    vocabulary sharded, TP regions, under SP the token axis), ``ep`` (E/ep home experts per rank and
    the dispatcher), ``pp`` (this rank's model chunks kept, other layers dropped with their names),
    ``cp`` (the model's ``context_parallel`` hook: each row cut into cp contiguous segments,
    parallel/context_parallel.py; no parameter changes, dense gradients reduce over dp x cp). Global shapes are recorded before the first
    transform, so the plan knows every tensor's box in the single-process tensor. On the meta
    device nothing is allocated; :func:`parallel.materialize.materialize` then creates only the
    local shards.
    """
    from moonep.stats import LoadRecorder

    from .config import ParallelConfig, check_expert_tp
    from .expert_parallel import parallelize_ep
    from .pipeline import keep_stage, rank_chunks

    par = parallel_cfg or ParallelConfig()
    cfg = model_cfg or model.config
    check_expert_tp(ps.ep_size, ps.tp_size, par.sequence_parallel)
    sp = bool(par.sequence_parallel and ps.tp_size > 1)
    global_shapes = {canonical_name(n): tuple(t.shape)
                     for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    buffers = [canonical_name(n) for n, _ in model.named_buffers()]
    plan = ParallelPlan(ps=ps, sequence_parallel=sp, buffers=buffers)

    # tp (+ sp)
    parallelize_tp(model, ps.tp_group, sp)
    plan.transforms.append("tp")
    # ep: expert gradients are complete within the EP group (every token of the TP/EP ranks reaches
    # them through the dispatch), so they are reduced over expert-DP and never summed over TP
    plan.load_recorder = LoadRecorder() if ps.ep_size > 1 else None
    plan.ep = parallelize_ep(model, ps.ep_group if ps.ep_size > 1 else None, moonep_cfg,
                             recorder=plan.load_recorder)
    plan.transforms.append("ep")
    # pp: this rank keeps its stage's chunks (names unchanged)
    if ps.pp_size > 1:
        plan.stage_chunks = rank_chunks(cfg, ps.pp_size, ps.pp_rank, par.vp, par.pp_layout, par.pp_split_blocks)
        plan.first_stage, plan.last_stage = ps.pp_rank == 0, ps.pp_rank == ps.pp_size - 1
        keep_stage(model, plan.stage_chunks, plan.first_stage, plan.last_stage)
        plan.transforms.append("pp")
    else:
        plan.stage_chunks = [range(cfg.num_layers)]
    # cp: the sequence split over the CP ranks (parameters untouched)
    from .context_parallel import parallelize_cp

    if parallelize_cp(model, ps, par) is not None:
        plan.transforms.append("cp")

    ep_dims = plan.ep.shard_dim
    params = [canonical_name(n) for n, _ in model.named_parameters()]
    is_param = set(params)
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        name = canonical_name(n)
        local, glob = tuple(t.shape), global_shapes[name]
        axis, dim, rank = None, None, 0
        tp_dim = tp_rule(name).tp_dim if name in is_param else None
        if name in ep_dims and ps.ep_size > 1:
            axis, dim, rank = "ep", ep_dims[name], ps.ep_rank
        elif tp_dim is not None and ps.tp_size > 1:
            axis, dim, rank = "tp", tp_dim, ps.tp_rank
        offsets = [0] * len(glob)
        if axis is not None:
            offsets[dim] = rank * local[dim]
        plan.tensors[name] = Shard(glob, tuple(offsets), local, axis, dim)
    # replicated parameters whose gradients are partial over TP (parallel/sharding.py); EP-sharded
    # experts are complete within the EP group
    plan.partial_grad = [n for n in params if ps.tp_size > 1 and tp_rule(n).partial_grad(sp) and n not in ep_dims]
    plan.buffers = [n for n in buffers if n in plan.tensors]
    return plan
