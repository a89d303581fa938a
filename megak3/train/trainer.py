"""The pretraining loop: packed data -> K3 -> Muon/AdamW, Quantile Balancing, eval, checkpoints.

One optimizer step = ``global_batch_size / (micro_batch_size x dp)`` micro-batches per rank. The loss of a step is the token-weighted
mean over all its micro-batches (each micro-batch backpropagates ``loss_sum / step_tokens``), so
the gradient does not depend on how the batch is split. Quantile-Balancing biases are updated once
per optimizer step from the router scores of every micro-batch of that step.
"""
from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Optional

import torch

import torch.distributed as dist

from moonep.stats import LoadRecorder
from parallel.config import check_expert_tp
from parallel.data_parallel import ShardedOptimizer, load_consolidated_state
from parallel.expert_parallel import parallelize_ep
from parallel.pipeline import PipelineEngine, keep_stage, rank_chunks
from parallel.pipeline.schedules import check_schedule
from parallel.moe_stats import reduce_balancer
from parallel.parallelize import canonical_name, load_full_state, parallelize_tp, sync_partial_grads
from parallel.state import ParallelState

from ..data.config import resolve_dataset
from ..launch.preemption import Preempted, PreemptionHandler
from ..data.indexed import IndexedDataset
from ..data.packing import Batcher, PackedDataset
from ..data.tokenizer import load_tokenizer
from ..metrics.logger import TrainLogger
from ..metrics.telemetry import GPUTelemetry, Throughput, peak_memory_mb
from ..model.balancing import QBAccumulator, max_violation
from ..model.k3 import K3Model, build_model
from ..optim import lr_at, set_lr
from ..quant import apply_quantization
from ..quant.te import fp8_autocast_context
from . import checkpoint as ckpt
from . import sharded_state
from .config import JobConfig


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but CUDA is not available; use train.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class Trainer:
    """One rank of a training run. ``pstate`` gives the layout (tensor, sequence, data and expert
    parallelism); the default is one process."""

    def __init__(self, job: JobConfig, run_dir, config_dict: Optional[dict] = None,
                 pstate: Optional[ParallelState] = None):
        self.job = job
        self.ps = ps = pstate or ParallelState.single()
        self.rank = ps.rank
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.config_dict = config_dict
        t, d, par = job.train, job.data, job.parallel
        for axis in ("cp", "etp"):
            if getattr(ps, f"{axis}_size") > 1:
                raise ValueError(f"parallel.{axis}={getattr(ps, f'{axis}_size')}: this build trains tensor, "
                                 f"sequence, data, expert and pipeline parallel layouts; set parallel.{axis}=1")
        check_expert_tp(ps.ep_size, ps.tp_size, par.sequence_parallel)
        rows = t.micro_batch_size * ps.dp_size
        if t.global_batch_size % rows:
            raise ValueError(f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                             f"train.micro_batch_size x dp = {t.micro_batch_size} x {ps.dp_size}")
        self.grad_accum = t.global_batch_size // rows
        self.sequence_parallel = par.sequence_parallel and ps.tp_size > 1
        if self.sequence_parallel and d.seq_len % ps.tp_size:
            raise ValueError(f"data.seq_len={d.seq_len} must be a multiple of parallel.tp={ps.tp_size} "
                             "with parallel.sequence_parallel=true")
        self.device = pick_device(t.device)
        if t.threads:
            torch.set_num_threads(t.threads)

        # data first: a bad path fails before the model is built
        prefix, tok_path = self._resolve_data()
        self.tokenizer = load_tokenizer(tok_path)
        if self.tokenizer.vocab_size > job.model.vocab_size:
            raise ValueError(f"tokenizer {tok_path} has {self.tokenizer.vocab_size} tokens but model.vocab_size="
                             f"{job.model.vocab_size}; raise model.vocab_size or use a smaller data.vocab_size")
        dataset = IndexedDataset(prefix)
        pad = self.tokenizer.pad_id
        self.train_data = Batcher(PackedDataset(dataset, d.seq_len, "train", d.valid_fraction, d.seed, pad),
                                  t.micro_batch_size, ps.dp_rank, ps.dp_size)
        self._valid_packed = PackedDataset(dataset, d.seq_len, "valid", d.valid_fraction, d.seed, pad)
        self.dataset_prefix = prefix

        torch.manual_seed(t.seed)
        # every rank builds the same full model (init is a function of seed and name), then keeps its shard
        self.model: K3Model = build_model(job.model, seed=t.seed)
        self.plan = parallelize_tp(self.model, ps.tp_group, self.sequence_parallel)
        # routed experts: this EP rank's E/ep home experts, dispatched by MoonEP (or the baseline)
        self.load_recorder = LoadRecorder()
        self.ep_plan = parallelize_ep(self.model, ps.ep_group if ps.ep_size > 1 else None, job.moonep,
                                      recorder=self.load_recorder if ps.ep_size > 1 else None)
        self.ep_shard_dim: dict = dict(self.ep_plan.shard_dim)
        """canonical name -> dim of the expert-parallel shard (routed experts under parallel.ep > 1)"""
        # expert gradients are complete within the EP group (every token of the TP/EP ranks reaches
        # them through the dispatch), so they are reduced over expert-DP, never summed over TP
        self.plan.partial_grad = [n for n in self.plan.partial_grad if n not in self.ep_shard_dim]
        # pipeline: this rank keeps its stage's layers (names unchanged, so checkpoints merge across pp)
        self.engine = None
        if ps.pp_size > 1:
            check_schedule(par.pp_schedule, ps.pp_size, par.vp, self.grad_accum)
            mine = rank_chunks(job.model, ps.pp_size, ps.pp_rank, par.vp, par.pp_layout, par.pp_split_blocks)
            keep_stage(self.model, mine, ps.pp_rank == 0, ps.pp_rank == ps.pp_size - 1)
            self.engine = PipelineEngine(self.model, mine, ps.pp_group, par.pp_schedule,
                                         seq_shard=ps.tp_size if self.sequence_parallel else 1,
                                         timeout_s=par.timeout_s)
            kept = {canonical_name(n) for n, _ in self.model.named_parameters()}
            self.plan.partial_grad = [n for n in self.plan.partial_grad if n in kept]
        self.model.to(self.device)
        apply_quantization(self.model, job.quant)  # QAT hooks sit where the expert weights live
        self.model.gradient_checkpointing = t.activation_checkpointing
        ep = ps.ep_size > 1
        # expert shards are replicated over expert-DP only (None when edp = 1: no reduction at all)
        sharded = self.ep_shard_dim
        self.optimizer = ShardedOptimizer(
            self.model, job.optim, ps.dp_group,
            group_for=lambda name, _p: ps.edp_group if canonical_name(name) in sharded else ps.dp_group)
        if ps.tp_size > 1:
            self.optimizer.set_tensor_parallel(ps.tp_group, self.plan.shard_dim)
        if ep:  # EP ranks hold different experts: the grad norm sums their squares over the EP group
            self.optimizer.add_norm_partition(ps.ep_group, experts_only=True)
        if ps.pp_size > 1:  # stages hold disjoint parameters
            self.optimizer.add_norm_partition(ps.pp_group)
        mcfg = job.model.moe
        self.balancers = [QBAccumulator(mcfg.num_experts, mcfg.top_k, mcfg.qb_method, mcfg.qb_bins)
                          for _ in self.model.moe_layers()] if mcfg.balancing == "quantile" else []
        # groups whose ranks route different tokens: QB statistics and loads are reduced over them
        self.token_groups = [g for g in (ps.tp_group if self.sequence_parallel else None, ps.dp_group)
                             if g is not None]
        self.step = 0
        self.history: list[dict] = []

    def _resolve_data(self):
        # rank 0 builds the demo dataset once; the others wait and then open the cached copy
        if self.ps.world_size > 1 and self.rank != 0:
            dist.barrier()
            return resolve_dataset(self.job.data)
        out = resolve_dataset(self.job.data)
        if self.ps.world_size > 1:
            dist.barrier()
        return out

    def _sum(self, value: float, groups) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64)
        for g in groups:
            dist.all_reduce(t, group=g)
        return float(t)

    # ---- state -------------------------------------------------------------------------------
    # A checkpoint holds one part per rank (``rank_XXXXX.pt``: the rank's TP shard of the weights
    # when it is DP rank 0, and the optimizer state of the parameters it owns under ZeRO-1) plus a
    # common ``state.pt`` (step, data position, RNG, layout). Every part is written by its own
    # rank; rank 0 commits the directory atomically once all parts are on disk. Loading merges the
    # parts into full tensors under single-process names, so any layout (or one process) resumes.
    def _part(self) -> dict:
        ps = self.ps
        state = {canonical_name(k): v for k, v in self.model.state_dict().items()}
        tags = sharded_state.make_tags(state, self.plan.shard_dim, ps.tp_size, self.ep_shard_dim, ps.ep_size)
        # one saver per distinct shard: DP rank 0 for dense tensors, expert-DP rank 0 for expert shards
        model = {n: v.detach().cpu().clone() for n, v in state.items()
                 if (ps.edp_rank if (tags[n] or ("",))[0] == "ep" else ps.dp_rank) == 0}
        optim = self.optimizer.export_state(canonical=True)
        optim["state"] = {n: {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
                          for n, st in optim["state"].items()}
        coords = {"tp": (ps.tp_rank, ps.tp_size), "ep": (ps.ep_rank, ps.ep_size), "pp": (ps.pp_rank, ps.pp_size),
                  "dp": (ps.dp_rank, ps.dp_size), "edp": (ps.edp_rank, ps.edp_size)}
        return sharded_state.build_part(coords, tags, model, optim)

    def save(self) -> Optional[Path]:
        """Collective: every rank writes its part, rank 0 commits. Returns the path on rank 0."""
        multi = self.ps.world_size > 1
        box = [ckpt.prepare_staging(self.ckpt_dir, self.step) if self.rank == 0 else None]
        if multi:
            dist.broadcast_object_list(box, src=0)
        entry = ckpt.write_part(box[0], f"rank_{self.rank:05d}.pt", self._part())
        entries = [None] * self.ps.world_size if self.rank == 0 else None
        if multi:
            dist.gather_object((self.rank, entry), entries, dst=0)
        else:
            entries = [(0, entry)]
        path = None
        if self.rank == 0:
            common = {"step": self.step, "train_data": self.train_data.state_dict(),
                      "rng": ckpt.capture_rng_state(), "world_size": self.ps.world_size,
                      "layout": {"tp": self.ps.tp_size, "dp": self.ps.dp_size, "ep": self.ps.ep_size, "pp": self.ps.pp_size,
                                 "sequence_parallel": self.sequence_parallel}}
            meta = {"step": self.step, "dataset": str(self.dataset_prefix), "config": self.config_dict}
            parts = {f"rank_{r:05d}.pt": e for r, e in entries}
            path = ckpt.commit_checkpoint(self.ckpt_dir, self.step, box[0], common, parts=parts, meta=meta,
                                          keep_last=self.job.train.keep_last)
        if multi:
            dist.barrier()  # nobody reads the checkpoint directory before it is complete
        return path

    def load(self, path: Path) -> None:
        """Merge a checkpoint's per-rank parts into full tensors and load this rank's shard."""
        state, manifest = ckpt.load_checkpoint(path, map_location="cpu", weights_only=False)
        parts = [ckpt.load_part(path, name, weights_only=False)
                 for name in sorted(manifest["files"]) if name.startswith("rank_")]
        full_model, full_optim = sharded_state.merge_parts(parts)
        ps = self.ps
        names = [canonical_name(k) for k in self.model.state_dict()]
        local = sharded_state.local_model_state(full_model, names, self.ep_shard_dim, ps.ep_rank, ps.ep_size)
        load_full_state(self.model, local, self.plan)
        opt_names = [canonical_name(sp.name) for sp in self.optimizer.specs]
        local_opt = sharded_state.local_optimizer_state(full_optim, opt_names, self.ep_shard_dim, ps.ep_rank,
                                                        ps.ep_size)
        load_consolidated_state(self.optimizer, local_opt, self.plan)
        self.train_data.load_state_dict(state["train_data"])
        ckpt.restore_rng_state(state["rng"])
        self.step = int(state["step"])

    def maybe_resume(self) -> Optional[Path]:
        spec = self.job.train.resume
        if spec == "none":
            return None
        if spec == "auto":
            path = ckpt.find_latest(self.ckpt_dir)
            if path is None:
                return None
        else:
            path = Path(spec)
            ok, why = ckpt.validate_checkpoint(path)
            if not ok:
                raise ValueError(f"train.resume={spec}: not a complete checkpoint ({why}); "
                                 "use train.resume=auto to pick the newest complete one")
        self.load(path)
        return path

    # ---- one optimizer step ------------------------------------------------------------------
    def _autocast(self):
        stack = contextlib.ExitStack()
        if self.job.train.precision == "bf16":
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        stack.enter_context(fp8_autocast_context(self.job.quant))
        return stack

    def _to_device(self, batch: dict) -> dict:
        return {k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def next_micro_batches(self) -> list:
        return [self._to_device(next(self.train_data)) for _ in range(self.grad_accum)]

    def accumulate_gradients(self, micro: list) -> dict:
        """Forward/backward over one step's micro-batches; feeds the QB accumulators.

        Each micro-batch backpropagates its share of the GLOBAL token mean (tokens summed over the
        data-parallel group), so gradients are summed, never averaged, across micro-batches and ranks."""
        model, ps = self.model, self.ps
        model.train()
        local_tokens = sum(int((b["labels"] != -100).sum()) for b in micro)
        step_tokens = self._sum(local_tokens, [ps.dp_group] if ps.dp_group is not None else [])
        loads, loss_sum = None, 0.0
        biases = [m.gate.e_score_correction_bias for m in model.moe_layers()]
        if self.engine is not None:  # the pipeline schedule runs every micro-batch's forward/backward
            with self._autocast():
                loss_sum, stats_per_mb = self.engine.train_step(micro, step_tokens)
        else:
            stats_per_mb = []
            for b in micro:
                with self._autocast():
                    out = model(b["input_ids"], labels=b["labels"], cu_seqlens=b.get("cu_seqlens"))
                (out.loss_sum / max(step_tokens, 1)).backward()
                loss_sum += out.loss_sum.item()
                stats_per_mb.append(out.moe_stats)
        for moe_stats in stats_per_mb:
            if moe_stats:
                counts = torch.stack([s.tokens_per_expert_E.float() for s in moe_stats])
                loads = counts if loads is None else loads + counts
                if ps.ep_size == 1:  # under EP the dispatchers record (with the plan)
                    for i, st in enumerate(moe_stats):
                        self.load_recorder.record(i, st.tokens_per_expert_E.view(1, -1))
            for acc, st, bias in zip(self.balancers, moe_stats, biases):
                acc.add(st.scores_TE, bias)
        sync_partial_grads(model, self.plan, ps.tp_group)
        loss_sum = self._sum(loss_sum, [ps.dp_group] if ps.dp_group is not None else [])
        if loads is not None:
            for g in self.token_groups:
                dist.all_reduce(loads, group=g)
        maxvio = float(sum(max_violation(l) for l in loads) / len(loads)) if loads is not None else 0.0
        if ps.pp_size > 1:  # every stage reports the mean over the model's MoE layers
            maxvio = self._sum(maxvio * len(self.balancers), [ps.pp_group]) / max(
                self._sum(len(self.balancers), [ps.pp_group]), 1)
        tokens = sum(b["input_ids"].numel() for b in micro) * ps.dp_size
        return {"loss": loss_sum / max(step_tokens, 1), "expert_load_max_violation": maxvio, "tokens": tokens}

    def optimizer_step(self) -> dict:
        """Reduce over DP, clip by the global norm, Muon/AdamW step, then the Quantile-Balancing update."""
        job, opt = self.job, self.optimizer
        opt.reduce_gradients()
        clip = job.optim.grad_clip
        gnorm = opt.clip_grad_norm_(clip if clip > 0 else float("inf"))
        lr = lr_at(self.step, job.optim, job.train.max_steps)
        set_lr(opt, lr)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # new selection biases for the next step, identical on every rank
            for acc, m in zip(self.balancers, self.model.moe_layers()):
                for g in self.token_groups:
                    reduce_balancer(acc, g)
                bias = m.gate.e_score_correction_bias
                bias.copy_(acc.solve(bias))
                acc.reset()
        self.step += 1
        return {"lr": lr, "grad_norm": float(gnorm)}

    def _expert_load_window(self) -> dict:
        """Expert-load metrics of the logging window (the one host sync of the statistics).

        Rank 0 appends the per-layer arrays to RUN_DIR/expert_load.jsonl (tools/expert_load.py);
        the figures are those of rank 0's EP group (its data-parallel share of the tokens)."""
        rec = self.load_recorder
        if not rec.layers:
            return {}
        out = rec.summary()
        if self.rank == 0:
            rec.write_jsonl(self.run_dir / "expert_load.jsonl", self.step)
        rec.reset()
        return {k: v for k, v in out.items() if not k.startswith("moe/L")}  # per-layer: in the JSONL

    def train_step(self) -> dict:
        m = self.accumulate_gradients(self.next_micro_batches())
        m.update(self.optimizer_step())
        return m

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted validation loss over ``train.eval_batches`` micro-batches per DP rank.

        Every rank runs the same number of batches (the validation stream wraps), so the
        collectives inside the model line up."""
        self.model.eval()
        batches = iter(Batcher(self._valid_packed, self.job.train.micro_batch_size, self.ps.dp_rank,
                               self.ps.dp_size))
        total, n = 0.0, 0
        for _ in range(max(1, self.job.train.eval_batches)):
            b = self._to_device(next(batches))
            with self._autocast():
                if self.engine is not None:
                    ls, nt = self.engine.forward_only([b])
                    total, n = total + ls, n + nt
                    continue
                out = self.model(b["input_ids"], labels=b["labels"], cu_seqlens=b.get("cu_seqlens"))
            total += out.loss_sum.item()
            n += out.num_tokens
        self.model.train()
        groups = [self.ps.dp_group] if self.ps.dp_group is not None else []
        return self._sum(total, groups) / max(self._sum(n, groups), 1)

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict:
        job, t = self.job, self.job.train
        resumed = self.maybe_resume()
        logger = TrainLogger(self.run_dir, job.logging, t.max_steps, rank=self.rank,
                             config_dict=self.config_dict, start_step=self.step)
        gpu = GPUTelemetry(verbose=self.rank == 0) if job.logging.nvml and self.device.type == "cuda" else None
        if resumed is not None:
            logger.write(f"resumed from {resumed} at step {self.step}")
        self.first_val = self.final_val = self.evaluate()
        logger.log_eval(self.step, {"val_loss": self.first_val})
        self.last_metrics = {}
        clock = Throughput()
        # SIGTERM / SIGUSR1 (SLURM preemption, time limit): checkpoint at the next step, exit 75
        preempt = PreemptionHandler(device=self.device).install()
        try:
            self._loop(logger, gpu, clock, preempt)
        finally:
            preempt.uninstall()
        logger.close()
        return {"first_val_loss": self.first_val, "final_val_loss": self.final_val, "steps": self.step,
                "last": self.last_metrics, "run_dir": str(self.run_dir)}

    def _loop(self, logger, gpu, clock, preempt) -> None:
        job, t = self.job, self.job.train
        window_tokens, window_steps = 0, 0
        while self.step < t.max_steps:
            m = self.train_step()
            if not math.isfinite(m["loss"]):
                logger.close()
                raise FloatingPointError(f"loss is {m['loss']} at step {self.step}; lower optim.lr or "
                                         "use train.precision=fp32")
            window_tokens += m.pop("tokens")
            window_steps += 1
            self.history.append({"step": self.step, "loss": m["loss"]})
            if self.step % job.logging.log_interval == 0 or self.step == t.max_steps:
                m.update(clock.step(window_tokens, window_steps))
                m["peak_memory_mb"] = peak_memory_mb()
                m.update(self._expert_load_window())
                if gpu is not None:
                    m.update(gpu.sample())
                window_tokens, window_steps = 0, 0
            logger.log(self.step, m)
            self.last_metrics = m
            boundary = self.step == t.max_steps
            if (t.eval_interval and self.step % t.eval_interval == 0) or boundary:
                self.final_val = self.evaluate()
                logger.log_eval(self.step, {"val_loss": self.final_val})
                clock.reset()
            saved = (t.save_interval and self.step % t.save_interval == 0) or boundary
            if saved:
                self.save()
                clock.reset()
            if preempt.requested():  # collective: every rank asks at every step, all agree
                if not saved:
                    self.save()
                logger.write(f"preempted by {preempt.signal_name} at step {self.step}: checkpoint saved")
                logger.close()
                raise Preempted(self.step, preempt.signal_name)
