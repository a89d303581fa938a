"""One prepared GPU check (issue 19): parity, memory and speed of the CUDA paths, a JSON report.

    python tools/gpu_check.py --out report.json            # on a CUDA machine: every part, < 8 min on one H200
    python tools/gpu_check.py --quick --out report.json    # shorter shapes and fewer steps
    python tools/gpu_check.py --device cpu --out dry.json  # dry pass of parts b-d at tiny shapes on CPU
    python tools/gpu_check.py                              # no GPU: one 'skip: <part>: <reason>' line each, exit 0

Parts (each compares a fast path with its twin measured in the same run, or measures one number):
  a fla_kda        fla's Triton ``chunk_kda`` called the way megak3/ops/kda/dispatch.py ``kda()`` calls it, bf16
                   inputs, vs our chunked KDA in fp32 on the same values (with and without documents);
                   output and final state within a bf16 tolerance; time ratio
  b mla_attention  megak3/ops/attention.py ``attention()`` (SDPA without documents, FlexAttention with
                   them or with a CP query offset on CUDA) vs ``reference_attention`` (dense fp32)
                   and ``chunked_attention``,
                   outputs and input gradients; peak memory of forward+backward at T and T/4 (64K and
                   16K; --quick 16K and 4K), each measured cold (the first call at that shape, no
                   warm-up; caches emptied, peak reset): ratio ~4 means memory linear in T, ~16
                   quadratic; the block mask equal to torch's create_block_mask, and its own cold
                   peak at T within 64 B/token + 40 B/tile (no [T, T] tensor); balanced CP's
                   megak3/ops/latent_attention.py ``latent_attention()`` (FlexAttention with its
                   log-sum-exp, ``return_aux``) vs its chunked twin: output, dq, dlatent, dW in bf16
                   and fp32, one block's (o, lse), fwd+bwd time ratio (CPU dry pass: eager
                   FlexAttention, forward only)
  c grouped_gemm   megak3/ops/grouped_gemm.py ``grouped_linear``: tiled fp32 and grouped_mm bf16 (direct and
                   under bf16 autocast over fp32 operands, the training path) vs the loop twin;
                   forward and gradients; fwd+bwd time ratios vs the loop; every grouped_mm call of
                   the training path (forward, backward, deferred dW) within megak3/ops/cuda_rules.py's
                   rules, and the kernel taking 1023 groups and refusing 1024
  d throughput     k3_mini trained through RankStep (megak3/train/step.py) on one device, bf16 autocast:
                   tokens/s and MFU (FLOPs per token: megak3.launch.planner.flops_per_token; peak:
                   conf/hardware via megak3/train/summary.peak_flops_per_rank); the loss of a repeated
                   batch must be finite and fall
  e host_syncs     one non-logging training step under ``torch.cuda.set_sync_debug_mode("warn")``: the
                   synchronizing CUDA calls counted (accumulate / apply) with their source lines
                   (on CPU tests/test_host_syncs.py counts them with a dispatch-mode spy)
  f te_fp8         Transformer Engine FP8 dense linears (quant.fp8=te) vs bf16: 20 steps of k3_mini
                   from the same init on the same batches, the relative loss gap; the recipe
                   megak3/quant/te.py chose for this GPU / CUDA / TE and TE's own check of it
  g apex_rms_norm  NVIDIA apex's fused affine RMSNorm as megak3/model/norm.py ``RMSNorm`` runs it vs the
                   torch twin ``rms_norm``: output, dx and dw in fp32 and bf16 at the k3_mini width and a
                   KDA head width, and an fp32 residual under bf16 autocast (the result stays fp32);
                   max relative difference per tensor; fwd+bwd time ratios. Skips when apex is not built

  h h2d           megak3/ops/h2d.py ``host_to_device`` (the training step's host-to-device copies): values bit
                   for bit; with 0.5 s of GPU work queued (``torch.cuda._sleep``) its host time vs a plain
                   ``.to(device)`` of the same pageable 2 MiB tensor (the control, which waits), the ratio
                   printed; the source may change once the call returns; staging buffers stay in flight
                   until their copy completes

The parts live in tools/gpu_checks/, one module per topic; this file is the driver (CLI, device,
skips, the JSON report).

Exit status: 0 when every part that ran is within tolerance (skips are fine), 1 on any result beyond
tolerance or any part that raised; each failure prints one 'FAIL: <part>: ...' line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tools"):  # runnable as `python tools/gpu_check.py` from anywhere; parts in tools/gpu_checks/
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

from gpu_checks.apex import part_apex_rms_norm  # noqa: E402
from gpu_checks.attention import part_mla_attention  # noqa: E402
from gpu_checks.common import Skip  # noqa: E402
from gpu_checks.grouped_gemm import part_grouped_gemm  # noqa: E402
from gpu_checks.h2d import part_h2d  # noqa: E402
from gpu_checks.kda import part_fla_kda  # noqa: E402
from gpu_checks.training import part_host_syncs, part_te_fp8, part_throughput  # noqa: E402

PARTS = ("fla_kda", "mla_attention", "grouped_gemm", "throughput", "host_syncs", "te_fp8", "apex_rms_norm", "h2d")
DRY = ("mla_attention", "grouped_gemm", "throughput")
"""parts with a CPU dry pass (--device cpu); the others need CUDA by nature"""

RUNNERS = {"fla_kda": part_fla_kda, "mla_attention": part_mla_attention, "grouped_gemm": part_grouped_gemm,
           "throughput": part_throughput, "host_syncs": part_host_syncs, "te_fp8": part_te_fp8,
           "apex_rms_norm": part_apex_rms_norm, "h2d": part_h2d}


# ---- driver -----------------------------------------------------------------------------------------

def resolve_device(name: str):
    """torch.device, or None for 'no CUDA here': every part is then a skip line."""
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else None
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch "
                         f"{torch.__version__} (torch.cuda.is_available() is False)")
    return torch.device(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: CUDA when present, else skip every part; cpu: dry pass of parts "
                         + ", ".join(DRY) + " at tiny shapes")
    ap.add_argument("--quick", action="store_true", help="shorter shapes and fewer steps")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        ap.error(f"--parts: unknown {bad}; choose from {', '.join(PARTS)}")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads()))
    dev = resolve_device(args.device)
    report = {"device": str(dev) if dev is not None else "none", "quick": args.quick,
              "torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "parts": {}}
    if dev is not None and dev.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(dev)
        report["capability"] = list(torch.cuda.get_device_capability(dev))
    failures: list = []
    ctx: dict = {}
    t_all = time.perf_counter()
    for part in parts:
        if dev is None:
            reason = (f"no CUDA device (torch {torch.__version__}, cuda available: False); "
                      + ("--device cpu runs a dry pass" if part in DRY else "needs a GPU"))
            print(f"skip: {part}: {reason}", flush=True)
            report["parts"][part] = {"status": "skip", "reason": reason}
            continue
        t0 = time.perf_counter()
        try:
            out, chk = RUNNERS[part](dev, args.quick, ctx)
        except Skip as e:
            print(f"skip: {part}: {e}", flush=True)
            report["parts"][part] = {"status": "skip", "reason": str(e)}
            continue
        except Exception as e:  # noqa: BLE001 - a part that raises is a failed check, reported loudly
            line = f"{type(e).__name__}: {e}".splitlines()[0][:400]
            failures.append(f"FAIL: {part}: raised {line}")
            print(failures[-1], flush=True)
            report["parts"][part] = {"status": "error", "error": line, "traceback": traceback.format_exc()[-4000:],
                                     "seconds": time.perf_counter() - t0}
            continue
        status = "fail" if chk.failures else "ok"
        report["parts"][part] = {"status": status, "seconds": time.perf_counter() - t0, **out,
                                 "checks": chk.results}
        for f in chk.failures:
            failures.append(f"FAIL: {part}: {f}")
            print(failures[-1], flush=True)
        print(f"{status}: {part}: {_summary(part, out)} ({time.perf_counter() - t0:.1f} s)", flush=True)
    report["seconds"] = time.perf_counter() - t_all
    report["failures"] = failures
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    if failures:
        print(f"gpu_check: {len(failures)} failure(s)", flush=True)
        return 1
    return 0


def _summary(part: str, out: dict) -> str:
    """One line of the numbers that matter of a finished part."""
    f = lambda x: "n/a" if x is None else f"{x:.3g}"  # noqa: E731
    if part == "fla_kda":
        return f"fla {out.get('fla_version')}, fwd speedup vs ours fp32 {f(out.get('speedup'))}"
    if part == "mla_attention":
        mem = out.get("memory", {}).get("docs")
        m = f", peak(T)/peak(T/4) {mem['ratio']:.2f} at T={mem['T']}" if mem else ""
        return f"documents path: {out['documents_path']}{m}"
    if part == "grouped_gemm":
        return f"autocast picks {out['autocast_impl']}; fwd+bwd speedup vs loop " + ", ".join(
            f"{k} {v:.2f}x" for k, v in out["speedup_vs_loop"].items())
    if part == "throughput":
        return (f"{out['model']} {out['tokens_per_s']:,.0f} tokens/s, MFU {f(out['mfu'])}, "
                f"loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f}")
    if part == "host_syncs":
        return f"{out['syncs_per_step']} sync(s) per step (accumulate {out['accumulate']}, apply {out['apply']})"
    if part == "te_fp8":
        return f"max relative loss gap {out['max_rel_gap']:.4f} over {out['steps']} steps"
    if part == "apex_rms_norm":
        return ("max relative diff vs the twin " + ", ".join(
            f"{k} {max(v for n, v in out['max_rel_diff'].items() if n.startswith(k)):.2g}" for k in ("fp32", "bf16"))
            + "; fwd+bwd speedup " + ", ".join(f"{k} {v:.2f}x" for k, v in out["speedup"].items()))
    if part == "h2d":
        hs = out["host_s"]
        return (f"host ms with {out['queued_s'] * 1e3:.0f} ms queued: host_to_device {hs['host_to_device'] * 1e3:.2f}, "
                f".to(device) {hs['to_blocking'] * 1e3:.1f} ({out['blocking_over_helper']:.0f}x), pageable "
                f"non_blocking {hs['to_non_blocking_pageable'] * 1e3:.2f}")
    return ""


if __name__ == "__main__":
    sys.exit(main())
