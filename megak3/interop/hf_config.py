"""config.json of a Kimi-K3 HF checkpoint <-> megak3's ModelConfig.

Field names follow the released config (K3_SPEC.md §1.1-1.2, NEMO ``KimiK3TextConfig`` /
``KimiK3VisionConfig``): ``text_config`` (``model_type: kimi_linear``) holds the backbone,
``linear_attn_config`` the KDA settings and the 1-based ``kda_layers`` / ``full_attn_layers``,
``vision_config`` the MoonViT tower. Settings the release has no field for (KDA gate rank, the MLA
latent-norm eps, training-only knobs such as the QB method) are written under a top-level
``"megak3"`` dict of dotted model overrides, so an export re-imports to the same ModelConfig; a
config.json without it (the release) gets megak3's defaults for them, and the KDA gate rank falls
back to the KDA head dim (Kimi Linear's convention; K3: 128 = 128).

``bos_token_id``, ``eos_token_id`` and ``tie_word_embeddings`` are written in ``text_config`` and at
the top level (where the release and ``transformers``' generation defaults read them); an import reads
``text_config`` first, then the top level. ``vision_config`` carries the keys the release's modeling
code reads besides the tower's sizes (``mm_projector_type``, ``mm_hidden_size``,
``projector_hidden_act``, ``projector_ln_eps``, ``merge_type``, ``pos_emb_type``,
``init_pos_emb_time``); a ``vision_config`` lacking one of :data:`VISION_NEEDED` is a one-line
ValueError.

``quantization_config`` (compressed-tensors ``mxfp4-pack-quantized``, 4-bit float weights, groups
of 32 along the input dim, weights only; ``targets: ["Linear"]`` with the ignore list
:data:`QUANT_IGNORE`, as the release) is written only when the routed experts are packed, in
``text_config`` (where K3_SPEC §1.1 lists it and NEMO reads it) and mirrored at the top level
(where ``transformers`` looks).
"""
from __future__ import annotations

from typing import List, Optional

from megak3.config import ModelConfig, model_config_from_dict

ARCH_FIELDS = (
    "vocab_size", "hidden_size", "num_layers", "first_k_dense", "dense_intermediate_size",
    "kda.num_heads", "kda.head_dim", "kda.conv_kernel", "kda.gate_rank",
    "mla.num_heads", "mla.q_lora_rank", "mla.kv_lora_rank", "mla.qk_nope_head_dim", "mla.qk_rope_head_dim",
    "mla.v_head_dim", "moe.num_experts", "moe.num_shared_experts", "moe.expert_intermediate_size",
    "moe.latent_size", "moe.use_latent_norm", "vision.enabled",
)
"""fields that decide tensor names or shapes: an import refuses a config.json that differs in one"""

VISION_ARCH_FIELDS = ("vision.num_layers", "vision.hidden_size", "vision.num_heads", "vision.head_dim",
                      "vision.intermediate_size", "vision.patch_size", "vision.pos_grid", "vision.merge",
                      "vision.projector_hidden", "vision.in_channels")

MATH_FIELDS = ("attn_res_block_size", "rms_norm_eps", "situ_beta1", "situ_beta2", "kda.gate_lower_bound",
               "moe.top_k", "moe.routed_scaling_factor", "mla.latent_norm_eps")
"""fields that change the computation but not the tensors: an import reports a difference"""

_EXTRA_FIELDS = ("name", "init_std", "kda.gate_rank", "kda.chunk_size", "kda.use_fla", "mla.latent_norm_eps",
                 "moe.balancing", "moe.qb_method", "moe.qb_bins", "vision.projector_hidden", "vision.in_channels")
"""megak3 settings with no field in the release's config.json (written under "megak3")"""


VISION_POS_EMB_TIME = 4
"""``init_pos_emb_time`` of the release (frames of the sin-cos temporal embedding)"""

VISION_NEEDED = ("vt_num_hidden_layers", "vt_hidden_size", "vt_intermediate_size")
"""vision_config keys with no default: a vision_config without one is refused"""


def _first(ids):
    """``eos_token_id`` may be a list in HF configs: megak3 keeps the first."""
    return ids[0] if isinstance(ids, list) and ids else ids


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


QUANT_IGNORE = [
    "lm_head", r"re:.*lm_head$", r"re:.*self_attn\..*", r"re:.*mlp\.(gate|up|down)_proj$",
    r"re:.*block_sparse_moe\.gate$", r"re:.*shared_experts\..*", r"re:.*routed_expert_(down|up)_proj$",
    r"re:.*_res_proj$", r"re:^vision_tower\..*", r"re:^mm_projector\..*",
]
"""Linear modules the release leaves unquantised (K3_SPEC §10.1: attention, the dense FFN, router,
shared experts, the latent down/up projections, AttnRes, lm_head, the vision tower and projector),
in compressed-tensors' matching: an exact module name, or ``re:`` + a pattern ``re.match``-ed
against the module name. With ``targets: ["Linear"]`` what is left is exactly the routed experts'
``w1/w2/w3``."""


def quantization_config() -> dict:
    """compressed-tensors block for MXFP4 routed experts (weights only; activations at runtime), as
    the release writes it: every ``Linear`` is targeted and the ignore list leaves the routed
    experts."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group",
                        "group_size": 32, "dynamic": False, "scale_dtype": "torch.uint8"},
            "input_activations": None, "output_activations": None, "format": "mxfp4-pack-quantized"}},
        "ignore": list(QUANT_IGNORE),
        "kv_cache_scheme": None,
    }


def to_hf_config(cfg: ModelConfig, experts_packed: bool, dtype: str = "bfloat16") -> dict:
    """The config.json of an export of a ``cfg`` model."""
    k, m, e = cfg.kda, cfg.mla, cfg.moe
    mla_1b = [i + 1 for i in cfg.mla_layers()]
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiK3ForCausalLM"],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.dense_intermediate_size, "first_k_dense_replace": cfg.first_k_dense,
        "hidden_act": "situ", "activation_situ_beta": cfg.situ_beta1, "activation_situ_linear_beta": cfg.situ_beta2,
        "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
        "attn_res_block_size": cfg.attn_res_block_size,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads, "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
        "mla_use_nope": True, "mla_use_output_gate": True,
        "linear_attn_config": {
            "num_heads": k.num_heads, "head_dim": k.head_dim, "short_conv_kernel_size": k.conv_kernel,
            "kda_layers": [i for i in range(1, cfg.num_layers + 1) if i not in set(mla_1b)],
            "full_attn_layers": mla_1b, "use_full_rank_gate": True, "gate_lower_bound": k.gate_lower_bound},
        "num_experts": e.num_experts, "num_experts_per_token": e.top_k, "num_shared_experts": e.num_shared_experts,
        "moe_intermediate_size": e.expert_intermediate_size, "routed_expert_hidden_size": e.latent_size,
        "latent_moe_use_norm": e.use_latent_norm, "routed_scaling_factor": e.routed_scaling_factor,
        "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0, "torch_dtype": dtype,
    }
    out = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
           "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
           "tie_word_embeddings": cfg.tie_word_embeddings,
           "media_placeholder_token_id": cfg.media_placeholder_token_id, "pad_token_id": cfg.pad_token_id,
           "ignore_index": -100, "torch_dtype": dtype}
    if cfg.vision.enabled:
        v = cfg.vision
        out["vision_config"] = {
            "model_type": "kimi_k3_vision", "patch_size": v.patch_size, "init_pos_emb_height": v.pos_grid,
            "init_pos_emb_width": v.pos_grid, "vt_num_hidden_layers": v.num_layers, "vt_hidden_size": v.hidden_size,
            "vt_num_attention_heads": v.num_heads, "qkv_hidden_size": v.num_heads * v.head_dim,
            "vt_intermediate_size": v.intermediate_size, "merge_kernel_size": [v.merge, v.merge],
            "norm_type": "rmsnorm", "attn_bias": False, "linear_bias": False, "patch_embed_proj_bias": False,
            "mlp_type": "mlp2", "activation_func": "gelu_pytorch_tanh", "text_hidden_size": cfg.hidden_size,
            "media_placeholder_token_id": cfg.media_placeholder_token_id,
            # keys the release's modeling code reads (K3_SPEC §1.2); megak3's projector is an exact-GELU MLP
            # over the m x m merge of D-wide patches, its norm's eps the text rms_norm_eps; images are one
            # frame, where sd2_tpool's temporal pooling and the sin-cos time embedding are identities
            "mm_projector_type": "patchmergerv2", "mm_hidden_size": v.hidden_size, "projector_hidden_act": "gelu",
            "projector_ln_eps": cfg.rms_norm_eps, "merge_type": "sd2_tpool", "pos_emb_type": "divided_fixed",
            "init_pos_emb_time": VISION_POS_EMB_TIME}
    if experts_packed:
        text["quantization_config"] = out["quantization_config"] = quantization_config()
    out["megak3"] = {f: _get(cfg, f) for f in _EXTRA_FIELDS}
    return out


def from_hf_config(d: dict, name: Optional[str] = None) -> ModelConfig:
    """A validated ModelConfig from a config.json dict (an export of megak3 or the release).
    Raises ValueError naming the missing or unsupported field."""
    t = d.get("text_config", d)
    extra = dict(d.get("megak3") or {})

    def need(key, src=None):
        src = t if src is None else src
        if key not in src:
            raise ValueError(f"config.json: text_config has no {key!r}; not a Kimi-K3 config")
        return src[key]

    la = need("linear_attn_config")
    for flag, want in (("mla_use_nope", True), ("mla_use_output_gate", True)):
        if t.get(flag, want) != want:
            raise ValueError(f"config.json: text_config.{flag}={t[flag]} is not supported (megak3 builds K3's "
                             f"{flag}={want})")
    if la.get("use_full_rank_gate", True) is not True:
        raise ValueError("config.json: linear_attn_config.use_full_rank_gate=false is not supported")
    model = {
        "name": name or extra.get("name", "hf"), "vocab_size": need("vocab_size"), "hidden_size": need("hidden_size"),
        "num_layers": need("num_hidden_layers"), "full_attn_layers": list(need("full_attn_layers", la)),
        "first_k_dense": t.get("first_k_dense_replace", 1), "dense_intermediate_size": need("intermediate_size"),
        "attn_res_block_size": need("attn_res_block_size"), "max_seq_len": t.get("max_position_embeddings", 1048576),
        "rms_norm_eps": t.get("rms_norm_eps", 1e-5), "situ_beta1": t.get("activation_situ_beta", 4.0),
        "situ_beta2": t.get("activation_situ_linear_beta", 25.0), "init_std": t.get("initializer_range", 0.02),
        "tie_word_embeddings": t.get("tie_word_embeddings", d.get("tie_word_embeddings", False)),
        "bos_token_id": t.get("bos_token_id", d.get("bos_token_id", 163584)),
        "eos_token_id": _first(t.get("eos_token_id", d.get("eos_token_id", 163586))),
        "pad_token_id": t.get("pad_token_id", d.get("pad_token_id", 163839)),
        "media_placeholder_token_id": d.get("media_placeholder_token_id", 163605),
        "kda": {"num_heads": need("num_heads", la), "head_dim": need("head_dim", la),
                "conv_kernel": la.get("short_conv_kernel_size", 4), "gate_rank": need("head_dim", la),
                "gate_lower_bound": la.get("gate_lower_bound", -5.0)},
        "mla": {"num_heads": need("num_attention_heads"), "q_lora_rank": need("q_lora_rank"),
                "kv_lora_rank": need("kv_lora_rank"), "qk_nope_head_dim": need("qk_nope_head_dim"),
                "qk_rope_head_dim": need("qk_rope_head_dim"), "v_head_dim": need("v_head_dim")},
        "moe": {"num_experts": need("num_experts"), "top_k": need("num_experts_per_token"),
                "num_shared_experts": t.get("num_shared_experts", 0),
                "expert_intermediate_size": need("moe_intermediate_size"),
                "latent_size": need("routed_expert_hidden_size"), "use_latent_norm": t.get("latent_moe_use_norm", True),
                "routed_scaling_factor": t.get("routed_scaling_factor", 1.0)},
    }
    v = d.get("vision_config")
    if v:
        for key in VISION_NEEDED:
            if key not in v:
                raise ValueError(f"config.json: vision_config has no {key!r}; a Kimi-K3 vision_config needs "
                                 f"{', '.join(VISION_NEEDED)} (or drop vision_config for a text-only model)")
        heads = v.get("vt_num_attention_heads", 12)
        m = v.get("merge_kernel_size", [2, 2])
        if len(set(m)) != 1:
            raise ValueError(f"config.json: vision_config.merge_kernel_size={m} is not square; megak3 merges m x m")
        model["vision"] = {"enabled": True, "num_layers": v["vt_num_hidden_layers"], "hidden_size": v["vt_hidden_size"],
                           "num_heads": heads, "head_dim": v.get("qkv_hidden_size", v["vt_hidden_size"]) // heads,
                           "intermediate_size": v["vt_intermediate_size"], "patch_size": v.get("patch_size", 14),
                           "pos_grid": v.get("init_pos_emb_height", 64), "merge": m[0],
                           "projector_hidden": m[0] * m[0] * v["vt_hidden_size"]}
    else:
        model["vision"] = {"enabled": False}
    n, full = model["num_layers"], sorted(model["full_attn_layers"])
    if full == sorted(set(range(4, 4 * (n // 4) + 1, 4)) | {n}):
        model["full_attn_layers"] = None  # megak3's default rule (K3_SPEC §15) gives exactly these
    for dotted, val in extra.items():  # megak3's own settings of an export
        *path, last = dotted.split(".")
        node = model
        for p in path:
            node = node.setdefault(p, {})
        node[last] = val
    return model_config_from_dict(model)


def compare_configs(hf: ModelConfig, cfg: ModelConfig) -> List[str]:
    """Raise ValueError for the first architecture field that differs (tensors would not fit);
    return one note per differing computation field (the import goes on with ``cfg``'s value)."""
    fields = ARCH_FIELDS + (VISION_ARCH_FIELDS if hf.vision.enabled and cfg.vision.enabled else ())
    if hf.mla_layers() != cfg.mla_layers():
        raise ValueError(f"HF config.json has Gated-MLA layers {[i + 1 for i in hf.mla_layers()]} (1-based) but "
                         f"model.full_attn_layers gives {[i + 1 for i in cfg.mla_layers()]}")
    for f in fields:
        a, b = _get(hf, f), _get(cfg, f)
        if a != b and not (f == "vision.enabled" and not b):
            raise ValueError(f"HF config.json says {f}={a} but model.{f}={b}; choose the model config of the "
                             f"checkpoint (or override model.{f}={a})")
    return [f"model.{f}={_get(cfg, f)} differs from the HF config.json's {_get(hf, f)}; training uses "
            f"model.{f}={_get(cfg, f)}" for f in MATH_FIELDS if _get(hf, f) != _get(cfg, f)]
