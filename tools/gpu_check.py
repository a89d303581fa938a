"""One prepared GPU check (issue 19): parity, memory and speed of the CUDA paths, a JSON report.

    python tools/gpu_check.py --out report.json            # on a CUDA machine: every part, < 8 min on one H200
    python tools/gpu_check.py --quick --out report.json    # shorter shapes and fewer steps
    python tools/gpu_check.py --device cpu --out dry.json  # dry pass of parts b-d at tiny shapes on CPU
    python tools/gpu_check.py                              # no GPU: one 'skip: <part>: <reason>' line each, exit 0

Parts (each compares a fast path with its twin measured in the same run, or measures one number):
  a fla_kda        fla's Triton ``chunk_kda`` called the way megak3/ops/kda.py ``kda()`` calls it, bf16
                   inputs, vs our chunked KDA in fp32 on the same values (with and without documents);
                   output and final state within a bf16 tolerance; time ratio
  b mla_attention  megak3/ops/attention.py ``attention()`` (SDPA without documents, FlexAttention with
                   them or with a CP query offset on CUDA) vs ``reference_attention`` (dense fp32)
                   and ``chunked_attention``,
                   outputs and input gradients; peak memory of forward+backward at T and T/4 (64K and
                   16K; --quick 16K and 4K), each measured cold (the first call at that shape, no
                   warm-up; caches emptied, peak reset): ratio ~4 means memory linear in T, ~16
                   quadratic; the block mask equal to torch's create_block_mask, and its own cold
                   peak at T within 64 B/token + 40 B/tile (no [T, T] tensor)
  c grouped_gemm   megak3/model/moe.py ``grouped_linear``: tiled fp32 and grouped_mm bf16 (direct and
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

Exit status: 0 when every part that ran is within tolerance (skips are fine), 1 on any result beyond
tolerance or any part that raised; each failure prints one 'FAIL: <part>: ...' line.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # runnable as `python tools/gpu_check.py` from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PARTS = ("fla_kda", "mla_attention", "grouped_gemm", "throughput", "host_syncs", "te_fp8", "apex_rms_norm")
DRY = ("mla_attention", "grouped_gemm", "throughput")
"""parts with a CPU dry pass (--device cpu); the others need CUDA by nature"""

# tolerances: relative L2 error ||a - b|| / ||b||
TOL_FP32 = 1e-4          # same math in fp32, different kernels (no TF32: torch's default for matmul)
TOL_FP32_TRITON = 5e-3   # Triton kernels (FlexAttention) may use TF32 for fp32 dots
TOL_BF16 = 2e-2          # bf16 inputs / bf16 GEMM output vs an fp32 computation on the same values
TOL_BF16_ULP = 4e-3      # bf16 results of the same rounding steps: at most one bf16 ulp (2^-8) on every element
TOL_FP8_LOSS = 0.05      # FP8 vs bf16 training loss, relative, any of the steps
LINEAR_MEMORY_MAX_RATIO = 8.0  # peak(T) / peak(T/4): 4 is linear, 16 quadratic
LOSS_DROP_MIN = 0.03     # throughput: the repeated batch's loss falls by at least 3% (CPU dry pass: ~10%)


class Skip(Exception):
    """A part that cannot run here (missing package or device): reported, never a failure."""


class Check:
    """Collects the comparisons of one part; ``failures`` are the lines printed as FAIL."""

    def __init__(self):
        self.results: dict = {}
        self.failures: list = []

    def close(self, name: str, a: torch.Tensor, b: torch.Tensor, tol: float) -> float:
        err = rel_err(a, b)
        self.results[name] = {"rel_err": err, "tol": tol, "ok": err <= tol}
        if not err <= tol:  # NaN fails too
            self.failures.append(f"{name}: relative error {err:.3g} > {tol:g}")
        return err

    def require(self, name: str, ok: bool, what: str) -> None:
        self.results[name] = {"ok": bool(ok), "what": what}
        if not ok:
            self.failures.append(f"{name}: {what}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double().to(a.device)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up run."""
    fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def _gen(dev, seed):
    return torch.Generator(device=dev).manual_seed(seed)


# ---- a: fla chunk_kda vs our chunked KDA ---------------------------------------------------------

def part_fla_kda(dev, quick, ctx):
    if dev.type != "cuda":
        raise Skip("fla's Triton chunk_kda needs CUDA")
    try:
        import fla  # noqa: F401
        from fla.ops.kda import chunk_kda as _  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not installed here
        raise Skip(f"fla not importable ({type(e).__name__}: {str(e)[:120]}); pip install fla-core")
    from megak3.ops.kda import chunk_kda, kda, kda_gate

    B, T, H, K = 1, (2048 if quick else 8192), 8, 128          # k3_mini KDA heads
    g = _gen(dev, 0)
    q = F.normalize(torch.randn(B, T, H, K, device=dev, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, device=dev, generator=g), dim=-1)
    v = torch.randn(B, T, H, K, device=dev, generator=g)
    gate = kda_gate(torch.randn(B, T, H * K, device=dev, generator=g),
                    torch.rand(H, device=dev, generator=g).log(), torch.zeros(H * K, device=dev))
    beta = torch.rand(B, T, H, device=dev, generator=g)
    bf = [x.bfloat16() for x in (q, k, v)]
    # the fp32 reference sees the bf16-rounded values, so the gap is fla's arithmetic alone
    q32, k32, v32 = (x.float() for x in bf)
    beta_bf = beta.bfloat16()
    chk, out = Check(), {"shape": [B, T, H, K]}
    for name, cu in (("no_docs", None), ("docs", torch.tensor([0, T // 3, T // 2, T], device=dev))):
        ref_o, ref_s = chunk_kda(q32, k32, v32, gate, beta_bf.float(), cu_seqlens=cu, output_final_state=True)
        try:
            o, s = kda(*bf, gate, beta_bf, cu_seqlens=cu, output_final_state=True, use_fla=True, lower_bound=-5.0)
        except TypeError as e:
            chk.require(f"{name}/call", False, f"fla chunk_kda rejects the arguments megak3.ops.kda.kda passes: {e}")
            continue
        chk.close(f"{name}/output", o.float(), ref_o, TOL_BF16)
        chk.close(f"{name}/final_state", s.float(), ref_s, TOL_BF16)
    if not chk.failures:
        t_fla = timed(lambda: kda(*bf, gate, beta_bf, use_fla=True, lower_bound=-5.0), dev, 5)
        t_ours = timed(lambda: chunk_kda(q32, k32, v32, gate, beta_bf.float()), dev, 3)
        out.update(fla_fwd_s=t_fla, ours_fp32_fwd_s=t_ours, speedup=t_ours / t_fla)
    import fla as _fla

    out["fla_version"] = getattr(_fla, "__version__", "?")
    return out, chk


# ---- b: memory-linear MLA attention vs its twins -------------------------------------------------

def _docs_BT(B, T, dev):
    cuts = [0, T // 5, T // 2, (3 * T) // 4, T]   # four documents per row, unequal lengths
    ids = torch.zeros(T, dtype=torch.int64)
    for d, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        ids[a:b] = d
    return ids.expand(B, T).contiguous().to(dev)


def _attn_inputs(B, H, T, K, V, dev, dtype, seed=0):
    g = _gen(dev, seed)
    return [torch.randn(B, H, T, d, device=dev, generator=g).to(dtype).requires_grad_()
            for d in (K, K, V)]


def _grads(fn, inputs, do):
    for x in inputs:
        x.grad = None
    o = fn(*inputs)
    o.backward(do)
    return o.detach(), [x.grad.detach().clone() for x in inputs]


def _cold(dev) -> int:
    """Free what can be freed, empty the allocator's cache, reset the peak; the bytes still allocated."""
    gc.collect()
    sync(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


def _peak_bytes(dev, B, H, T, K, V, docs: bool) -> int:
    """Extra peak bytes of attention() forward + backward over its inputs (bf16), measured cold: the
    first call at this shape (FlexAttention's forward+backward probe, compilation and the block
    mask included; the block-mask cache emptied), no warm-up call before it."""
    from megak3.ops import attention as A

    q, k, v = _attn_inputs(B, H, T, K, V, dev, torch.bfloat16, seed=1)
    doc = _docs_BT(B, T, dev) if docs else None
    do = torch.randn(B, H, T, V, device=dev, dtype=torch.bfloat16)
    A._block_mask_cache.clear()
    base = _cold(dev)
    A.attention(q, k, v, K ** -0.5, doc).backward(do)
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    A._block_mask_cache.clear()
    return peak


def _block_mask_checks(dev, T, chk) -> dict:
    """megak3's block mask on the GPU: equal to torch's create_block_mask at a small T (documents,
    a CP offset), and its cold peak at ``T`` within O(T) + a block-level term (no [T, T] tensor)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from megak3.ops import attention as A

    Tk, off = 1000, 360
    doc = _docs_BT(2, Tk, dev)
    doc[1, 500:] += 1
    doc_q = doc[:, off:]
    A._block_mask_cache.clear()
    got = A.flex_block_mask(doc, 2, Tk - off, Tk, off, dev)
    ref = create_block_mask(lambda b, h, q, k: (k <= q + off) & (doc_q[b, q] == doc[b, k]), 2, None, Tk - off, Tk,
                            device=dev)
    fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
    chk.require("block_mask/equals_create_block_mask", all(torch.equal(getattr(got, f), getattr(ref, f))
                                                           for f in fields), "tiles differ from create_block_mask's")
    del got, ref
    doc = _docs_BT(1, T, dev)
    A._block_mask_cache.clear()
    base = _cold(dev)
    A.flex_block_mask(doc, 1, T, T, 0, dev)
    sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    A._block_mask_cache.clear()
    bound = 64 * T + 40 * (T // A.FLEX_BLOCK) ** 2 + (1 << 20)   # + 1 MiB of allocator rounding
    chk.require("block_mask/no_dense_term", peak <= bound, f"block mask peak {peak} B at T={T} > {bound} B")
    return {"T": T, "peak_bytes": peak, "bound_bytes": bound, "dense_int64_mask_bytes": 8 * T * T}


def part_mla_attention(dev, quick, ctx):
    from megak3.ops import attention as A

    cuda = dev.type == "cuda"
    if cuda:
        B, H, T, K, V = 1, 8, (2048 if quick else 4096), 192, 128   # k3_mini MLA: qk 128+64, v 128
    else:
        B, H, T, K, V = 2, 2, 160, 24, 16
    scale = K ** -0.5
    doc = _docs_BT(B, T, dev)
    chk = Check()
    out = {"shape": [B, H, T, K, V], "flex_importable": A._flex_functions() is not None}
    g = _gen(dev, 7)
    do = torch.randn(B, H, T, V, device=dev, generator=g)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        # bf16 first: the training dtype. attention() falls back to the chunked path for the rest
        # of the process once FlexAttention raises, so a failure of the fp32 case alone is recorded
        # and then undone (the training part below should run what training runs)
        for dt_name, dt, tol in (("bf16", torch.bfloat16, TOL_BF16),
                                 ("fp32", torch.float32, TOL_FP32_TRITON if cuda else TOL_FP32)):
            if dt_name == "fp32":
                flex_failed_bf16 = A._flex_failed
            ins = _attn_inputs(B, H, T, K, V, dev, dt)
            # the reference sees the same (rounded) values in fp32
            ref_in = [x.detach().float().requires_grad_() for x in ins]
            for case, d in (("docs", doc), ("no_docs", None)):
                o, gr = _grads(lambda q, k, v: A.attention(q, k, v, scale, d), ins, do.to(dt))
                ro, rgr = _grads(lambda q, k, v: A.reference_attention(q, k, v, scale, d), ref_in, do.to(dt).float())
                chk.close(f"{dt_name}/{case}/attention_vs_reference", o.float(), ro, tol)
                for n, a, b in zip("qkv", gr, rgr):
                    chk.close(f"{dt_name}/{case}/d{n}", a.float(), b, tol)
            # a CP rank's queries (the second half) against all keys: FlexAttention's offset mask on CUDA
            off = T // 2
            q_in, rq_in = ins[0][:, :, off:].detach().requires_grad_(), ref_in[0][:, :, off:].detach().requires_grad_()
            o, gr = _grads(lambda q, k, v: A.attention(q, k, v, scale, doc, q_offset=off), [q_in] + ins[1:],
                           do[:, :, off:].to(dt))
            ro, rgr = _grads(lambda q, k, v: A.reference_attention(q, k, v, scale, doc, q_offset=off),
                             [rq_in] + ref_in[1:], do[:, :, off:].to(dt).float())
            chk.close(f"{dt_name}/docs_q_offset/attention_vs_reference", o.float(), ro, tol)
            for n, a, b in zip("qkv", gr, rgr):
                chk.close(f"{dt_name}/docs_q_offset/d{n}", a.float(), b, tol)
            if dt_name == "fp32":   # the CPU twin itself, on the same device
                co = A.chunked_attention(*[x.detach() for x in ref_in], scale, doc, 64, 64)
                ro = A.reference_attention(*[x.detach() for x in ref_in], scale, doc)
                chk.close("fp32/docs/chunked_vs_reference", co, ro, TOL_FP32)
                out["flex_failed_fp32_only"] = bool(A._flex_failed and not flex_failed_bf16)
                A._flex_failed = flex_failed_bf16
    flex_warn = [str(w.message) for w in rec if "FlexAttention" in str(w.message)]
    out["documents_path"] = ("chunked_attention (CPU)" if not cuda else
                             "chunked_attention (FlexAttention not importable)" if not out["flex_importable"] else
                             "chunked_attention (FlexAttention failed in bf16)" if A._flex_failed else
                             "FlexAttention")
    if flex_warn:
        out["flex_warning"] = flex_warn[0][:300]
    if cuda:
        t_hi = 16384 if quick else 65536
        mem = {}
        for case, docs in (("docs", True), ("no_docs", False)):
            hi = _peak_bytes(dev, 1, H, t_hi, K, V, docs)
            lo = _peak_bytes(dev, 1, H, t_hi // 4, K, V, docs)
            bound = H * t_hi * t_hi * 2          # one bf16 [T, T] score matrix per head
            ratio = hi / max(lo, 1)
            mem[case] = {"T": t_hi, "peak_bytes": hi, "peak_bytes_T_over_4": lo, "ratio": ratio,
                         "o_t2_bound_bytes": bound, "peak_over_bound": hi / bound}
            chk.require(f"memory/{case}/linear", ratio <= LINEAR_MEMORY_MAX_RATIO,
                        f"peak(T={t_hi}) / peak(T/4) = {ratio:.2f} (4 = linear, 16 = quadratic; "
                        f"limit {LINEAR_MEMORY_MAX_RATIO})")
        out["memory"] = mem
        out["block_mask"] = _block_mask_checks(dev, t_hi, chk)
        ins = _attn_inputs(B, H, T, K, V, dev, torch.bfloat16)
        fwd_bwd = lambda fn: (lambda: fn(*ins).backward(do.bfloat16()))  # noqa: E731
        t_new = timed(fwd_bwd(lambda q, k, v: A.attention(q, k, v, scale, doc)), dev, 3)
        t_twin = timed(fwd_bwd(lambda q, k, v: A.chunked_attention(q, k, v, scale, doc)), dev, 2)
        out.update(attention_fwd_bwd_s=t_new, chunked_fwd_bwd_s=t_twin, speedup_vs_chunked=t_twin / t_new)
    return out, chk


# ---- c: grouped expert GEMM paths vs the loop twin ----------------------------------------------

def _expert_counts(X, E, dev, seed=0):
    """Zipf(1.2)-skewed rows per expert summing to X, with a few empty experts."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    p[torch.randperm(E, generator=g)[: max(1, E // 16)]] = 0.0
    p = p[torch.randperm(E, generator=g)]
    c = torch.multinomial(p, X, replacement=True, generator=g)
    return torch.zeros(E, dtype=torch.int64).scatter_add_(0, c, torch.ones_like(c)).to(dev)


def part_grouped_gemm(dev, quick, ctx):
    from megak3.model.moe import grouped_linear, pick_impl

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
    from megak3.model.moe import grouped_linear
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


# ---- d / e / f: training through RankStep --------------------------------------------------------

def _job(model_name, overrides, seq_len, batch, steps, precision, device, fp8="none"):
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.optim import OptimConfig
    from megak3.quant.config import QuantConfig
    from megak3.train.config import JobConfig, TrainConfig
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


# ---- g: apex fused RMSNorm vs the torch twin ----------------------------------------------------

def _max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the largest elementwise gap on the reference's scale."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def part_apex_rms_norm(dev, quick, ctx):
    if dev.type != "cuda":
        raise Skip("apex's fused RMSNorm kernels are CUDA-only")
    from megak3.model import norm as N

    if N.apex_rms_norm_fn() is None:
        raise Skip("NVIDIA apex with its CUDA extensions (fused_layer_norm_cuda) is not built here; "
                   "model.norm_impl=auto runs the torch RMSNorm")
    rows, eps = (4096 if quick else 16384), 1e-5
    chk, out = Check(), {"rows": rows, "max_rel_diff": {}, "fwd_bwd_s": {}, "speedup": {}}

    def pair(D, dtype):
        g = _gen(dev, D)
        w = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(dtype)
        mods = {}
        for impl in ("apex", "torch"):
            m = N.RMSNorm(D, eps, impl=impl).to(device=dev, dtype=dtype)
            with torch.no_grad():
                m.weight.copy_(w)
            mods[impl] = m
        return mods

    def fwd_bwd(m, x, dy, autocast=False):
        m.weight.grad = None
        xg = x.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            y = m(xg)
        y.backward(dy.to(y.dtype))
        return y.detach(), xg.grad, m.weight.grad

    cases = [(f"{dn}/D{D}", D, dt, dt, False, tol) for dn, dt, tol in (("fp32", torch.float32, TOL_FP32),
                                                                       ("bf16", torch.bfloat16, TOL_BF16))
             for D in (1024, 128)]                      # k3_mini hidden size; a KDA o_norm head
    cases.append(("autocast_fp32_residual/D1024", 1024, torch.float32, torch.float32, True, TOL_FP32))
    for name, D, x_dtype, w_dtype, autocast, tol in cases:
        mods = pair(D, w_dtype)
        g = _gen(dev, 100 + D)
        x = (3 * torch.randn(rows, D, device=dev, generator=g)).to(x_dtype)
        dy = torch.randn(rows, D, device=dev, generator=g).to(x_dtype)
        chk.require(f"{name}/routes_to_apex", N.uses_apex(x, mods["apex"].weight, "apex"),
                    "RMSNorm(impl='apex') did not take apex's kernel for a CUDA input of its weight's dtype")
        got, ref = fwd_bwd(mods["apex"], x, dy, autocast), fwd_bwd(mods["torch"], x, dy, autocast)
        if autocast:
            chk.require(f"{name}/out_dtype", got[0].dtype == ref[0].dtype == torch.float32,
                        f"under bf16 autocast an fp32 input gave {got[0].dtype} (twin {ref[0].dtype}); expected fp32")
        for t, a, b in zip(("out", "dx", "dw"), got, ref):
            # bf16 out: apex rounds like the twin (norm.py), only the fp32 sum of squares differs
            t_tol = TOL_BF16_ULP if (t, x_dtype) == ("out", torch.bfloat16) else tol
            chk.close(f"{name}/{t}", a.float(), b.float(), t_tol)
            out["max_rel_diff"][f"{name}/{t}"] = _max_rel_diff(a, b)
        if x_dtype == torch.bfloat16:
            out[f"{name}/out_bitwise_equal_fraction"] = float((got[0] == ref[0]).double().mean())
        if D == 1024 and not autocast:
            t_apex = timed(lambda: fwd_bwd(mods["apex"], x, dy), dev, 10)
            t_twin = timed(lambda: fwd_bwd(mods["torch"], x, dy), dev, 10)
            out["fwd_bwd_s"][name] = {"apex": t_apex, "torch": t_twin}
            out["speedup"][name] = t_twin / t_apex
    # a bf16 activation with an fp32 master weight has no apex kernel (csrc/type_shim.h): the twin runs
    w32 = pair(128, torch.float32)["apex"].weight
    chk.require("bf16_x_fp32_weight/stays_on_twin", not N.uses_apex(torch.ones(2, 128, device=dev,
                                                                              dtype=torch.bfloat16), w32, "apex"),
                "a bf16 input with an fp32 weight was routed to apex")
    import apex

    out["apex_version"] = getattr(apex, "__version__", "?")
    return out, chk


RUNNERS = {"fla_kda": part_fla_kda, "mla_attention": part_mla_attention, "grouped_gemm": part_grouped_gemm,
           "throughput": part_throughput, "host_syncs": part_host_syncs, "te_fp8": part_te_fp8,
           "apex_rms_norm": part_apex_rms_norm}


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
    return ""


if __name__ == "__main__":
    sys.exit(main())
