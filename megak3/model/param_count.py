"""Parameter accounting from the real module tree, built on the meta device (no memory).

Components follow K3_SPEC.md §2. ``active`` counts what one token touches: everything except
the input embedding table, the vision tower and the non-selected routed experts (top_k of E).
The router's ``e_score_correction_bias`` buffer is counted with the router, as the released
checkpoint stores it.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..config import ModelConfig

COMPONENTS = ("attention", "routed_experts", "shared_experts", "latent_proj", "router", "dense_ffn",
              "norms_attn_res", "embedding", "lm_head", "vision")


def component_of(name: str) -> str:
    if name.startswith("vision."):
        return "vision"
    if name.startswith("embed_tokens."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.routed_expert_" in name:
        return "latent_proj"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense_ffn"
    return "norms_attn_res"


def count_parameters(cfg: ModelConfig) -> dict:
    """{'total', 'text_total', 'active', 'components': {...}, ...} for a config."""
    from .k3 import K3Model

    with torch.device("meta"):
        model = K3Model(cfg)
    comp = OrderedDict((c, 0) for c in COMPONENTS)
    tensors = list(model.named_parameters()) + [
        (n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    for name, t in tensors:
        comp[component_of(name)] += t.numel()
    moe = cfg.moe
    routed_active = comp["routed_experts"] * moe.top_k // moe.num_experts
    text_total = sum(v for k, v in comp.items() if k != "vision")
    active = text_total - comp["embedding"] - comp["routed_experts"] + routed_active
    return {
        "model": cfg.name,
        "total": text_total + comp["vision"],
        "text_total": text_total,
        "active": active,
        "active_with_embedding": active + comp["embedding"],
        "routed_experts_active": routed_active,
        "components": dict(comp),
    }
