"""QAT benchmark on k3_tiny (vision off) and the demo corpus: MX errors and the QAT-vs-fp32 loss gap.

    PYTHONPATH=. python tools/bench_qat.py [--steps 30] [--seq-len 128] [--batch 4]

Two training runs in one process, same seed, same batches, same optimizer and schedule (Muon +
AdamW, warmup + cosine, Quantile Balancing, grad clip; every step is the trainer's production step,
megak3.train.step.RankStep.accumulate / apply):
full precision, and quant.qat=mxfp4_experts (MXFP4 expert weights, MXFP8 expert GEMM inputs, OCP
floor scales). Printed:

* ||fq(W) - W|| / ||W|| of the MXFP4 expert weights (floor and rceil), at init and after QAT;
* ||fq(a) - a|| / ||a|| of MXFP8 on the real expert GEMM inputs (z rows, SiTU-GLU hidden) of the
  first training batch;
* per-step losses of both runs, the mean gap over the last steps and the validation losses;
* the QAT / fp32 step-time ratio (fake quantization is pure-torch emulation, not a speedup).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megak3.config import load_model_config  # noqa: E402
from megak3.data.config import DataConfig, resolve_dataset  # noqa: E402
from megak3.data.indexed import IndexedDataset  # noqa: E402
from megak3.data.packing import Batcher, PackedDataset  # noqa: E402
from megak3.data.tokenizer import load_tokenizer  # noqa: E402
from megak3.optim import OptimConfig  # noqa: E402
from megak3.quant import QuantConfig  # noqa: E402
from megak3.quant.mx import fake_quant  # noqa: E402
from megak3.quant.qat import expert_modules  # noqa: E402
from megak3.job.config import JobConfig, TrainConfig  # noqa: E402
from megak3.train.step import build_rank  # noqa: E402


def weight_errors(model, mode: str) -> float:
    """Relative error of MXFP4 over all routed expert weights together (norms summed in quadrature)."""
    num = den = 0.0
    for ex in expert_modules(model):
        for w in (ex.w1, ex.w3, ex.w2):
            w = w.detach()
            num += (fake_quant(w, "fp4_e2m1", 32, mode) - w).float().pow(2).sum().item()
            den += w.float().pow(2).sum().item()
    return (num / den) ** 0.5


class Recorder:
    """Wraps an act_quant hook: accumulates squared error / squared norm of the two GEMM inputs."""

    def __init__(self, inner):
        self.inner, self.calls, self.sq = inner, 0, {"z": [0.0, 0.0], "h": [0.0, 0.0]}

    def __call__(self, a):
        q = self.inner(a)
        slot = self.sq["z" if self.calls % 2 == 0 else "h"]   # forward calls z first, then h
        slot[0] += (q - a).detach().float().pow(2).sum().item()
        slot[1] += a.detach().float().pow(2).sum().item()
        self.calls += 1
        return q


def load_batches(args):
    """The same train / validation micro-batches for both runs (demo corpus, built once and cached)."""
    data = DataConfig(seq_len=args.seq_len)
    prefix, tok = resolve_dataset(data)
    ds, pad = IndexedDataset(prefix), load_tokenizer(tok).pad_id
    train = Batcher(PackedDataset(ds, data.seq_len, "train", data.valid_fraction, data.seed, pad), args.batch)
    valid = Batcher(PackedDataset(ds, data.seq_len, "valid", data.valid_fraction, data.seed, pad), args.batch,
                    loop=False)
    return [next(train) for _ in range(args.steps)], [b for _, b in zip(range(args.eval_batches), valid)]


def job_for(args, qcfg: QuantConfig) -> JobConfig:
    """k3_tiny (vision off), fp32 on the CPU, one micro-batch of ``--batch`` rows a step."""
    return JobConfig(
        model=load_model_config("k3_tiny", **{"vision.enabled": False}),
        data=DataConfig(seq_len=args.seq_len),
        optim=OptimConfig(lr=args.lr, warmup_steps=max(1, args.steps // 10)),
        train=TrainConfig(max_steps=args.steps, global_batch_size=args.batch, micro_batch_size=args.batch,
                          seed=args.seed, device="cpu", precision="fp32"),
        quant=qcfg)


def run(args, qcfg: QuantConfig, label: str, train_batches, valid_batches):
    torch.manual_seed(args.seed)
    rs = build_rank(job_for(args, qcfg))  # one process: the trainer's model, QAT hooks, optimizer, QB
    model = rs.model
    recorders = []
    if qcfg.qat != "none":
        for ex in expert_modules(model):
            ex.act_quant = Recorder(ex.act_quant)
            recorders.append(ex)
    losses, act, t0 = [], None, time.perf_counter()
    for step, b in enumerate(train_batches):
        rec = rs.accumulate([b])
        losses.append(float(rec["loss_sum"]) / float(rec["step_tokens"]))
        if step == 0 and recorders:       # activations of the first real batch, then stop recording
            act = {k: (sum(ex.act_quant.sq[k][0] for ex in recorders)
                       / sum(ex.act_quant.sq[k][1] for ex in recorders)) ** 0.5 for k in ("z", "h")}
            for ex in recorders:
                ex.act_quant = ex.act_quant.inner
        rs.apply(step, args.steps)        # clip, Muon/AdamW at the step's LR, Quantile Balancing
    dt = (time.perf_counter() - t0) / len(train_batches)
    model.eval()
    with torch.no_grad():
        tot = [model(b["input_ids"], labels=b["labels"], cu_seqlens=b["cu_seqlens"]) for b in valid_batches]
    val = sum(o.loss_sum.item() for o in tot) / max(1, sum(o.num_tokens for o in tot))
    print(f"  {label:5s} losses: " + " ".join(f"{x:.3f}" for x in losses))
    return model, losses, val, dt, act


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--last", type=int, default=5, help="steps averaged for the final loss gap")
    args = ap.parse_args(argv)

    print(f"k3_tiny (vision off), demo corpus, {args.steps} steps x {args.batch} x {args.seq_len} tokens, "
          f"seed {args.seed}")
    train_batches, valid_batches = load_batches(args)
    _, fp, fp_val, fp_dt, _ = run(args, QuantConfig(), "fp32", train_batches, valid_batches)
    q_model, q, q_val, q_dt, act = run(args, QuantConfig(qat="mxfp4_experts"), "qat", train_batches, valid_batches)
    torch.manual_seed(args.seed)
    init = build_rank(job_for(args, QuantConfig())).model  # both runs' initial weights
    print("MXFP4 expert weights  ||fq(W)-W||/||W||:")
    for mode in ("floor", "rceil"):
        print(f"  {mode:5s} init {weight_errors(init, mode):.4f}   after QAT {weight_errors(q_model, mode):.4f}")
    print(f"MXFP8 expert GEMM inputs (step-0 batch)  z: {act['z']:.4f}   SiTU-GLU hidden: {act['h']:.4f}")
    n = min(args.last, args.steps)
    a, b = sum(fp[-n:]) / n, sum(q[-n:]) / n
    print(f"train loss (mean of last {n})  fp32 {a:.4f}  qat {b:.4f}  gap {b - a:+.4f} ({(b - a) / a:+.2%})")
    print(f"val loss ({len(valid_batches)} batches)        fp32 {fp_val:.4f}  qat {q_val:.4f}  "
          f"gap {q_val - fp_val:+.4f} ({(q_val - fp_val) / fp_val:+.2%})")
    print(f"step time  qat / fp32 = {q_dt / fp_dt:.2f}  ({q_dt:.2f}s vs {fp_dt:.2f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
