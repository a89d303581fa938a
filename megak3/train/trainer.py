"""The pretraining loop of one rank, each stage a call into the module that owns it:

    data       megak3/data (packed documents, this data-parallel rank's rows)
    model      megak3/train/step.RankStep: built on the meta device, parallel.parallelize ->
               ParallelPlan, parallel.materialize (only this rank's shards), optimizer from the plan
    step       RankStep.accumulate / RankStep.apply (the production step; parity tests run it too)
    metrics    device tensors per step, reduced once per logging window (flush_metrics)
    checkpoint megak3/checkpoint/train_state.TrainCheckpoint: save(step) / load(path) / resume (per-shard,
               any layout reads its own boxes)

One optimizer step = ``global_batch_size / (micro_batch_size x dp)`` micro-batches per rank; the
loss of a step is the token-weighted mean over all of them, so the gradient does not depend on how
the batch is split. Quantile-Balancing biases are updated once per optimizer step.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from parallel.plan import ParallelPlan
from parallel.state import ParallelState

from ..checkpoint.atomic import step_dirname
from ..checkpoint.train_state import TrainCheckpoint
from ..data.config import resolve_dataset
from ..data.indexed import IndexedDataset
from ..data.images import has_images
from ..data.packing import Batcher
from ..data.vision_dataset import open_split
from ..data.tokenizer import load_tokenizer
from ..launch.preemption import Preempted, PreemptionHandler
from ..metrics.logger import TrainLogger
from ..metrics.telemetry import GPUTelemetry, Throughput, peak_memory_mb
from ..model.balancing import max_violation
from ..model.k3 import K3Model
from ..data.sft import is_sft_dataset, open_sft_split
from . import summary
from .step import RankStep, all_reduce_sum
from ..job.config import JobConfig, check_layout


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but CUDA is not available; use train.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class NonFiniteError(ValueError):
    """Training stopped on NaN/inf steps (train.nonfinite / train.max_nonfinite_steps)."""


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
        if ps.etp_size > 1:
            raise ValueError(f"parallel.etp={ps.etp_size}: this build trains tensor, sequence, context, data, "
                             "expert and pipeline parallel layouts; set parallel.etp=1")
        # the job config's layout checks at the degrees this rank runs with (a pstate may be given)
        check_layout(replace(par, tp=ps.tp_size, cp=ps.cp_size, ep=ps.ep_size, pp=ps.pp_size), d.seq_len, job.model)
        rows = t.micro_batch_size * ps.dp_size
        if t.global_batch_size % rows:
            raise ValueError(f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                             f"train.micro_batch_size x dp = {t.micro_batch_size} x {ps.dp_size}")
        self.grad_accum = t.global_batch_size // rows
        self.sequence_parallel = par.sequence_parallel and ps.tp_size > 1
        self.device = pick_device(t.device)
        if t.threads:
            torch.set_num_threads(t.threads)

        # data first: a bad path fails before the model is built
        prefix, tok_path = self._resolve_data()
        self.tokenizer = load_tokenizer(tok_path)
        self.tokenizer_path = tok_path
        if self.tokenizer.vocab_size > job.model.vocab_size:
            raise ValueError(f"tokenizer {tok_path} has {self.tokenizer.vocab_size} tokens but model.vocab_size="
                             f"{job.model.vocab_size}; raise model.vocab_size or use a smaller data.vocab_size")
        dataset = IndexedDataset(prefix)
        # text, or image-text when the dataset has an image store (megak3/data/vision_dataset.py)
        split = lambda name: open_split(prefix, d.seq_len, name, d.valid_fraction, d.seed, self.tokenizer,
                                        job.model)  # noqa: E731
        if is_sft_dataset(prefix):  # chat data with an assistant-only loss mask (megak3/data/sft.py)
            split = lambda name: open_sft_split(prefix, d.seq_len, name, d.valid_fraction, d.seed,  # noqa: E731
                                                self.tokenizer, job.model)
        self.train_data = Batcher(split("train"), t.micro_batch_size, ps.dp_rank, ps.dp_size)
        self._valid_packed = split("valid")
        self.has_images = has_images(prefix)
        self.dataset_prefix = prefix
        self.dataset_tokens = dataset.num_tokens
        self.flops_per_token = summary.train_flops_per_token(job.model, d.seq_len)

        torch.manual_seed(t.seed)
        # the model: built on the meta device, parallelized (one plan), only this rank's shards
        # materialised; optimizer, pipeline engine and QB accumulators wired from the plan
        self.rank_step = RankStep(job, ps, self.device, self.grad_accum)
        rs = self.rank_step
        self.model: K3Model = rs.model
        self.plan: ParallelPlan = rs.plan
        self.engine, self.optimizer, self.balancers = rs.engine, rs.optimizer, rs.balancers
        self.load_recorder = rs.load_recorder
        self.peak = summary.peak_flops_per_rank(self.device, t.precision)
        """(peak FLOP/s of this rank, its source) for MFU, or None"""
        layout = {"tp": ps.tp_size, "cp": ps.cp_size, "dp": ps.dp_size, "ep": ps.ep_size, "pp": ps.pp_size,
                  "vp": job.parallel.vp, "sequence_parallel": self.sequence_parallel}
        self.checkpoint = TrainCheckpoint(self.ckpt_dir, self.model, self.optimizer, self.plan, ps, self.train_data,
                                          self.device, layout, {"dataset": str(prefix), "config": config_dict},
                                          keep_last=t.keep_last, async_save=t.async_save)
        self.step = 0
        self.history: list[dict] = []
        self._pending: list[dict] = []  # per-step device metrics not yet reduced and logged
        self.nonfinite_steps = 0
        """steps skipped so far because their gradient norm was NaN/inf (saved in checkpoints)"""

    def _resolve_data(self):
        # rank 0 builds the demo dataset once; the others wait and then open the cached copy
        if self.ps.world_size > 1 and self.rank != 0:
            dist.barrier()
            return resolve_dataset(self.job.data)
        out = resolve_dataset(self.job.data)
        if self.ps.world_size > 1:
            dist.barrier()
        return out

    # ---- state: megak3/checkpoint/train_state.TrainCheckpoint saves and loads it ----------------
    def _save_and_report(self, logger) -> None:
        """Save (collective), then one line on rank 0: bytes this rank wrote and seconds (async: the snapshot)."""
        t0 = time.perf_counter()
        self.checkpoint.save(self.step, self.nonfinite_steps)
        dt = time.perf_counter() - t0
        name = step_dirname(self.step)
        if self.job.train.async_save:
            logger.write(f"checkpoint {name}: snapshot taken in {dt:.2f} s, writing in the background")
        else:
            st = self.checkpoint.last_save_stats
            logger.write(f"checkpoint {name} saved: {st['bytes'] / 2 ** 20:,.1f} MiB written by rank 0 "
                         f"(of {self.ps.world_size} rank(s)) in {dt:.2f} s")

    def maybe_resume(self) -> Optional[Path]:
        """Load ``train.resume`` (:meth:`TrainCheckpoint.resume`); returns the checkpoint loaded or None."""
        path, common = self.checkpoint.resume(self.job.train.resume)
        if common is not None:
            self.step = int(common["step"])
            self.nonfinite_steps = int(common.get("nonfinite_steps", 0))
        return path

    # ---- one optimizer step (megak3/train/step.py) ----------------------------------------------
    def next_micro_batches(self) -> list:
        return [next(self.train_data) for _ in range(self.grad_accum)]

    def accumulate_gradients(self, micro: list) -> dict:
        """Forward/backward of one step's micro-batches: :meth:`RankStep.accumulate`."""
        return self.rank_step.accumulate(micro)

    def optimizer_step(self) -> dict:
        """ZeRO-1 reduce, clip, Muon/AdamW, QB update: :meth:`RankStep.apply`; advances the step."""
        out = self.rank_step.apply(self.step, self.job.train.max_steps)
        self.step += 1
        return out

    def flush_metrics(self) -> list[dict]:
        """Reduce every pending step's logging scalars together and return one record per step.

        One collective per group, whatever the number of pending steps: loss sums over dp (in the
        same vector as the step token counts), expert loads over the token groups, and under
        pipeline parallelism the per-layer max-violation over the stages."""
        if not self._pending:
            return []
        ps, pend = self.ps, self._pending
        self._pending = []
        n = len(pend)
        vec = torch.stack([torch.stack([p["loss_sum"].reshape(()), p["step_tokens"].reshape(())]) for p in pend])
        if ps.dp_cp_group is not None:  # loss sums of this rank's micro-batches (segments), over dp x cp
            vec[:, 0] = all_reduce_sum(vec[:, 0].contiguous(), [ps.dp_cp_group])
        loads = [p["loads"] for p in pend]
        mv = torch.zeros(n, 2, dtype=torch.float64, device=self.device)
        if loads[0] is not None:
            L = all_reduce_sum(torch.stack(loads), self.plan.token_groups)  # [steps, layers, E]
            per_layer = torch.stack([torch.stack([max_violation(l) for l in step]) for step in L])
            mv[:, 0] = per_layer.double().sum(-1)
            mv[:, 1] = L.shape[1]
        if ps.pp_size > 1:  # every stage reports the mean over the model's MoE layers
            all_reduce_sum(mv, [ps.pp_group])
        gn = torch.stack([torch.as_tensor(p["grad_norm"], dtype=torch.float64, device=self.device).reshape(())
                          for p in pend])
        vis = torch.stack([torch.stack([p["images"].reshape(()), p["vision_tokens"].reshape(())]) for p in pend])
        skipped = torch.stack([torch.as_tensor(p["skipped"], device=self.device).reshape(()) for p in pend])
        host = torch.cat([vec, mv, gn[:, None], vis, skipped[:, None].to(vec.dtype)], dim=1).tolist()
        out = []  # ^ the one host sync of the window
        for p, (loss_sum, tokens, mv_sum, mv_n, g, images, vtok, skip) in zip(pend, host):
            out.append({"step": p["step"], "loss": loss_sum / max(tokens, 1.0), "lr": p["lr"], "grad_norm": g,
                        "expert_load_max_violation": mv_sum / mv_n if mv_n else 0.0,
                        "skipped_nonfinite": int(skip)})
            if self.has_images:
                out[-1].update(images=int(images), vision_tokens=int(vtok))
        return out

    def train_step(self) -> dict:
        """One optimizer step; its metrics stay on the device until :meth:`flush_metrics`.

        A step with a NaN/inf global gradient norm changes nothing (decided on the device, see
        :meth:`RankStep.apply`); such steps are counted when the log window is reduced
        (:meth:`_count_nonfinite`), so the loop never waits on the device between log steps."""
        rec = self.accumulate_gradients(self.next_micro_batches())
        rec.update(self.optimizer_step())
        rec["step"] = self.step
        self._pending.append(rec)
        return rec

    def _count_nonfinite(self, step: int) -> Optional[NonFiniteError]:
        """Count a skipped step (read with the log window's metrics); under ``train.nonfinite=stop``,
        or past ``train.max_nonfinite_steps`` such steps, return the :class:`NonFiniteError` to stop
        with (one line, naming the step), else None. Checked at log steps: the steps run since then
        changed nothing if their norms were non-finite too (each step is skipped on the device on
        its own)."""
        t, o = self.job.train, self.job.optim
        self.nonfinite_steps += 1
        if t.nonfinite == "stop" or self.nonfinite_steps > t.max_nonfinite_steps:
            why = ("train.nonfinite=stop" if t.nonfinite == "stop" else
                   f"more than train.max_nonfinite_steps={t.max_nonfinite_steps} skipped")
            return NonFiniteError(
                f"step {step}: the loss / gradient norm is NaN or inf ({self.nonfinite_steps} such "
                f"step(s), {why}); the run diverged: lower optim.lr={o.lr:g}, raise "
                f"optim.warmup_steps={o.warmup_steps} or set optim.grad_clip (no checkpoint holds "
                "a non-finite value)")
        return None

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

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted validation loss over ``train.eval_batches`` micro-batches per DP rank.

        Every rank runs the same number of batches (the validation stream wraps), so the
        collectives inside the model line up; the sums stay on the device and are reduced once."""
        self.model.eval()
        batches = iter(Batcher(self._valid_packed, self.job.train.micro_batch_size, self.ps.dp_rank,
                               self.ps.dp_size))
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        for _ in range(self.job.train.eval_batches):
            b = self.rank_step.to_device(next(batches))
            with self.rank_step.autocast():
                if self.engine is not None:
                    ls, nt = self.engine.forward_only([b])
                    acc += torch.tensor([ls, nt], dtype=torch.float64, device=self.device)
                    continue
                out = self.model(b["input_ids"], labels=b["labels"], cu_seqlens=b.get("cu_seqlens"),
                                 images=b.get("images"))
            acc[0] += out.loss_sum.detach().double()
            acc[1] += out.num_tokens
        self.model.train()
        total, n = all_reduce_sum(acc, [self.ps.dp_cp_group]).tolist()  # local segments' sums and counts
        return total / max(n, 1.0)

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict:
        job, t = self.job, self.job.train
        resumed = self.maybe_resume()
        logger = TrainLogger(self.run_dir, job.logging, t.max_steps, rank=self.rank,
                             config_dict=self.config_dict, start_step=self.step)
        gpu = GPUTelemetry(verbose=self.rank == 0) if job.logging.nvml and self.device.type == "cuda" else None
        config_path = summary.save_config(self.run_dir, self.config_dict) if self.rank == 0 else None
        if self.rank == 0:
            summary.save_tokenizer(self.run_dir, self.tokenizer_path)
        for line in summary.startup_lines(job, self.ps, self.plan, self.model, self.run_dir, self.dataset_prefix,
                                          self.dataset_tokens, self.grad_accum, self.flops_per_token, self.peak,
                                          config_path):
            logger.write(line)
        if resumed is not None:
            logger.write(f"resumed from {resumed} at step {self.step}")
        self.first_val = self.final_val = None
        if t.eval_batches:
            self.first_val = self.final_val = self.evaluate()
            logger.log_eval(self.step, {"val_loss": self.first_val})
        self.last_metrics = {}
        clock = Throughput()
        # SIGTERM / SIGUSR1 (SLURM preemption, time limit): checkpoint at the next step, exit 75
        # the flag agrees over a host (gloo) group: no device sync at the per-step check
        host = self.ps.host_group
        preempt = PreemptionHandler(group=host, device=torch.device("cpu") if host is not None else self.device).install()
        logger.start_progress()
        try:
            self._loop(logger, gpu, clock, preempt)
        except NonFiniteError:
            logger.close()
            raise
        finally:
            preempt.uninstall()
        logger.close()
        return {"first_val_loss": self.first_val, "final_val_loss": self.final_val, "steps": self.step,
                "last": self.last_metrics, "run_dir": str(self.run_dir)}

    def _log_window(self, logger, gpu, clock, window_tokens: int, window_steps: int) -> None:
        """Reduce the pending steps' metrics (one collective per group) and log each step."""
        records = self.flush_metrics()
        stop = None  # a NonFiniteError, raised once the whole window is logged
        for i, m in enumerate(records):
            step = m.pop("step")
            if m["skipped_nonfinite"]:
                logger.write(f"step {step}: loss {m['loss']:.4g}, grad norm {m['grad_norm']:.4g}: not finite, "
                             f"step skipped ({self.nonfinite_steps + 1} so far)")
                err = self._count_nonfinite(step)   # every skipped step is counted
                stop = stop or err
            self.history.append({"step": step, "loss": m["loss"]})
            if i == len(records) - 1:  # window figures go with the window's last step
                m.update(clock.step(window_tokens, window_steps))
                if self.has_images:  # images/s over the window, from the same clock as tokens/s
                    m["images_per_s"] = m["tokens_per_s"] * sum(r["images"] for r in records) / max(window_tokens, 1)
                m.update(summary.throughput_metrics(m["tokens_per_s"], self.flops_per_token, self.ps.world_size,
                                                    self.peak))
                m["peak_memory_mb"] = peak_memory_mb()
                m.update(self._expert_load_window())
                if gpu is not None:
                    m.update(gpu.sample())
            logger.log(step, m)
            self.last_metrics = m
        if stop is not None:
            raise stop

    def _loop(self, logger, gpu, clock, preempt) -> None:
        job, t = self.job, self.job.train
        window_tokens, window_steps = 0, 0
        while self.step < t.max_steps:
            rec = self.train_step()
            logger.step_done(self.step)
            window_tokens += rec.pop("tokens")
            window_steps += 1
            boundary = self.step == t.max_steps
            eval_now = t.eval_batches > 0 and ((t.eval_interval and self.step % t.eval_interval == 0) or boundary)
            saved = (t.save_interval and self.step % t.save_interval == 0) or boundary
            if self.step % job.logging.log_interval == 0 or eval_now or saved or boundary:
                self._log_window(logger, gpu, clock, window_tokens, window_steps)
                window_tokens, window_steps = 0, 0
            if eval_now:
                self.final_val = self.evaluate()
                logger.log_eval(self.step, {"val_loss": self.final_val})
                clock.reset()
            if saved:
                self._save_and_report(logger)
                clock.reset()
            if preempt.requested():  # collective: every rank asks at every step, all agree
                self._log_window(logger, gpu, clock, window_tokens, window_steps)
                if not saved:
                    self._save_and_report(logger)
                self.checkpoint.wait()
                logger.write(f"preempted by {preempt.signal_name} at step {self.step}: checkpoint saved")
                logger.close()
                raise Preempted(self.step, preempt.signal_name)
        self.checkpoint.wait()
