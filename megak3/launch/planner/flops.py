"""FLOPs per token of the model and of each decoder layer.

FLOPs per token (forward; training = 3x, + 1x of the layers with activation checkpointing):
  matmul     2 x active params (param counter: everything a token touches, top_k of E experts,
             embedding excluded) -- attention projections, MoE active experts, shared experts,
             latent projections, router, dense FFN, lm_head
  mla        per MLA layer, causal scores + values: H * (qk_head + v_head) * T  (average context T/2)
  kda        per KDA layer: H * (6 K^2 + 3 C K) (state read, write and delta correction 2K^2 each;
             intra-chunk QK^T and AV over C/2 on average; the WY/UT transform C K)
  vision     per image patch: 2 x the tower's GEMM weights (merger once per merge^2 patches) + attention
             (vision_flops_per_patch)
The same split per decoder layer (layer_flops_per_token) gives each stage's compute.
"""
from __future__ import annotations

from typing import Dict

from ...config import ModelConfig
from .config import _key
from .inventory import buffer_inventory, inventory
from .vision import vision_flops_per_patch


_COUNTS: Dict[str, dict] = {}


def _counts(cfg: ModelConfig) -> dict:
    from ...model.param_count import count_parameters

    key = _key(cfg)
    if key not in _COUNTS:
        _COUNTS[key] = count_parameters(cfg)
    return _COUNTS[key]


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict:
    """Forward FLOPs per text token by part, and the training total (3x forward)."""
    pc = _counts(cfg)
    kinds = cfg.layer_kinds()
    n_mla, n_kda = kinds.count("mla"), kinds.count("kda")
    comp = pc["components"]
    moe_active = pc["routed_experts_active"] + comp["latent_proj"] + comp["router"] + comp["shared_experts"]
    out = {
        "attention_proj": 2.0 * comp["attention"],
        "moe_active": 2.0 * moe_active,
        "dense_ffn": 2.0 * comp["dense_ffn"],
        "lm_head": 2.0 * comp["lm_head"],
        "norms_attn_res": 2.0 * comp["norms_attn_res"],
        "mla_scores": n_mla * _mla_scores(cfg, seq_len),
        "kda_recurrence": n_kda * _kda_recurrence(cfg),
    }
    out["forward"] = sum(out.values())
    out["matmul_forward"] = 2.0 * pc["active"]
    out["train"] = 3.0 * out["forward"]
    v = cfg.vision
    if v.enabled:  # an image the size of the learned position grid (pos_grid^2 patches: 896 x 896 px at K3)
        out["vision_per_patch_forward"] = vision_flops_per_patch(cfg, v.pos_grid ** 2)
    out["active_params"] = pc["active"]
    out["total_params"] = pc["total"]
    return out


def _mla_scores(cfg: ModelConfig, seq_len: int) -> float:
    m = cfg.mla
    return m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * seq_len


def _kda_recurrence(cfg: ModelConfig) -> float:
    k = cfg.kda
    return k.num_heads * (6 * k.head_dim ** 2 + 3 * k.chunk_size * k.head_dim)


_LAYER_FLOPS: Dict[tuple, tuple] = {}


def layer_flops_per_token(cfg: ModelConfig, seq_len: int) -> tuple:
    """(forward FLOPs per token of each decoder layer, of the output head): 2 x the params a token
    touches (top_k of E experts, the router bias counted as count_parameters does) + the layer's
    MLA scores / KDA recurrence. Summed: flops_per_token()['forward'] (the embedding costs none)."""
    key = (_key(cfg), seq_len)
    if key not in _LAYER_FLOPS:
        e = cfg.moe
        per = [0.0] * cfg.num_layers
        head = 0.0
        for _, n, where, _, is_exp, _ in inventory(cfg):
            touched = n * e.top_k / e.num_experts if is_exp else n
            if where >= 0:
                per[where] += 2.0 * touched
            elif where == -2:
                head += 2.0 * n
        for name, n, where, _ in buffer_inventory(cfg):
            if where >= 0 and name.endswith("e_score_correction_bias"):
                per[where] += 2.0 * n
        for i, kind in enumerate(cfg.layer_kinds()):
            per[i] += _mla_scores(cfg, seq_len) if kind == "mla" else _kda_recurrence(cfg)
        _LAYER_FLOPS[key] = (tuple(per), head)
    return _LAYER_FLOPS[key]
