"""Part g of tools/gpu_check.py: NVIDIA apex's fused RMSNorm vs the torch twin."""
from __future__ import annotations

import contextlib

import torch

from .common import TOL_BF16, TOL_BF16_ULP, TOL_FP32, Check, Skip, _gen, timed


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
