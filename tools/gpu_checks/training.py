"""Parts d, e and f of tools/gpu_check.py, training through RankStep: throughput and MFU, host syncs of
one step, Transformer Engine FP8 vs bf16."""
from __future__ import annotations

import gc
import math
import os
import time
import warnings

import torch

from .common import ROOT, TOL_FP8_LOSS, Check, Skip, sync

LOSS_DROP_MIN = 0.03     # throughput: the repeated batch's loss falls by at least 3% (CPU dry pass: ~10%)


def _job(model_name, overrides, seq_len, batch, steps, precision, device, fp8="none"):
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.optim import OptimConfig
    from megak3.quant.config import QuantConfig
    from megak3.job.config import JobConfig, TrainConfig
    from parallel.config import ParallelConfig

    return JobConfig(
        model=load_model_config(model_name, **overrides),
        data=DataConfig(seq_len=seq_len),
        optim=OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant"),
        train=TrainConfig(max_steps=steps, global_batch_size=batch, micro_batch_size=batch, seed=1234,
                          device=device, precision=precision),
        parallel=ParallelConfig(), quant=QuantConfig(fp8=fp8))


def _batch(B, T, vocab, seed):
    """A host micro-batch like the loader's: random tokens, two documents per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, T), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    cu = [0]
    for b in range(B):
        cu += [b * T + T // 3, (b + 1) * T]
    return {"input_ids": ids, "labels": labels, "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


def _training_shape(dev, quick):
    """(model, overrides, seq_len, micro-batch, precision): k3_mini on CUDA, the parity model on CPU."""
    if dev.type == "cuda":
        return "k3_mini", {}, (2048 if quick else 4096), (1 if quick else 2), "bf16"
    from parallel.testing import PARITY_MODEL

    return "k3_tiny", dict(PARITY_MODEL), 32, 2, "fp32"


def _rank_step(job, dev):
    from megak3.train.step import RankStep
    from parallel.state import ParallelState

    return RankStep(job, ParallelState.single(), dev, grad_accum=1)


def _train_step(rs, batch, i, steps) -> dict:
    acc = rs.accumulate([batch])
    out = rs.apply(i, steps)
    return {"loss": acc["loss_sum"] / acc["step_tokens"][0].clamp_min(1), "skipped": out["skipped"]}


def part_throughput(dev, quick, ctx):
    from megak3.launch.planner import flops_per_token
    from megak3.train.summary import peak_flops_per_rank

    name, ov, T, B, prec = _training_shape(dev, quick)
    warm, n = (2, 3) if quick or dev.type == "cpu" else (2, 5)
    steps = warm + n + 2
    job = _job(name, ov, T, B, steps, prec, dev.type)
    t0 = time.perf_counter()
    rs = _rank_step(job, dev)
    sync(dev)
    build_s = time.perf_counter() - t0
    batch = _batch(B, T, job.model.vocab_size, 0)   # one batch, repeated: its loss must fall
    losses = []
    for i in range(warm):
        losses.append(_train_step(rs, batch, i, steps)["loss"])
    sync(dev)
    t0 = time.perf_counter()
    for i in range(warm, warm + n):
        losses.append(_train_step(rs, batch, i, steps)["loss"])
    sync(dev)
    dt = time.perf_counter() - t0
    losses = [float(x) for x in losses]
    tok_s = n * B * T / dt
    fl = float(flops_per_token(job.model, T)["train"])
    peak = peak_flops_per_rank(dev, prec)
    out = {"model": name, "seq_len": T, "micro_batch": B, "precision": prec, "build_s": build_s,
           "steps_timed": n, "step_s": dt / n, "tokens_per_s": tok_s, "train_flops_per_token": fl,
           "achieved_tflops": tok_s * fl / 1e12, "peak": None if peak is None else list(peak),
           "mfu": None if peak is None else tok_s * fl / peak[0], "losses": losses}
    if dev.type == "cuda":
        out["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
    chk = Check()
    chk.require("losses_finite", all(math.isfinite(x) for x in losses), f"losses {losses}")
    chk.require("loss_falls_on_repeated_batch", losses[-1] < (1 - LOSS_DROP_MIN) * losses[0],
                f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps on one batch "
                f"(at least {LOSS_DROP_MIN:.0%} lower expected)")
    ctx["train"] = (rs, batch, warm + n, steps)
    return out, chk


def part_host_syncs(dev, quick, ctx):
    if dev.type != "cuda":
        raise Skip("torch.cuda.set_sync_debug_mode is CUDA-only (tests/test_host_syncs.py counts them on CPU)")
    if "train" not in ctx:
        part_throughput(dev, True, ctx)
    rs, batch, i, steps = ctx["train"]
    sync(dev)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            acc = rs.accumulate([batch])
            n_acc = len(rec)
            rs.apply(i, steps)
            n_step = len(rec)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    is_sync = [("synchroniz" in str(w.message).lower()) for w in rec[:n_step]]
    counts = {"accumulate": sum(is_sync[:n_acc]), "apply": sum(is_sync[n_acc:])}
    sites: dict = {}
    for w, s in zip(rec, is_sync):
        if s:
            where = f"{os.path.relpath(w.filename, ROOT)}:{w.lineno}"
            sites[where] = sites.get(where, 0) + 1
    syncs = sum(is_sync)
    del acc
    out = {"syncs_per_step": syncs, "accumulate": counts["accumulate"], "apply": counts["apply"],
           "sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])),
           "expected": "1 with fla installed: RankStep.apply's NaN-skip flag (bool(isfinite(grad_norm))); "
                       "the torch KDA twin adds its own when fla is missing"}
    return out, Check()


def part_te_fp8(dev, quick, ctx):
    if dev.type != "cuda":
        raise Skip("Transformer Engine FP8 needs a CUDA GPU")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        raise Skip(f"transformer_engine not importable ({type(e).__name__}: {str(e)[:120]})")
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        raise Skip(f"FP8 needs sm89+, this GPU is sm{major}{minor}")
    from megak3.quant.te import _te_recipe, _te_version

    chk = Check()
    recipe = _te_recipe()
    chosen = {"recipe": type(recipe).__name__, "capability": [major, minor], "cuda": torch.version.cuda,
              "te_version": _te_version()}
    support = None
    for mod in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            support = getattr(__import__(mod, fromlist=["check_recipe_support"]), "check_recipe_support")
            break
        except (ImportError, AttributeError):
            continue
    if support is not None:   # TE's own verdict on the recipe megak3 chose for this GPU
        try:
            support(recipe)
            chosen["te_accepts"] = True
        except Exception as e:  # noqa: BLE001
            chosen["te_accepts"] = f"{type(e).__name__}: {e}"[:300]
        chk.require("te_recipe_supported", chosen["te_accepts"] is True,
                    f"TE refuses {chosen['recipe']}: {chosen['te_accepts']}")
    ctx.pop("train", None)   # free the throughput model first
    gc.collect()
    torch.cuda.empty_cache()
    n = 6 if quick else 20
    T, B = 2048, 2
    curves = {}
    for fp8 in ("none", "te"):
        job = _job("k3_mini", {}, T, B, n, "bf16", "cuda", fp8=fp8)
        rs = _rank_step(job, dev)
        losses = []
        t0 = time.perf_counter()
        for i in range(n):
            losses.append(_train_step(rs, _batch(B, T, job.model.vocab_size, 100 + i), i, n)["loss"])
        sync(dev)
        curves[fp8] = {"losses": [float(x) for x in losses], "s": time.perf_counter() - t0}
        del rs
        gc.collect()
        torch.cuda.empty_cache()
    a, b = curves["te"]["losses"], curves["none"]["losses"]
    gaps = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    chk.require("losses_finite", all(math.isfinite(x) for x in a + b), f"fp8 {a}, bf16 {b}")
    chk.require("loss_gap", max(gaps) <= TOL_FP8_LOSS,
                f"max relative loss gap FP8 vs bf16 {max(gaps):.4f} > {TOL_FP8_LOSS} over {n} steps")
    import transformer_engine as te

    return {"steps": n, "seq_len": T, "micro_batch": B, "te_version": getattr(te, "__version__", "?"), **chosen,
            "bf16_losses": b, "fp8_losses": a, "rel_gap_per_step": gaps, "max_rel_gap": max(gaps),
            "final_rel_gap": gaps[-1], "time_ratio_fp8_over_bf16": curves["te"]["s"] / curves["none"]["s"]}, chk
