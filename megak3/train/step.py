"""One rank's model and its production optimizer step, without the data pipeline or the loop.

:func:`build_rank` builds the model on the meta device, parallelizes it (one
:class:`parallel.plan.ParallelPlan`), materialises only this rank's shards, and wires the pipeline
engine, QAT hooks, the ZeRO-1 optimizer and the Quantile-Balancing accumulators.
:class:`RankStep` is the step the trainer runs and the layout-parity harness
(:mod:`megak3.train.parity`) runs too:

    accumulate(micro_batches)   forward/backward of the step's micro-batches (or the pipeline
                                schedule), TP partial-gradient sums; device tensors out, no host sync
    apply(step, max_steps)      ZeRO-1 reduce-scatter, global-norm clip, Muon/AdamW, all-gather,
                                then the QB bias update from the step's router statistics; a
                                step whose global gradient norm is NaN/inf changes nothing
                                (``skipped``, decided on the device: no host sync)

Loss contract: each micro-batch backpropagates ``loss_sum / step_tokens`` where step_tokens is the
step's labelled-token count over the data-parallel group, so gradients are sums over
micro-batches and ranks, and the gradient does not depend on how the batch is split. Under context
parallelism every CP rank receives the whole rows (step_tokens counts them), the model cuts its
segment (``K3Model.shard_inputs``), and ``loss_sum`` is the loss of this rank's segment: consumers
sum it over ``ps.dp_cp_group``.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from moonep.stats import LoadRecorder
from parallel.data_parallel import build_sharded_optimizer
from parallel.materialize import materialize
from parallel.moe_stats import reduce_balancer
from parallel.parallelize import parallelize, sync_partial_grads
from parallel.pipeline import PipelineEngine
from parallel.pipeline.schedules import check_schedule
from parallel.state import ParallelState

from ..model.balancing import QBAccumulator, resolve_qb_method
from ..model.k3 import build_model
from ..ops.h2d import host_to_device
from ..optim import lr_at, set_lr
from ..quant import apply_quantization
from ..quant.te import fp8_autocast_context
from ..job.config import JobConfig


def all_reduce_sum(t: torch.Tensor, groups) -> torch.Tensor:
    """Sum the device tensor ``t`` in place over each group (one collective per group; None skipped)."""
    for g in groups:
        if g is not None:
            dist.all_reduce(t, group=g)
    return t


def batches_to_device(batches: List[dict], device, extra: Sequence[torch.Tensor] = ()) -> Tuple[List[dict], list]:
    """(the micro-batches with every tensor, ``images`` lists included, on ``device``; the ``extra``
    host tensors on ``device``) in ONE non-blocking copy (:func:`megak3.ops.h2d.host_to_device`:
    pinned staging on CUDA, the identity on the CPU). ``cu_seqlens`` stays on the host, where
    make_seq_info does its index math (moving it would cost a device-to-host copy back)."""
    trees = [tree_flatten({k: v for k, v in b.items() if k != "cu_seqlens"}) for b in batches]
    host = [x for leaves, _ in trees for x in leaves if torch.is_tensor(x)] + list(extra)
    moved = iter(host_to_device(host, device))
    out = []
    for b, (leaves, spec) in zip(batches, trees):
        m = tree_unflatten([next(moved) if torch.is_tensor(x) else x for x in leaves], spec)
        out.append({k: b[k] if k == "cu_seqlens" else m[k] for k in b})
    return out, list(moved)


class RankStep:
    """This rank's model, plan, optimizer and step (see the module docstring)."""

    def __init__(self, job: JobConfig, ps: ParallelState, device, grad_accum: int):
        t, par, mcfg = job.train, job.parallel, job.model.moe
        self.job, self.ps, self.device = job, ps, torch.device(device)
        self.model = build_model(job.model, device="meta")
        self.plan = parallelize(self.model, ps, par, job.moonep)
        materialize(self.model, self.plan, t.seed, job.model.init_std, self.device)
        self.hf_stats = None
        if t.init_from_hf:  # released / exported HF weights replace the init, each rank its own boxes
            from ..interop.hf_load import load_hf_into

            self.hf_stats = load_hf_into(self.model, self.plan, t.init_from_hf, job.model)
        self.load_recorder = self.plan.load_recorder or LoadRecorder()
        self.engine = None
        if ps.pp_size > 1:
            check_schedule(par.pp_schedule, ps.pp_size, par.vp, grad_accum)
            self.engine = PipelineEngine(self.model, self.plan.stage_chunks, ps.pp_group, par.pp_schedule,
                                         seq_shard=(ps.tp_size if self.plan.sequence_parallel else 1) * ps.cp_size,
                                         timeout_s=par.timeout_s, batch_p2p=par.pp_batch_p2p)
        apply_quantization(self.model, job.quant)  # QAT hooks sit where the expert weights live
        self.model.recompute = t.recompute_mode()
        # gradient reduce-scatter behind the backward: only where nothing touches the grads or the DP
        # group between backward and reduce_gradients (no TP partial sums, pipeline, EP or CP)
        overlap = (par.overlap_grad_reduce and ps.tp_size == 1 and ps.pp_size == 1 and ps.ep_size == 1
                   and ps.cp_size == 1)
        # parameter all-gather behind the next forward: under every layout (its own communicators,
        # all issued before any is waited for; parallel/data_parallel/gather.py)
        self.optimizer = build_sharded_optimizer(self.model, job.optim, self.plan, overlap_grad_reduce=overlap,
                                                 overlap_param_gather=par.overlap_param_gather)
        method = resolve_qb_method(mcfg.qb_method, t.global_batch_size * job.data.seq_len, mcfg.num_experts)
        self.balancers = [QBAccumulator(mcfg.num_experts, mcfg.top_k, method, mcfg.qb_bins, device=self.device)
                          for _ in self.model.moe_layers()] if mcfg.balancing == "quantile" else []

    def autocast(self):
        stack = contextlib.ExitStack()
        if self.job.train.precision == "bf16":
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        stack.enter_context(fp8_autocast_context(self.job.quant))
        return stack

    def to_device(self, batch: dict) -> dict:
        """The micro-batch on this rank's device (one non-blocking copy, :func:`batches_to_device`)."""
        return batches_to_device([batch], self.device)[0][0]

    def accumulate(self, micro: list) -> dict:
        """Forward/backward over one step's micro-batches (host tensors, moved here); feeds the QB
        accumulators. Returns this rank's step record of DEVICE tensors: ``loss_sum`` (its
        micro-batches' labelled-token loss), ``step_tokens`` (labelled tokens over the data-parallel
        group: the one collective here), ``loads`` [MoE layers, E] or None, ``tokens`` (input
        tokens of the step over the data-parallel group, an int), ``images`` / ``vision_tokens``
        (over the data-parallel group, 0 for text). A micro-batch's ``images`` (list of [C, H, W])
        reach the vision tower, which runs where the embedding does (the first pipeline stage)."""
        model, ps = self.model, self.ps
        model.train()
        local_tokens = sum(int((b["labels"] != -100).sum()) for b in micro)  # host batches: no sync
        # images and their LM tokens ride in the same all-reduce (for the log line)
        counts = torch.tensor([float(local_tokens), float(sum(b.get("num_images", 0) for b in micro)),
                               float(sum(b.get("vision_tokens", 0) for b in micro))], dtype=torch.float64, device="cpu")
        micro, (dp_counts,) = batches_to_device(micro, self.device, [counts])  # the step's one H2D copy
        dp_counts = all_reduce_sum(dp_counts, [ps.dp_group])
        step_tokens = dp_counts[:1]
        denom = step_tokens.clamp_min(1.0)
        loads = None
        biases = [m.gate.e_score_correction_bias for m in model.moe_layers()]
        if self.engine is not None:  # the pipeline schedule runs every micro-batch's forward/backward
            with self.autocast():
                loss, stats_per_mb = self.engine.train_step(micro, denom[0])
            loss_sum = torch.as_tensor(loss, dtype=torch.float64, device=self.device)
        else:
            stats_per_mb, loss_sum = [], torch.zeros((), dtype=torch.float64, device=self.device)
            for k, b in enumerate(micro):
                if k == len(micro) - 1:
                    self.optimizer.start_grad_overlap()  # no-op unless parallel.overlap_grad_reduce
                with self.autocast():
                    out = model(b["input_ids"], labels=b["labels"], cu_seqlens=b.get("cu_seqlens"),
                                images=b.get("images"))
                (out.loss_sum / denom[0].to(out.loss_sum.dtype)).backward()
                loss_sum = loss_sum + out.loss_sum.detach().double()
                stats_per_mb.append(out.moe_stats)
        for moe_stats in stats_per_mb:
            if moe_stats:
                counts = torch.stack([st.tokens_per_expert_E.float() for st in moe_stats])
                loads = counts if loads is None else loads + counts
                if ps.ep_size == 1:  # under EP the dispatchers record (with the plan)
                    for i, st in enumerate(moe_stats):
                        self.load_recorder.record(i, st.tokens_per_expert_E.view(1, -1))
            for acc, st, bias in zip(self.balancers, moe_stats, biases):
                acc.add(st.scores_TE, bias)
        sync_partial_grads(model, self.plan, ps.tp_group)
        tokens = sum(b["input_ids"].numel() for b in micro) * ps.dp_size
        return {"loss_sum": loss_sum, "step_tokens": step_tokens, "loads": loads, "tokens": tokens,
                "images": dp_counts[1], "vision_tokens": dp_counts[2]}

    def apply(self, step: int, max_steps: int) -> dict:
        """Reduce over DP, clip by the global norm, Muon/AdamW step at the LR of ``step`` (0-based),
        then the Quantile-Balancing update. Returns ``lr``, ``grad_norm`` (a device tensor) and
        ``skipped``: a 0-dim bool DEVICE tensor, True when the norm is NaN/inf, in which case no
        parameter, optimizer state or bias changes and the step's QB statistics are dropped.

        The skip is decided on the device, without a host sync: the flag goes to every optimizer as
        ``found_inf`` (torch's GradScaler protocol: ``AdamW(fused=True)`` and :class:`~megak3.optim.Muon`
        read it in their kernels), and the new QB bias is selected with ``torch.where``. The same
        collectives run whether or not the step is skipped, so ranks never diverge."""
        job, opt = self.job, self.optimizer
        opt.reduce_gradients()
        clip = job.optim.grad_clip
        gnorm = opt.clip_grad_norm_(clip if clip > 0 else float("inf"))
        lr = lr_at(step, job.optim, max_steps)
        # the global norm is identical on every rank, and a NaN/inf loss makes it NaN/inf
        skipped = ~torch.isfinite(gnorm)
        found_inf = skipped.float()
        for o in opt.optimizers:
            o.found_inf = found_inf
        set_lr(opt, lr)
        opt.step()
        for o in opt.optimizers:
            o.found_inf = None
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # new selection biases for the next step, identical on every rank
            for acc, m in zip(self.balancers, self.model.moe_layers()):
                for g in self.plan.token_groups:
                    reduce_balancer(acc, g)
                bias = m.gate.e_score_correction_bias
                bias.copy_(torch.where(skipped.to(bias.device), bias, acc.solve(bias)))
                acc.reset()
        return {"lr": lr, "grad_norm": gnorm, "skipped": skipped}


def build_rank(job: JobConfig, ps: Optional[ParallelState] = None, device="cpu",
               grad_accum: int = 1) -> RankStep:
    """This rank's :class:`RankStep` for ``job`` under layout ``ps`` (default: one process)."""
    return RankStep(job, ps or ParallelState.single(), device, grad_accum)
