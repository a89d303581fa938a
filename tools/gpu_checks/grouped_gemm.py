"""Part c of tools/gpu_check.py: the grouped expert GEMM paths vs the loop twin, and the CUDA rules of
every grouped_mm call of the training path."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .common import TOL_BF16, TOL_FP32, Check, _gen, sync, timed


def _expert_counts(X, E, dev, seed=0):
    """Zipf(1.2)-skewed rows per expert summing to X, with a few empty experts."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    p[torch.randperm(E, generator=g)[: max(1, E // 16)]] = 0.0
    p = p[torch.randperm(E, generator=g)]
    c = torch.multinomial(p, X, replacement=True, generator=g)
    return torch.zeros(E, dtype=torch.int64).scatter_add_(0, c, torch.ones_like(c)).to(dev)


def part_grouped_gemm(dev, quick, ctx):
    from megak3.ops.grouped_gemm import grouped_linear, pick_impl

    if dev.type == "cuda":
        E, L, m, X = 128, 512, 512, (8192 if quick else 32768)     # k3_mini experts, 8K tokens x top-4
    else:
        E, L, m, X = 8, 32, 48, 256
    counts = _expert_counts(X, E, dev)
    g = _gen(dev, 3)
    x = torch.randn(X, L, device=dev, generator=g)
    w = torch.randn(E, m, L, device=dev, generator=g) * L ** -0.5
    dy = torch.randn(X, m, device=dev, generator=g)
    chk = Check()
    out = {"E": E, "L": L, "m": m, "X": X, "has_grouped_mm": hasattr(F, "grouped_mm")}

    def run(xv, wv, impl, autocast=False, dyv=dy):
        xv, wv = xv.detach().clone().requires_grad_(), wv.detach().clone().requires_grad_()
        with torch.autocast(dev.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            y = grouped_linear(xv, wv, counts, impl)
        y.backward(dyv.to(y.dtype))
        return y.detach(), xv.grad, wv.grad

    ref = run(x, w, "loop")
    names = ("out", "dx", "dw")
    for n, a, b in zip(names, run(x, w, "tiled"), ref):
        chk.close(f"tiled_fp32/{n}", a, b, TOL_FP32)
    xb, wb = x.bfloat16(), w.bfloat16()
    ref_b = run(xb.float(), wb.float(), "loop", dyv=dy.bfloat16().float())   # fp32 math on the bf16 values
    if out["has_grouped_mm"]:
        for n, a, b in zip(names, run(xb, wb, "grouped_mm", dyv=dy.bfloat16()), ref_b):
            chk.close(f"grouped_mm_bf16/{n}", a.float(), b, TOL_BF16)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        out["autocast_impl"] = pick_impl(xb, wb, None)
    for n, a, b in zip(names, run(xb.float(), wb.float(), None, autocast=True, dyv=dy.bfloat16()), ref_b):
        chk.close(f"autocast_{out['autocast_impl']}/{n}", a.float(), b, TOL_BF16)
    _grouped_rules_checks(dev, x, w, dy, counts, ref_b, out, chk)
    reps = 3 if dev.type == "cpu" else 5
    t = {"loop_fp32": timed(lambda: run(x, w, "loop"), dev, reps),
         "tiled_fp32": timed(lambda: run(x, w, "tiled"), dev, reps),
         "loop_bf16": timed(lambda: run(xb, wb, "loop"), dev, reps)}
    if out["has_grouped_mm"]:
        t["grouped_mm_bf16"] = timed(lambda: run(xb, wb, "grouped_mm"), dev, reps)
    t["autocast_fp32_masters"] = timed(lambda: run(x, w, None, autocast=True), dev, reps)
    out["fwd_bwd_s"] = t
    out["speedup_vs_loop"] = {k: (t["loop_fp32"] if "fp32" in k and "autocast" not in k else t["loop_bf16"]) / v
                              for k, v in t.items() if not k.startswith("loop")}
    return out, chk


def _grouped_rules_checks(dev, x, w, dy, counts, ref_b, out, chk) -> None:
    """Every grouped_mm call of the training path (bf16 autocast over fp32 masters: forward,
    backward, and the zero-bubble deferred dW) within megak3/ops/cuda_rules.py's rules; on a GPU
    where autocast picks grouped_mm, the kernel itself takes 1023 groups and refuses 1024."""
    from megak3.ops.grouped_gemm import grouped_linear
    from megak3.ops.cuda_rules import GROUPED_MM_MAX_GROUPS, record_grouped_mm
    from megak3.ops.weight_grad import WeightGradStore

    store = WeightGradStore()
    store.key = 0
    xv, wv = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    with record_grouped_mm() as rec:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = grouped_linear(xv, wv, counts)
        y.backward(dy.bfloat16())
        plain = len(rec.calls)
        xd, wd = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with store.capture():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                yd = grouped_linear(xd, wd, counts)
            yd.backward(dy.bfloat16())
        store.flush(0)
    broken = sorted({f"{r}" for c in rec.calls for r in c.broken})
    out["grouped_mm_calls"] = {"autocast": plain, "deferred": len(rec.calls) - plain, "rules_broken": broken}
    if out["autocast_impl"] == "grouped_mm":
        chk.require("cuda_rules/calls", len(rec.calls) == 6 and not broken,
                    f"{len(rec.calls)} grouped_mm calls (6 expected), rules broken: {broken}")
    chk.close("deferred_dw_autocast/dw", wd.grad.float(), ref_b[2], TOL_BF16)
    if dev.type != "cuda" or out["autocast_impl"] != "grouped_mm":
        return
    took = {}
    xs = torch.randn(16, 64, device=dev, dtype=torch.bfloat16)
    for G in (GROUPED_MM_MAX_GROUPS, GROUPED_MM_MAX_GROUPS + 1):
        wg = torch.randn(G, 64, 64, device=dev, dtype=torch.bfloat16)
        try:
            F.grouped_mm(xs, wg.transpose(-2, -1), offs=torch.full((G,), 16, device=dev, dtype=torch.int32))
            sync(dev)
            took[G] = True
        except RuntimeError:
            took[G] = False
    out["kernel_takes_groups"] = {str(g): v for g, v in took.items()}
    chk.require("group_limit", took == {GROUPED_MM_MAX_GROUPS: True, GROUPED_MM_MAX_GROUPS + 1: False},
                f"grouped_mm took {took}; megak3/ops/cuda_rules.py expects 1023 yes, 1024 no")
