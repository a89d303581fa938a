"""Layout parity: run the PRODUCTION step under a layout and return canonical results.

The same routine runs in one process (every axis 1: the reference) and on N ranks through
:func:`parallel.testing.run_distributed`; tests compare the two. Each rank joins the layout's
process groups the way the trainer does (:func:`parallel.state.init_parallel`), builds its model
the way the trainer does (:class:`megak3.train.step.RankStep`: meta device, ``parallelize``,
shard-local ``materialize``, ZeRO-1 optimizer from the plan) and runs ``RankStep.accumulate`` /
``apply`` on the deterministic batches of :func:`parallel.testing.global_batch`; there is no second
training loop here. Gradients are taken after backward (and the TP partial sums), summed over each
parameter's data-parallel group of the plan and gathered over the axis that split it (tp, or ep
for routed experts) back to full tensors under their single-process names, so a test can compare
every parameter.

    job = parity_job(2, 2, True, PARITY_MODEL, 4, 32, 5, 1e-3, steps)   # tp2 x dp2, SP
    rs = RankStep(job, parity_state(job, world), "cpu", grad_accum=1)
    out = parity_step(rs, 0, steps, 4, 32, grads=True)   # {'loss', 'grad_norm', 'grads'}

Loss contract: the loss of a step is the token mean over the GLOBAL batch, so each data-parallel
rank backpropagates ``loss_sum_local / global_tokens`` and gradients are SUMMED over DP.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megak3.config import load_model_config
from megak3.data.config import DataConfig
from megak3.optim import OptimConfig
from parallel.config import ParallelConfig
from parallel.plan import canonical_name
from parallel.state import ParallelState, init_parallel
from parallel.testing import global_batch, local_rows

from megak3.job.config import JobConfig, TrainConfig
from .step import RankStep, all_reduce_sum


def full_tensor(t: torch.Tensor, dim: Optional[int], group) -> torch.Tensor:
    """``t`` all-gathered over ``group`` and concatenated along ``dim`` (a copy of ``t`` when
    ``dim`` or ``group`` is None or the group has one rank)."""
    if dim is None or group is None or dist.get_world_size(group) == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def parity_job(tp: int, dp: int, sp: bool, overrides: Dict, batch: int, seqlen: int, seed: int, lr: float,
               steps: int, cp: int = 1, pp: int = 1, ep: int = 1) -> JobConfig:
    """The JobConfig of a parity run: fp32, constant LR, clip 1.0, fp32 Newton-Schulz."""
    return JobConfig(
        model=load_model_config("k3_tiny", **overrides),
        data=DataConfig(seq_len=seqlen),
        optim=OptimConfig(lr=lr, warmup_steps=0, grad_clip=1.0, schedule="constant", ns_dtype="float32"),
        train=TrainConfig(max_steps=steps, global_batch_size=batch, micro_batch_size=batch // dp, seed=seed,
                          device="cpu", precision="fp32"),
        parallel=ParallelConfig(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, sequence_parallel=sp, backend="gloo"))


def parity_state(job: JobConfig, world: int) -> ParallelState:
    """This rank's process groups for ``job.parallel``: the production ``init_parallel`` on
    ``world`` > 1 ranks (collective: every rank calls it), ``ParallelState.single()`` otherwise."""
    return init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()


def full_grads(rs: RankStep) -> Dict[str, torch.Tensor]:
    """Every parameter's gradient as the single-process tensor, by canonical name: summed over the
    plan's gradient group (dp x cp; edp for routed experts) and gathered over the axis whose ranks
    hold different boxes (tp, or ep). Collective over the world; not under pipeline parallelism
    (stages hold different parameters)."""
    ps, plan, out = rs.ps, rs.plan, {}
    for n, p in rs.model.named_parameters():
        if p.grad is None:
            continue
        c = canonical_name(n)
        shard = plan.tensors[c]
        g = all_reduce_sum(p.grad.detach().clone(), [plan.grad_group(n)])
        out[c] = full_tensor(g, shard.dim, {"tp": ps.tp_group, "ep": ps.ep_group}.get(shard.axis))
    return out


def parity_step(rs: RankStep, step: int, steps: int, batch: int, seqlen: int, grads: bool = False) -> dict:
    """One production step on the parity batch of ``step`` (this rank's data-parallel rows; every
    rank of a context-parallel group receives them whole and the model cuts its segment).
    Returns ``loss`` (token mean over the global batch), ``grad_norm`` (the global norm
    ``apply`` clipped by) and, with ``grads``, :func:`full_grads` after backward (else None)."""
    ps = rs.ps
    ids, labels, _ = global_batch(step, batch, seqlen, rs.job.model.vocab_size)
    ids, labels, cu = local_rows(ids, labels, ps.dp_rank, ps.dp_size)
    rec = rs.accumulate([{"input_ids": ids, "labels": labels, "cu_seqlens": cu}])
    full = full_grads(rs) if grads else None
    out = rs.apply(step, steps)
    loss_sum = all_reduce_sum(rec["loss_sum"].clone(), [ps.dp_cp_group])  # CP ranks: their segments
    return {"loss": float(loss_sum) / float(rec["step_tokens"]), "grad_norm": float(out["grad_norm"]),
            "grads": full}


def run_steps(rank: int, world: int, tp: int, dp: int, sp: bool, steps: int, overrides: Dict,
              batch: int = 4, seqlen: int = 32, seed: int = 5, lr: float = 1e-3,
              break_collective: bool = False, cp: int = 1, pp: int = 1, ep: int = 1) -> Optional[dict]:
    """Train ``steps`` production steps; returns {'losses', 'grads' (step 0, full), 'grad_norms'} on rank 0.

    Every rank of a context-parallel group receives its data-parallel rows whole (the model cuts
    its segment); gradients are summed over dp x cp. Under pp or ep, 'grads' is None and the losses
    and global gradient norms carry the comparison (:func:`full_grads` gathers expert gradients
    for a caller that wants them).

    Why lr = 1e-3: layouts differ from one process by fp32 rounding (~1e-7 relative in the
    gradients). Early AdamW steps are ~lr*sign(g), so that noise grows with lr, and once it moves a
    router score past a top-k tie the routing of one token flips and the loss jumps (observed:
    ~6e-4 by step 5 at lr = 3e-3, ~1.5e-6 at lr = 1e-3). The trajectory test checks the layout,
    not how chaotic top-k routing is."""
    job = parity_job(tp, dp, sp, overrides, batch, seqlen, seed, lr, steps, cp, pp, ep)
    rs = RankStep(job, parity_state(job, world), "cpu", grad_accum=1)
    if break_collective:  # used by a test to prove the parity check can fail
        rs.plan.partial_grad = []
    losses: List[float] = []
    norms: List[float] = []
    grads0 = None
    for step in range(steps):
        out = parity_step(rs, step, steps, batch, seqlen, grads=step == 0 and pp == 1 and ep == 1)
        grads0 = out["grads"] if step == 0 else grads0
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
    if world > 1 and dist.get_rank() != 0:
        return None
    return {"losses": losses, "grads": grads0, "grad_norms": norms}
