"""Part a of tools/gpu_check.py: fla's Triton ``chunk_kda`` vs our chunked KDA."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import TOL_BF16, Check, Skip, _gen, timed


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
