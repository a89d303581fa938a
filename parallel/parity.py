"""Layout parity: run the PRODUCTION step under a (tp, sp, dp) layout and return canonical results.

The same routine runs in one process (tp = dp = 1: the reference) and on N ranks through
:func:`parallel.testing.run_distributed`; tests compare the two. Each rank builds its model the way
the trainer does (:class:`megak3.train.step.RankStep`: meta device, ``parallelize``, shard-local
``materialize``, ZeRO-1 optimizer from the plan) and runs ``RankStep.accumulate`` / ``apply`` on
deterministic batches; there is no second training loop here. Step-0 gradients are taken after
backward (and the TP partial sums), summed over DP and gathered over TP back to full tensors under
their single-process names, so a test can compare every parameter.

Loss contract: the loss of a step is the token mean over the GLOBAL batch, so each data-parallel
rank backpropagates ``loss_sum_local / global_tokens`` and gradients are SUMMED over DP.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megak3.config import load_model_config

from .plan import canonical_name


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


def parity_job(tp: int, dp: int, sp: bool, overrides: Dict, batch: int, seqlen: int, seed: int, lr: float,
               steps: int, cp: int = 1, pp: int = 1, ep: int = 1):
    """The JobConfig of a parity run: fp32, constant LR, clip 1.0, fp32 Newton-Schulz."""
    from megak3.data.config import DataConfig
    from megak3.optim import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig

    from .config import ParallelConfig

    return JobConfig(
        model=load_model_config("k3_tiny", **overrides),
        data=DataConfig(seq_len=seqlen),
        optim=OptimConfig(lr=lr, warmup_steps=0, grad_clip=1.0, schedule="constant", ns_dtype="float32"),
        train=TrainConfig(max_steps=steps, global_batch_size=batch, micro_batch_size=batch // dp, seed=seed,
                          device="cpu", precision="fp32"),
        parallel=ParallelConfig(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, sequence_parallel=sp, backend="gloo"))


def run_steps(rank: int, world: int, tp: int, dp: int, sp: bool, steps: int, overrides: Dict,
              batch: int = 4, seqlen: int = 32, seed: int = 5, lr: float = 1e-3,
              break_collective: bool = False, cp: int = 1, pp: int = 1, ep: int = 1) -> Optional[dict]:
    """Train ``steps`` production steps; returns {'losses', 'grads' (step 0, full), 'grad_norms'} on rank 0.

    Every rank of a context-parallel group receives its data-parallel rows whole (the model cuts
    its segment); gradients are summed over dp x cp. Under pp or ep, 'grads' is None (parameters
    live on different ranks) and the losses and global gradient norms carry the comparison.

    Why lr = 1e-3: layouts differ from one process by fp32 rounding (~1e-7 relative in the
    gradients). Early AdamW steps are ~lr*sign(g), so that noise grows with lr, and once it moves a
    router score past a top-k tie the routing of one token flips and the loss jumps (observed:
    ~6e-4 by step 5 at lr = 3e-3, ~1.5e-6 at lr = 1e-3). The trajectory test checks the layout,
    not how chaotic top-k routing is."""
    from megak3.train.step import RankStep, all_reduce_sum

    from .state import ParallelState, init_parallel

    job = parity_job(tp, dp, sp, overrides, batch, seqlen, seed, lr, steps, cp, pp, ep)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rs = RankStep(job, ps, "cpu", grad_accum=1)
    if break_collective:  # used by a test to prove the parity check can fail
        rs.plan.partial_grad = []
    dims = rs.plan.tp_shard_dim
    losses: List[float] = []
    norms: List[float] = []
    grads0 = None
    for step in range(steps):
        ids, labels, _ = global_batch(step, batch, seqlen, job.model.vocab_size)
        ids, labels, cu = local_rows(ids, labels, ps.dp_rank, dp)
        rec = rs.accumulate([{"input_ids": ids, "labels": labels, "cu_seqlens": cu}])
        if step == 0 and pp == 1 and ep == 1:
            grads0 = {}
            for n, p in rs.model.named_parameters():
                if p.grad is None:
                    continue
                g = all_reduce_sum(p.grad.detach().clone(), [ps.dp_cp_group])
                grads0[canonical_name(n)] = full_tensor(g, dims.get(canonical_name(n)), ps.tp_group)
        out = rs.apply(step, steps)
        loss_sum = all_reduce_sum(rec["loss_sum"].clone(), [ps.dp_cp_group])  # CP ranks: their segments
        losses.append(float(loss_sum) / float(rec["step_tokens"]))
        norms.append(float(out["grad_norm"]))
    if world > 1 and dist.get_rank() != 0:
        return None
    return {"losses": losses, "grads": grads0, "grad_norms": norms}
