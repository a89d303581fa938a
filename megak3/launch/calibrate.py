"""Activation coefficients of the planner, counted from this implementation's autograd graph.

``measure(overrides)`` runs one real forward of a small K3 on CPU under
``torch.autograd.graph.saved_tensors_hooks`` and attributes every tensor autograd saves for
backward (deduplicated by storage) to the top-level module that saved it: each layer's attention
(KDA or MLA), its MLP (dense SiTU-GLU or LatentMoE), its two AttnRes sites, its two RMSNorms, and
the head (output AttnRes, final norm, lm_head, cross entropy). ``fit()`` measures a set of widths
and solves, per module kind, bytes/token = sum_i coef_i * feature_i by least squares; the features
(megak3/launch/planner/activations.module_features) are the widths the saved tensors scale with. The planner's
built-in table (planner.ACT_COEF) is ``fit()``'s output; ``python tools/plan.py --calibrate``
re-derives it (e.g. after a kernel change) and tests/test_plan.py re-checks it on unseen widths.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch

BASE = {"hidden_size": 128, "dense_intermediate_size": 256, "kda.num_heads": 2, "kda.head_dim": 32,
        "kda.gate_rank": 16, "kda.chunk_size": 32, "mla.num_heads": 2, "mla.q_lora_rank": 64,
        "mla.kv_lora_rank": 32, "mla.qk_nope_head_dim": 16, "mla.qk_rope_head_dim": 8, "mla.v_head_dim": 16,
        "moe.num_experts": 8, "moe.top_k": 2, "moe.expert_intermediate_size": 32, "moe.latent_size": 64,
        "vision.enabled": False, "vocab_size": 1024, "num_layers": 9, "attn_res_block_size": 3}
"""a small k3_tiny-structured model (KDA x3 + MLA pattern, dense layer 0, MoE elsewhere)"""

VARIATIONS = [
    {}, {"hidden_size": 256}, {"hidden_size": 64},
    {"kda.num_heads": 4}, {"kda.head_dim": 64, "kda.chunk_size": 64}, {"kda.chunk_size": 16},
    {"kda.gate_rank": 64}, {"mla.num_heads": 4}, {"mla.q_lora_rank": 128, "mla.kv_lora_rank": 64},
    {"mla.qk_nope_head_dim": 32, "mla.v_head_dim": 32}, {"dense_intermediate_size": 512},
    {"moe.num_experts": 32}, {"moe.top_k": 4}, {"moe.latent_size": 128}, {"moe.expert_intermediate_size": 96},
    {"moe.num_shared_experts": 4}, {"vocab_size": 4096}, {"attn_res_block_size": 2},
]


def measure(overrides: dict, batch: int = 2, seq_len: int = 128, precision: str = "fp32",
            seed: int = 0) -> List[dict]:
    """[{kind, features, bytes_per_token}] for every top-level module of one forward."""
    from ..config import load_model_config
    from ..model.k3 import build_model
    from .planner import module_features

    cfg = load_model_config("k3_tiny", **{**BASE, **overrides})
    model = build_model(cfg, seed=seed)
    model.train()
    current: list = [None]
    sites: Dict[int, dict] = {}

    def enter(key, kind, feats):
        def hook(*_):
            current[0] = key
            sites.setdefault(key, {"kind": kind, "features": feats, "bytes": 0})
        return hook

    tokens = batch * seq_len
    ctx = dict(tokens_per_seq=seq_len, tp=1)
    for i, layer in enumerate(model.layers):
        attn_kind = layer.kind
        mlp_kind = "moe" if layer.is_moe else "dense"
        blocks_attn = (i + cfg.attn_res_block_size - 1) // cfg.attn_res_block_size  # blocks before commit
        blocks_mlp = i // cfg.attn_res_block_size + 1
        mods = [(layer.self_attn, attn_kind, module_features(cfg, attn_kind, **ctx)),
                (layer.mlp, mlp_kind, module_features(cfg, mlp_kind, **ctx)),
                (layer.input_layernorm, "norm", module_features(cfg, "norm", **ctx)),
                (layer.post_attention_layernorm, "norm", module_features(cfg, "norm", **ctx)),
                (layer.mlp_res, "attn_res", module_features(cfg, "attn_res", sources=blocks_mlp + 1, **ctx))]
        if blocks_attn:
            mods.append((layer.attn_res, "attn_res",
                         module_features(cfg, "attn_res", sources=blocks_attn + 1, **ctx)))
        for m, kind, feats in mods:
            m.register_forward_pre_hook(enter(id(m), kind, feats))
            m.register_forward_hook(lambda *_: current.__setitem__(0, None))
    n_blocks = (cfg.num_layers + cfg.attn_res_block_size - 1) // cfg.attn_res_block_size
    head_feats = module_features(cfg, "head", sources=n_blocks + 1, **ctx)
    model.output_attn_res.register_forward_pre_hook(enter("head", "head", head_feats))
    seen: set = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights are not activations

    # autocast's bf16 copies of the weights are not activations (the planner counts them apart)
    weight_shapes = {tuple(p.shape) for p in model.parameters()}

    def pack(t):
        key = current[0]
        if t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes:
            return t
        if key is not None and t.device.type == "cpu" and t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                sites[key]["bytes"] += t.untyped_storage().nbytes()
        return t

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, cfg.vocab_size, (batch, seq_len), generator=g)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        out = model(ids, labels=ids)
    del out
    return [{"kind": s["kind"], "features": s["features"], "bytes_per_token": s["bytes"] / tokens}
            for s in sites.values()]


def fit(precision: str = "fp32", variations: Optional[list] = None, seq_lens=(64, 128)) -> dict:
    """{kind: {feature: bytes per token per unit}} by least squares over ``variations``."""
    import numpy as np

    rows: Dict[str, list] = {}
    for T in seq_lens:
        for v in (variations or VARIATIONS):
            for r in measure(v, seq_len=T, precision=precision):
                rows.setdefault(r["kind"], []).append(r)
    out = {}
    for kind, rs in rows.items():
        names = sorted(rs[0]["features"])
        A = np.array([[r["features"][n] for n in names] for r in rs], dtype=np.float64)
        y = np.array([r["bytes_per_token"] for r in rs])
        # least squares with non-negative width coefficients: drop the most negative one and refit
        keep = list(range(len(names)))
        while True:
            coef, *_ = np.linalg.lstsq(A[:, keep], y, rcond=None)
            neg = [(c, j) for c, j in zip(coef, keep) if c < 0 and names[j] != "one"]
            if not neg:
                break
            keep.remove(min(neg)[1])
        full = dict.fromkeys(names, 0.0)
        full.update({names[j]: float(c) for j, c in zip(keep, coef)})
        out[kind] = {n: round(c, 3) for n, c in full.items()}
    return out
