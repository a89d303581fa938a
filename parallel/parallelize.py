"""Apply tensor (+ sequence) parallelism to a built K3Model, from the outside.

Every rank builds the same single-process model (same seed ⇒ same full tensors), then
:func:`parallelize_tp` keeps each rank's shard. Model math is untouched: attention and FFN
modules keep plain ``nn.Linear`` layers that simply hold fewer heads / channels, and each such
module is wrapped in a :class:`TPRegion` that owns the two collectives of the Megatron pattern:

    enter:  copy_to_tp        (fwd identity,  bwd all-reduce)        | SP: gather_from_sp (all-gather tokens)
    inner:  column shards (q/k/v/g/f_b/b, q_b/kv_b/g, gate/up) -> local heads -> row shard (o_proj, down_proj)
    exit:   reduce_from_tp    (fwd all-reduce, bwd identity)         | SP: reduce_scatter_to_sp

Parameters that every TP rank holds whole but that see only part of the work receive *partial*
gradients, summed over the TP group after backward (:func:`sync_partial_grads`):
  - replicated weights inside a region that feed sharded heads (MLA q_a/kv_a and their norms,
    KDA f_a_proj and the per-head o_norm);
  - under SP, every weight applied to sequence-sharded tokens (RMSNorms, AttnRes mixes, router,
    routed experts, latent projections, final norm).
Without SP the latter are computed redundantly on identical full inputs and their gradients are
already complete and identical on every TP rank.

What is sharded (dim of the full tensor, contiguous chunks, rank r holds chunk r):
  KDA: q/k/v/g/f_b_proj rows, b_proj rows, conv channels, A_log, dt_bias (dim 0), o_proj columns;
  MLA: q_b/kv_b/g_proj rows (head-major), o_proj columns; dense FFN + shared experts: gate/up rows,
  down columns; embedding rows (vocab), lm_head rows (vocab) with vocab-parallel cross entropy.
Routed experts and the latent projections stay replicated (etp = 1: with SP each TP rank routes its
own token shard through them, which needs no collective; expert parallelism lives in moonep/).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from megak3.model.ffn import SiTUGLUMLP
from megak3.model.kda import KimiDeltaAttention
from megak3.model.mla import GatedMLA

from .plan import ParallelPlan, Shard, canonical_name
from .tensor_parallel import collectives as C
from .tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


@dataclass
class TPPlan:
    """What parallelize_tp did: per parameter name, the sharded dim (None = replicated)."""

    tp_size: int
    tp_rank: int
    sequence_parallel: bool
    shard_dim: Dict[str, Optional[int]] = field(default_factory=dict)
    partial_grad: List[str] = field(default_factory=list)
    """replicated parameters whose gradients must be summed over the TP group"""


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


def _shard_kda(m: KimiDeltaAttention, rank: int, size: int) -> Dict[str, Optional[int]]:
    if m.num_heads % size:
        raise ValueError(f"parallel.tp={size} does not divide model.kda.num_heads={m.num_heads}")
    for name in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "b_proj"):
        _shard_linear(getattr(m, name), 0, rank, size)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        _shard_param(getattr(m, name), "weight", 0, rank, size)
    _shard_param(m, "A_log", 0, rank, size)
    _shard_param(m, "dt_bias", 0, rank, size)
    _shard_linear(m.o_proj, 1, rank, size)
    m.num_heads //= size
    dims = {f"{n}.weight": 0 for n in ("q_proj", "k_proj", "v_proj", "g_proj", "f_b_proj", "b_proj",
                                        "q_conv1d", "k_conv1d", "v_conv1d")}
    dims.update({"A_log": 0, "dt_bias": 0, "o_proj.weight": 1, "f_a_proj.weight": None, "o_norm.weight": None})
    return dims


def _shard_mla(m: GatedMLA, rank: int, size: int) -> Dict[str, Optional[int]]:
    if m.num_heads % size:
        raise ValueError(f"parallel.tp={size} does not divide model.mla.num_heads={m.num_heads}")
    for name in ("q_b_proj", "kv_b_proj", "g_proj"):
        _shard_linear(getattr(m, name), 0, rank, size)
    _shard_linear(m.o_proj, 1, rank, size)
    m.num_heads //= size
    dims = {"q_b_proj.weight": 0, "kv_b_proj.weight": 0, "g_proj.weight": 0, "o_proj.weight": 1}
    dims.update({n: None for n in ("q_a_proj.weight", "q_a_layernorm.weight", "kv_a_proj_with_mqa.weight",
                                   "kv_a_layernorm.weight")})
    return dims


def _shard_mlp(m: SiTUGLUMLP, rank: int, size: int, what: str) -> Dict[str, Optional[int]]:
    width = m.gate_proj.out_features
    if width % size:
        raise ValueError(f"parallel.tp={size} does not divide the {what} width {width}")
    _shard_linear(m.gate_proj, 0, rank, size)
    _shard_linear(m.up_proj, 0, rank, size)
    _shard_linear(m.down_proj, 1, rank, size)
    return {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}


def parallelize_tp(model: nn.Module, group, sequence_parallel: bool = False) -> TPPlan:
    """Shard ``model`` (a K3Model with full weights) over ``group`` in place; returns the plan."""
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    plan = TPPlan(size, rank, sequence_parallel and size > 1)
    names = {id(p): n for n, p in model.named_parameters()}
    if size == 1:
        plan.shard_dim = {n: None for n in names.values()}
        return plan
    sp = plan.sequence_parallel
    region_dims: Dict[str, Optional[int]] = {}
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        dims = _shard_kda(attn, rank, size) if isinstance(attn, KimiDeltaAttention) else _shard_mla(attn, rank, size)
        region_dims.update({f"layers.{i}.self_attn.{k}": v for k, v in dims.items()})
        layer.self_attn = TPRegion(attn, group, sp, sp_dim=1)
        if isinstance(layer.mlp, SiTUGLUMLP):
            dims = _shard_mlp(layer.mlp, rank, size, "model.dense_intermediate_size")
            region_dims.update({f"layers.{i}.mlp.{k}": v for k, v in dims.items()})
            layer.mlp = TPRegion(layer.mlp, group, sp, sp_dim=1)
        elif getattr(layer.mlp, "shared_experts", None) is not None:
            dims = _shard_mlp(layer.mlp.shared_experts, rank, size, "shared-expert")
            region_dims.update({f"layers.{i}.mlp.shared_experts.{k}": v for k, v in dims.items()})
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
    model.loss_fn = lambda logits, labels: _vocab_parallel_loss(logits, labels, group)
    if sp and not fused_sp:
        model.sequence_shard = lambda x: C.scatter_to_sp(x, group, dim=1)
    if getattr(model, "vision", None) is not None:  # weights replicated, images split over the ranks
        from .tensor_parallel.image_split import ImageSplitTower

        model.vision = ImageSplitTower(model.vision, group)

    # name bookkeeping: strip the ".inner" the wrappers add
    for n, _ in model.named_parameters():
        canon = n.replace(".inner.", ".")
        if canon in region_dims:
            plan.shard_dim[canon] = region_dims[canon]
        elif canon in ("embed_tokens.weight", "lm_head.weight"):
            plan.shard_dim[canon] = 0
        else:
            plan.shard_dim[canon] = None
    for n, dim in plan.shard_dim.items():
        if dim is not None:
            continue
        if n in region_dims:          # replicated inside a region, feeding sharded heads
            plan.partial_grad.append(n)
        elif sp or n.startswith("vision."):  # applied to sequence-sharded tokens / this rank's images
            plan.partial_grad.append(n)
    return plan


def _vocab_parallel_loss(logits_local, labels, group):
    n = (labels != -100).sum()  # a device tensor, as token_loss_sum's (no host read per micro-batch)
    loss = vocab_parallel_cross_entropy(logits_local.reshape(-1, logits_local.shape[-1]).float(),
                                        labels.reshape(-1), group, ignore_index=-100, reduction="sum")
    return loss, n


def sync_partial_grads(model: nn.Module, plan: TPPlan, group) -> None:
    """Sum the partial gradients of replicated parameters over the TP group (one flat all-reduce)."""
    if plan.tp_size == 1 or not plan.partial_grad:
        return
    want = set(plan.partial_grad)
    C.sync_replicated_grads([p for n, p in model.named_parameters() if canonical_name(n) in want], group)


@torch.no_grad()
def load_full_state(model: nn.Module, full: Dict[str, torch.Tensor], plan: TPPlan) -> None:
    """Load a canonical (single-process) model state dict into a TP-sharded model: each rank keeps
    its chunk of every sharded tensor. Works for any tp, including 1 (a plain load)."""
    own = model.state_dict()
    missing = [canonical_name(k) for k in own if canonical_name(k) not in full]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}; "
                         "it was saved from a different model config")
    for key, dst in own.items():
        name = canonical_name(key)
        src = full[name]
        dim = plan.shard_dim.get(name)
        if dim is not None and plan.tp_size > 1:
            src = _chunk(src, dim, plan.tp_rank, plan.tp_size)
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(src.shape)}, this layout needs "
                             f"{tuple(dst.shape)}; it was saved from a different model config")
        dst.copy_(src)


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
    plan.tp = parallelize_tp(model, ps.tp_group, sp)
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
    for n, t in list(model.named_parameters()) + list(model.named_buffers()):
        name = canonical_name(n)
        local, glob = tuple(t.shape), global_shapes[name]
        axis, dim, rank = None, None, 0
        if name in ep_dims and ps.ep_size > 1:
            axis, dim, rank = "ep", ep_dims[name], ps.ep_rank
        elif plan.tp.shard_dim.get(name) is not None and ps.tp_size > 1:
            axis, dim, rank = "tp", plan.tp.shard_dim[name], ps.tp_rank
        offsets = [0] * len(glob)
        if axis is not None:
            offsets[dim] = rank * local[dim]
        plan.tensors[name] = Shard(glob, tuple(offsets), local, axis, dim)
    plan.partial_grad = [n for n in plan.tp.partial_grad if n in plan.tensors and n not in ep_dims]
    plan.buffers = [n for n in buffers if n in plan.tensors]
    return plan
