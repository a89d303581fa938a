"""The pretraining loop: packed data -> K3 -> Muon/AdamW, Quantile Balancing, eval, checkpoints.

One optimizer step = ``train.grad_accum`` micro-batches. The loss of a step is the token-weighted
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

from ..data.config import resolve_dataset
from ..data.indexed import IndexedDataset
from ..data.packing import Batcher, PackedDataset
from ..data.tokenizer import load_tokenizer
from ..metrics.logger import TrainLogger
from ..metrics.telemetry import GPUTelemetry, Throughput, peak_memory_mb
from ..model.balancing import QBAccumulator, max_violation
from ..model.k3 import K3Model, build_model
from ..optim import build_optimizer, lr_at, set_lr
from . import checkpoint as ckpt
from .config import JobConfig


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but CUDA is not available; use train.device=cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


class Trainer:
    def __init__(self, job: JobConfig, run_dir, config_dict: Optional[dict] = None, rank: int = 0):
        self.job = job
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.rank = rank
        self.config_dict = config_dict
        t, d = job.train, job.data
        self.device = pick_device(t.device)
        if t.threads:
            torch.set_num_threads(t.threads)

        # data first: a bad path fails before the model is built
        prefix, tok_path = resolve_dataset(d)
        self.tokenizer = load_tokenizer(tok_path)
        if self.tokenizer.vocab_size > job.model.vocab_size:
            raise ValueError(f"tokenizer {tok_path} has {self.tokenizer.vocab_size} tokens but model.vocab_size="
                             f"{job.model.vocab_size}; raise model.vocab_size or use a smaller data.vocab_size")
        dataset = IndexedDataset(prefix)
        pad = self.tokenizer.pad_id
        self.train_data = Batcher(PackedDataset(dataset, d.seq_len, "train", d.valid_fraction, d.seed, pad),
                                  t.micro_batch_size)
        self._valid_packed = PackedDataset(dataset, d.seq_len, "valid", d.valid_fraction, d.seed, pad)
        self.dataset_prefix = prefix

        torch.manual_seed(t.seed)
        self.model: K3Model = build_model(job.model, seed=t.seed).to(self.device)
        self.model.gradient_checkpointing = t.activation_checkpointing
        self.optimizer = build_optimizer(self.model, job.optim)
        mcfg = job.model.moe
        self.balancers = [QBAccumulator(mcfg.num_experts, mcfg.top_k, mcfg.qb_method, mcfg.qb_bins)
                          for _ in self.model.moe_layers()] if mcfg.balancing == "quantile" else []
        self.step = 0
        self.history: list[dict] = []

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "step": self.step, "train_data": self.train_data.state_dict(),
                "rng": ckpt.capture_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.train_data.load_state_dict(state["train_data"])
        ckpt.restore_rng_state(state["rng"])
        self.step = int(state["step"])

    def save(self) -> Path:
        meta = {"step": self.step, "dataset": str(self.dataset_prefix), "config": self.config_dict}
        return ckpt.save_checkpoint(self.ckpt_dir, self.step, self.state_dict(), meta=meta,
                                    keep_last=self.job.train.keep_last)

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
        state, _ = ckpt.load_checkpoint(path, map_location="cpu", weights_only=False)
        self.load_state_dict(state)
        return path

    # ---- one optimizer step ------------------------------------------------------------------
    def _autocast(self):
        if self.job.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, batch: dict) -> dict:
        return {k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}

    def next_micro_batches(self) -> list:
        return [self._to_device(next(self.train_data)) for _ in range(self.job.train.grad_accum)]

    def accumulate_gradients(self, micro: list) -> dict:
        """Forward/backward over one step's micro-batches; feeds the QB accumulators."""
        model = self.model
        model.train()
        step_tokens = sum(int((b["labels"] != -100).sum()) for b in micro)
        loads, loss_sum = None, 0.0
        biases = [m.gate.e_score_correction_bias for m in model.moe_layers()]
        for b in micro:
            with self._autocast():
                out = model(b["input_ids"], labels=b["labels"], cu_seqlens=b.get("cu_seqlens"))
            (out.loss_sum / max(step_tokens, 1)).backward()
            loss_sum += out.loss_sum.item()
            if out.moe_stats:
                counts = torch.stack([s.tokens_per_expert_E.float() for s in out.moe_stats])
                loads = counts if loads is None else loads + counts
            for acc, st, bias in zip(self.balancers, out.moe_stats, biases):
                acc.add(st.scores_TE, bias)
        maxvio = float(sum(max_violation(l) for l in loads) / len(loads)) if loads is not None else 0.0
        return {"loss": loss_sum / max(step_tokens, 1), "expert_load_max_violation": maxvio,
                "tokens": sum(b["input_ids"].numel() for b in micro)}

    def optimizer_step(self) -> dict:
        """Clip, schedule, Muon/AdamW step, then the Quantile-Balancing bias update."""
        job, opt = self.job, self.optimizer
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = job.optim.grad_clip
        gnorm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        lr = lr_at(self.step, job.optim, job.train.max_steps)
        set_lr(opt, lr)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # new selection biases for the next step
            for acc, m in zip(self.balancers, self.model.moe_layers()):
                bias = m.gate.e_score_correction_bias
                bias.copy_(acc.solve(bias))
                acc.reset()
        self.step += 1
        return {"lr": lr, "grad_norm": float(gnorm)}

    def train_step(self) -> dict:
        m = self.accumulate_gradients(self.next_micro_batches())
        m.update(self.optimizer_step())
        return m

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted validation loss over the first ``train.eval_batches`` validation micro-batches."""
        self.model.eval()
        batches = iter(Batcher(self._valid_packed, self.job.train.micro_batch_size, loop=False))
        total, n = 0.0, 0
        for _, b in zip(range(max(1, self.job.train.eval_batches)), batches):
            b = self._to_device(b)
            with self._autocast():
                out = self.model(b["input_ids"], labels=b["labels"], cu_seqlens=b.get("cu_seqlens"))
            total += out.loss_sum.item()
            n += out.num_tokens
        self.model.train()
        return total / max(n, 1)

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self) -> dict:
        job, t = self.job, self.job.train
        resumed = self.maybe_resume()
        logger = TrainLogger(self.run_dir, job.logging, t.max_steps, rank=self.rank,
                             config_dict=self.config_dict, start_step=self.step)
        gpu = GPUTelemetry(verbose=self.rank == 0) if job.logging.nvml and self.device.type == "cuda" else None
        if resumed is not None:
            logger.write(f"resumed from {resumed} at step {self.step}")
        first_val = final_val = self.evaluate()
        logger.log_eval(self.step, {"val_loss": first_val})
        clock = Throughput()
        window_tokens, window_steps = 0, 0
        last = {}
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
                if gpu is not None:
                    m.update(gpu.sample())
                window_tokens, window_steps = 0, 0
            logger.log(self.step, m)
            last = m
            boundary = self.step == t.max_steps
            if (t.eval_interval and self.step % t.eval_interval == 0) or boundary:
                final_val = self.evaluate()
                logger.log_eval(self.step, {"val_loss": final_val})
                clock.reset()
            if (t.save_interval and self.step % t.save_interval == 0) or boundary:
                self.save()
                clock.reset()
        logger.close()
        return {"first_val_loss": first_val, "final_val_loss": final_val, "steps": self.step,
                "last": last, "run_dir": str(self.run_dir)}
