"""Layout parity: run K3 steps under a (tp, sp, dp) layout and return canonical, unsharded results.

The same routine runs in one process (tp = dp = 1: the reference) and on N ranks through
:func:`parallel.testing.run_distributed`; tests compare the two. Gradients are gathered back to
full tensors under their single-process names, so a test can compare every parameter.

Loss contract: the loss of a step is the token mean over the GLOBAL batch, so each data-parallel
rank backpropagates ``loss_sum_local / global_tokens`` and gradients are SUMMED over DP.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megak3.config import load_model_config
from megak3.model.k3 import build_model
from megak3.optim import OptimConfig, build_optimizer, lr_at, set_lr

from .parallelize import TPPlan, canonical_name, parallelize_tp, sync_partial_grads


PARITY_MODEL = {
    # k3_tiny's structure (layer schedule, 3 AttnRes blocks, dense layer 0, MoE + shared experts)
    # at widths where every head count and FFN width divides tp=4; trains in milliseconds a step.
    "hidden_size": 64, "dense_intermediate_size": 128,
    "kda.num_heads": 4, "kda.head_dim": 16, "kda.gate_rank": 8, "kda.chunk_size": 16,
    "mla.num_heads": 4, "mla.q_lora_rank": 32, "mla.kv_lora_rank": 16, "mla.qk_nope_head_dim": 8,
    "mla.qk_rope_head_dim": 8, "mla.v_head_dim": 8,
    "moe.num_experts": 8, "moe.top_k": 2, "moe.expert_intermediate_size": 32, "moe.latent_size": 32,
    "vision.enabled": False, "vocab_size": 512,
}
"""model.* overrides of k3_tiny used by the layout parity tests and benchmarks"""


def make_groups(tp: int, dp: int):
    """(tp_group, dp_group) of this rank for a world of tp*dp ranks, tp fastest-varying."""
    from .grid import Layout

    layout = Layout(world_size=tp * dp, tp=tp, dp=dp)
    rank = dist.get_rank()
    mine = {}
    for axis in ("tp", "dp"):
        for ranks in layout.dense_groups()[axis]:
            g = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                mine[axis] = g
    return mine["tp"], mine["dp"]


def global_batch(step: int, batch: int, seqlen: int, vocab: int, seed: int = 99):
    """Deterministic token batch with packed documents (two per row) for a step."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(4, vocab, (batch, seqlen), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    cut = seqlen // 3
    cu = [0]
    for b in range(batch):
        cu += [b * seqlen + cut, (b + 1) * seqlen]
    return ids, labels, torch.tensor(cu, dtype=torch.int32)


def local_rows(ids, labels, dp_rank: int, dp: int):
    B = ids.shape[0] // dp
    ids, labels = ids[dp_rank * B:(dp_rank + 1) * B], labels[dp_rank * B:(dp_rank + 1) * B]
    T = ids.shape[1]
    cut = T // 3
    cu = [0]
    for b in range(B):
        cu += [b * T + cut, (b + 1) * T]
    return ids, labels, torch.tensor(cu, dtype=torch.int32)


def full_tensor(t: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
    if dim is None or group is None or dist.get_world_size(group) == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def grad_norm(model, plan: TPPlan, tp_group) -> torch.Tensor:
    """Global L2 norm: TP shards summed over the TP group, replicated params counted once."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        sq = p.grad.double().pow(2).sum()
        if plan.shard_dim.get(canonical_name(n)) is None:
            replicated += sq
        else:
            sharded += sq
    if tp_group is not None and plan.tp_size > 1:
        dist.all_reduce(sharded, group=tp_group)
    return (sharded + replicated).sqrt()


def run_steps(rank: int, world: int, tp: int, dp: int, sp: bool, steps: int, overrides: Dict,
              batch: int = 4, seqlen: int = 32, seed: int = 5, lr: float = 1e-3,
              break_collective: bool = False) -> Optional[dict]:
    """Train ``steps`` steps; returns {'losses', 'grads' (step 0, full), 'grad_norms'} on rank 0.

    Why lr = 1e-3: layouts differ from one process by fp32 rounding (~1e-7 relative in the
    gradients). Early AdamW steps are ~lr*sign(g), so that noise grows with lr, and once it moves a
    router score past a top-k tie the routing of one token flips and the loss jumps (observed:
    ~6e-4 by step 5 at lr = 3e-3, ~1.5e-6 at lr = 1e-3). The trajectory test checks the layout,
    not how chaotic top-k routing is."""
    distributed = world > 1
    tp_group = dp_group = None
    if distributed:
        tp_group, dp_group = make_groups(tp, dp)
    cfg = load_model_config("k3_tiny", **overrides)
    model = build_model(cfg, seed=seed)
    plan = parallelize_tp(model, tp_group, sequence_parallel=sp)
    if break_collective:  # used by a test to prove the parity check can fail
        plan.partial_grad = []
    ocfg = OptimConfig(lr=lr, warmup_steps=0, grad_clip=1.0, schedule="constant", ns_dtype="float32")
    opt = build_optimizer(model, ocfg)
    if opt.muon is not None and plan.tp_size > 1:
        heads_of = {id(p): h for g in opt.muon.param_groups for p, h in zip(g["params"], g["heads"])}
        for n, p in model.named_parameters():
            dim = plan.shard_dim.get(canonical_name(n))
            if dim is not None and id(p) in heads_of and heads_of[id(p)] is None:
                opt.muon.set_tp_shard(p, dim, tp_group)
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    losses: List[float] = []
    norms: List[float] = []
    grads0 = None
    for step in range(steps):
        ids, labels, _ = global_batch(step, batch, seqlen, cfg.vocab_size)
        global_tokens = int((labels != -100).sum())
        ids, labels, cu = local_rows(ids, labels, dp_rank, dp)
        out = model(ids, labels=labels, cu_seqlens=cu)
        (out.loss_sum / global_tokens).backward()
        sync_partial_grads(model, plan, tp_group)
        loss_sum = out.loss_sum.detach().clone()
        if dp_group is not None and dp > 1:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
            dist.all_reduce(loss_sum, group=dp_group)
        losses.append(float(loss_sum) / global_tokens)
        if step == 0:
            grads0 = {canonical_name(n): full_tensor(p.grad, plan.shard_dim.get(canonical_name(n)), tp_group)
                      for n, p in model.named_parameters() if p.grad is not None}
        norm = grad_norm(model, plan, tp_group)
        norms.append(float(norm))
        clip = min(1.0, 1.0 / (float(norm) + 1e-6))
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(clip)
        set_lr(opt, lr_at(step, ocfg, steps))
        opt.step()
        opt.zero_grad(set_to_none=True)
    if distributed and dist.get_rank() != 0:
        return None
    return {"losses": losses, "grads": grads0, "grad_norms": norms}
