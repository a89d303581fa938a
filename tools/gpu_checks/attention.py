"""Part b of tools/gpu_check.py: MLA attention (SDPA / FlexAttention) vs its twins, peak memory at T and
T/4, the FlexAttention block mask, and balanced CP's latent attention (FlexAttention with its
log-sum-exp) vs its chunked twin."""
from __future__ import annotations

import gc
import warnings

import torch

from .common import TOL_BF16, TOL_FP32, TOL_FP32_TRITON, Check, _gen, sync, timed

LINEAR_MEMORY_MAX_RATIO = 8.0  # peak(T) / peak(T/4): 4 is linear, 16 quadratic


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


def _latent_inputs(dev, dtype, B, H, Tq, Tk, K, V, Lw, seed=3):
    g = _gen(dev, seed)
    q = torch.randn(B, H, Tq, K, device=dev, generator=g)
    lat = torch.randn(B, Tk, Lw, device=dev, generator=g)
    W = torch.randn(H * (K + V), Lw, device=dev, generator=g) * Lw ** -0.5
    return [x.to(dtype).requires_grad_() for x in (q, lat, W)]


def _expand_of(W, H, K, V):
    def expand(x):   # MLA's kv_b expansion of the latent: [B, n, L] -> k [B, H, n, K], v [B, H, n, V]
        kv = (x @ W.t()).view(x.shape[0], x.shape[1], H, K + V).transpose(1, 2)
        return kv[..., :K], kv[..., K:]
    return expand


def _latent_checks(dev, quick, chk) -> dict:
    """Balanced CP's MLA core (megak3/ops/latent_attention.py): ``latent_attention()`` -- the
    FlexAttention form with its log-sum-exp (``return_aux``) on CUDA -- vs the chunked twin
    (``_LatentAttention``, fp32 math) on the same values: output and the gradients of q, the latent
    and the expansion weight, bf16 (training) and fp32, with documents and a query block that starts
    inside a key block (negative offsets); FlexAttention's per-block (o, lse) vs the chunked loop's;
    fwd+bwd time ratio on CUDA. On CPU (dry pass) the FlexAttention form runs with torch's eager
    kernel, forward only (torch 2.13 has no FlexAttention backward on CPU)."""
    from megak3.ops import attention as A
    from megak3.ops import latent_attention as L

    cuda = dev.type == "cuda"
    if cuda:
        B, H, K, V, Lw, kb = 1, 8, 192, 128, 512, (512 if quick else 1024)   # k3_mini MLA widths
    else:
        B, H, K, V, Lw, kb = 1, 2, 24, 16, 12, 32
    Tq, Tk = kb, 4 * kb
    q_pos0 = Tk - Tq - kb // 2                 # the queries start half-way into a key block
    scale = K ** -0.5
    doc_k = _docs_BT(B, Tk, dev)
    doc_q = doc_k[:, q_pos0:q_pos0 + Tq]
    out = {"shape": {"B": B, "H": H, "Tq": Tq, "Tk": Tk, "K": K, "V": V, "L": Lw, "k_block": kb}}
    do = torch.randn(B, H, Tq, V, device=dev, generator=_gen(dev, 11))
    if not cuda:
        L._probed.clear()
    failed_before = A._flex_failed
    for dt_name, dt, tol in (("bf16", torch.bfloat16, TOL_BF16), ("fp32", torch.float32, TOL_FP32_TRITON if cuda
                                                                       else TOL_FP32)):
        ins = _latent_inputs(dev, dt, B, H, Tq, Tk, K, V, Lw)
        ref_in = [x.detach().float().requires_grad_() for x in ins]

        def twin(q, lat, W):
            return L._LatentAttention.apply(q, lat, doc_q, doc_k, _expand_of(W, H, K, V), scale, q_pos0, kb,
                                            A.DEFAULT_Q_CHUNK, A.DEFAULT_K_CHUNK, W)

        ro, rgr = _grads(twin, ref_in, do)
        if cuda:   # the dispatcher: FlexAttention with lse unless its probe failed
            o, gr = _grads(lambda q, lat, W: L.latent_attention(q, lat, _expand_of(W, H, K, V), [W], scale, doc_q,
                                                                doc_k, q_pos0, kb), ins, do.to(dt))
            for n, a, b in zip(("q", "latent", "W"), gr, rgr):
                chk.close(f"latent/{dt_name}/d{n}", a.float(), b, tol)
        else:
            with torch.no_grad():
                o = L._FlexLatentAttention.apply(
                    *[x.detach() for x in ins[:2]], doc_q, doc_k, _expand_of(ins[2].detach(), H, K, V), scale,
                    q_pos0, kb, lambda *a: L.flex_block_lse(*a, compiled=False), ins[2].detach())
        chk.close(f"latent/{dt_name}/flex_lse_vs_chunked_twin", o.float(), ro, tol)
    out["path"] = ("FlexAttention eager, forward only (CPU)" if not cuda else
                   "chunked twin (FlexAttention not importable)" if A._flex_functions() is None else
                   "chunked twin (FlexAttention with lse failed)" if A._flex_failed and not failed_before else
                   "FlexAttention with lse")
    # one block's (o, lse): queries before, inside and after the block's keys
    g = _gen(dev, 5)
    qb, kk, vv = (torch.randn(B, H, n, d, device=dev, generator=g) for n, d in ((Tq, K), (kb, K), (kb, V)))
    off = -(kb // 2)
    plan = A._Plan(Tq, 64, 64, doc_k[:, :kb], off, kb, doc_q)
    o_ref, lse_ref = A._forward(qb, kk, vv, doc_k[:, :kb], scale, plan)
    with torch.no_grad():
        o_f, lse_f = L.flex_block_lse(qb, kk, vv, scale, doc_q, doc_k[:, :kb], off, compiled=cuda)
    fin = torch.isfinite(lse_ref)
    chk.require("latent/block/lse_masked_rows", torch.equal(fin, torch.isfinite(lse_f)),
                "FlexAttention's -inf rows (queries before every key of the block) differ from the twin's")
    chk.close("latent/block/lse", lse_f[fin], lse_ref[fin], TOL_FP32_TRITON if cuda else TOL_FP32)
    chk.close("latent/block/o", o_f.float(), o_ref, TOL_FP32_TRITON if cuda else TOL_FP32)
    if cuda and out["path"] == "FlexAttention with lse":
        ins = _latent_inputs(dev, torch.bfloat16, B, H, Tq, Tk, K, V, Lw)

        def fwd_bwd(fn):
            return lambda: fn(*ins).backward(do.bfloat16())
        t_new = timed(fwd_bwd(lambda q, lat, W: L.latent_attention(q, lat, _expand_of(W, H, K, V), [W], scale,
                                                                   doc_q, doc_k, q_pos0, kb)), dev, 3)
        t_twin = timed(fwd_bwd(lambda q, lat, W: L._LatentAttention.apply(
            q, lat, doc_q, doc_k, _expand_of(W, H, K, V), scale, q_pos0, kb, A.DEFAULT_Q_CHUNK,
            A.DEFAULT_K_CHUNK, W)), dev, 2)
        out.update(fwd_bwd_s=t_new, chunked_twin_fwd_bwd_s=t_twin, speedup_vs_chunked=t_twin / t_new)
    return out


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
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out["latent"] = _latent_checks(dev, quick, chk)
    latent_warn = [str(w.message) for w in rec if "log-sum-exp" in str(w.message)]
    if latent_warn:
        out["latent"]["flex_warning"] = latent_warn[0][:300]
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
