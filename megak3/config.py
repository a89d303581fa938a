"""Model configuration schema: nested dataclasses, one per component (K3_SPEC.md §1, §15).

The dataclasses are the schema; the values of named presets live in ``conf/model/<name>.yaml``
(Hydra YAML) and are merged onto this schema by :func:`load_model_config`. ``validate()`` raises
``ValueError`` naming the field and the fix, before any module is built.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

NORM_IMPLS = ("auto", "torch", "apex")
"""values of ``model.norm_impl`` / ``RMSNorm.impl`` (megak3/model/norm.py)"""


def norm_impl_value_error(impl: str) -> Optional[str]:
    """The one-line error of a ``model.norm_impl`` value that is not one of NORM_IMPLS, else None
    (the value only; whether apex is built is megak3.model.norm.norm_impl_error)."""
    if impl not in NORM_IMPLS:
        return f"model.norm_impl={impl!r}: choose 'auto', 'torch' or 'apex'"
    return None


@dataclass
class KDAConfig:
    """Kimi Delta Attention (K3_SPEC.md §4)."""

    num_heads: int = 96
    """number of KDA heads H (q, k, v and gates are split per head)"""
    head_dim: int = 128
    """dk = dv per head"""
    conv_kernel: int = 4
    """causal depthwise short-convolution width on q, k, v"""
    gate_rank: int = 128
    """rank of the low-rank decay-gate projection f_a: d -> rank -> H*dk"""
    gate_lower_bound: float = -5.0
    """g_min in g = g_min * sigmoid(exp(A_log) * (z + dt_bias)); log-decay per token lies in (g_min, 0).
    Finite and negative; fla's safe_gate tiles are used only for g_min >= -5"""
    chunk_size: int = 64
    """chunk length of the chunkwise-parallel (WY/UT) KDA algorithm"""
    use_fla: bool = True
    """use fla's Triton kernels when CUDA and fla are importable; the pure-torch path otherwise"""


@dataclass
class MLAConfig:
    """Gated Multi-head Latent Attention with NoPE (K3_SPEC.md §5)."""

    num_heads: int = 96
    """number of attention heads"""
    q_lora_rank: int = 1536
    """width of the compressed query latent (q_a_proj output)"""
    kv_lora_rank: int = 512
    """width of the compressed key/value latent (kv_a_proj output, before k_pe)"""
    qk_nope_head_dim: int = 128
    """per-head query/key width taken from the latent"""
    qk_rope_head_dim: int = 64
    """per-head width of the (un-rotated, NoPE) shared positional slot"""
    v_head_dim: int = 128
    """per-head value width"""
    latent_norm_eps: float = 1e-6
    """eps of q_a_layernorm / kv_a_layernorm (NEMO uses the class default 1e-6)"""


@dataclass
class MoEConfig:
    """Stable LatentMoE (K3_SPEC.md §7)."""

    num_experts: int = 896
    """routed experts E"""
    top_k: int = 16
    """experts selected per token"""
    num_shared_experts: int = 2
    """shared experts, fused into one SiTU-GLU of width num_shared_experts * expert_intermediate_size"""
    expert_intermediate_size: int = 3072
    """routed expert FFN width m"""
    latent_size: int = 3584
    """latent width l = d/2 in which routed experts run"""
    use_latent_norm: bool = True
    """RMSNorm(latent) between routed aggregation and the up-projection (K3 'Stable' LatentMoE)"""
    routed_scaling_factor: float = 1.0
    """multiplier on the renormalised router weights"""
    balancing: str = "quantile"
    """router-bias balancing: 'quantile' (Quantile Balancing, Eq.14) or 'none' (bias stays 0)"""
    qb_method: str = "auto"
    """how QB finds per-expert quantiles: 'exact' (top-k over all margins, all-gathered across ranks),
    'histogram' ([E, qb_bins] counts, all-reduced; within a bin width of exact) or 'auto' (exact while one
    layer's gathered margins, global_batch_size x seq_len x num_experts x 4 B, stay <= 64 MiB; else histogram)"""
    qb_bins: int = 4096
    """histogram bins for qb_method='histogram' (or 'auto' when it picks the histogram)"""


@dataclass
class VisionConfig:
    """MoonViT-style native image encoder (K3_SPEC.md §1.2, §8), scaled by the preset."""

    enabled: bool = True
    """build the vision tower; images are spliced at media_placeholder_token_id"""
    num_layers: int = 27
    """encoder transformer blocks"""
    hidden_size: int = 1024
    """encoder width"""
    num_heads: int = 12
    """encoder attention heads"""
    head_dim: int = 128
    """per-head width (qkv width = num_heads * head_dim)"""
    intermediate_size: int = 4096
    """encoder MLP width (GELU-tanh)"""
    patch_size: int = 14
    """square patch side in pixels"""
    pos_grid: int = 64
    """side of the learned 2-D position-embedding grid (bilinearly interpolated to the image grid)"""
    merge: int = 2
    """spatial merge factor (merge x merge patches -> one LM token)"""
    projector_hidden: int = 4096
    """hidden width of the merger/projector MLP"""
    in_channels: int = 3
    """image channels"""


@dataclass
class ModelConfig:
    """A Kimi-K3-architecture decoder (K3_SPEC.md §1.1, §3)."""

    name: str = "k3_full"
    """preset name"""
    vocab_size: int = 163840
    """embedding / lm_head rows"""
    hidden_size: int = 7168
    """model width d"""
    num_layers: int = 93
    """decoder layers L"""
    full_attn_layers: Optional[List[int]] = None
    """1-based Gated-MLA layers; None -> {4, 8, ..., 4*floor(L/4)} U {L}"""
    first_k_dense: int = 1
    """the first k layers use a dense SiTU-GLU FFN, the rest Stable LatentMoE"""
    dense_intermediate_size: int = 33792
    """width of the dense FFN"""
    attn_res_block_size: int = 12
    """decoder layers per Block-AttnRes block (boundaries at layer_idx % size == 0)"""
    max_seq_len: int = 1048576
    """longest sequence the model accepts"""
    rms_norm_eps: float = 1e-5
    """eps of every RMSNorm except the MLA latent norms"""
    situ_beta1: float = 4.0
    """SiTU gate bound beta1"""
    situ_beta2: float = 25.0
    """SiTU-GLU linear-branch cap beta2"""
    init_std: float = 0.02
    """std of the normal init of linear and embedding weights"""
    norm_impl: str = "auto"
    """learnable-weight RMSNorms: 'auto' (NVIDIA apex's fused kernel for CUDA inputs when apex is built with
    its CUDA extensions, else torch), 'torch' (always the torch form) or 'apex' (like auto, but an error
    when apex is not built); megak3/model/norm.py"""
    tie_word_embeddings: bool = False
    """K3 unties embedding and lm_head"""
    bos_token_id: int = 163584
    """beginning-of-sequence token"""
    eos_token_id: int = 163586
    """end-of-sequence token"""
    pad_token_id: int = 163839
    """padding token"""
    media_placeholder_token_id: int = 163605
    """token whose positions receive vision-encoder outputs"""
    kda: KDAConfig = field(default_factory=KDAConfig)
    """KDA settings"""
    mla: MLAConfig = field(default_factory=MLAConfig)
    """Gated-MLA settings"""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Stable LatentMoE settings"""
    vision: VisionConfig = field(default_factory=VisionConfig)
    """vision encoder settings"""

    # ---- derived layout -------------------------------------------------------------------
    def mla_layers(self) -> List[int]:
        """0-based indices of Gated-MLA layers."""
        if self.full_attn_layers is not None:
            one_based = sorted(set(self.full_attn_layers))
        else:
            one_based = sorted(set(range(4, 4 * (self.num_layers // 4) + 1, 4)) | {self.num_layers})
        return [i - 1 for i in one_based]

    def layer_kinds(self) -> List[str]:
        """'kda' or 'mla' for each 0-based layer."""
        mla = set(self.mla_layers())
        return ["mla" if i in mla else "kda" for i in range(self.num_layers)]

    def is_moe_layer(self, idx: int) -> bool:
        return idx >= self.first_k_dense

    def validate(self) -> "ModelConfig":
        """Raise ValueError naming the offending field and the fix."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"invalid model config '{self.name}': {msg}")

        for f in ("vocab_size", "hidden_size", "num_layers", "dense_intermediate_size",
                  "attn_res_block_size", "max_seq_len"):
            need(getattr(self, f) > 0, f"model.{f}={getattr(self, f)} must be positive")
        need(0 <= self.first_k_dense <= self.num_layers,
             f"model.first_k_dense={self.first_k_dense} must lie in [0, model.num_layers={self.num_layers}]")
        if self.full_attn_layers is not None:
            bad = [i for i in self.full_attn_layers if not 1 <= i <= self.num_layers]
            need(not bad, f"model.full_attn_layers has {bad} outside 1..{self.num_layers} (1-based)")
        k, m, v = self.kda, self.mla, self.moe
        for name, val in (("kda.num_heads", k.num_heads), ("kda.head_dim", k.head_dim),
                          ("kda.conv_kernel", k.conv_kernel), ("kda.gate_rank", k.gate_rank),
                          ("kda.chunk_size", k.chunk_size), ("mla.num_heads", m.num_heads),
                          ("mla.q_lora_rank", m.q_lora_rank), ("mla.kv_lora_rank", m.kv_lora_rank),
                          ("mla.qk_nope_head_dim", m.qk_nope_head_dim), ("mla.v_head_dim", m.v_head_dim),
                          ("moe.num_experts", v.num_experts), ("moe.top_k", v.top_k),
                          ("moe.expert_intermediate_size", v.expert_intermediate_size),
                          ("moe.latent_size", v.latent_size)):
            need(val > 0, f"model.{name}={val} must be positive")
        need(m.qk_rope_head_dim >= 0, f"model.mla.qk_rope_head_dim={m.qk_rope_head_dim} must be >= 0")
        # any finite negative bound is exact on both KDA paths: fla's safe_gate tiles serve [-5, 0)
        # only, below that fla runs its general path (megak3.ops.kda.fla_safe_gate)
        need(math.isfinite(k.gate_lower_bound) and k.gate_lower_bound < 0,
             f"model.kda.gate_lower_bound={k.gate_lower_bound} must be negative and finite (K3 uses -5.0)")
        need(v.top_k <= v.num_experts,
             f"model.moe.top_k={v.top_k} must not exceed model.moe.num_experts={v.num_experts}")
        need(v.top_k < v.num_experts or v.balancing == "none",
             f"model.moe.top_k={v.top_k} equals num_experts: Quantile Balancing needs top_k < num_experts "
             "(set model.moe.balancing=none)")
        need(v.num_shared_experts >= 0, f"model.moe.num_shared_experts={v.num_shared_experts} must be >= 0")
        need(v.balancing in ("quantile", "none"),
             f"model.moe.balancing={v.balancing!r}: choose 'quantile' or 'none'")
        need(v.qb_method in ("auto", "exact", "histogram"),
             f"model.moe.qb_method={v.qb_method!r}: choose 'auto', 'exact' or 'histogram'")
        need(self.situ_beta1 > 0 and self.situ_beta2 > 0, "model.situ_beta1/situ_beta2 must be positive")
        for name, val in (("rms_norm_eps", self.rms_norm_eps), ("mla.latent_norm_eps", m.latent_norm_eps)):
            need(0 < val < 1, f"model.{name}={val} must lie in (0, 1) (typical: 1e-5)")
        need(0 < self.init_std < 1, f"model.init_std={self.init_std} must lie in (0, 1) (K3 uses 0.02)")
        err = norm_impl_value_error(self.norm_impl)  # apex's presence: megak3.job.compose.check_local
        need(err is None, err)
        need(0 < v.routed_scaling_factor < float("inf"),
             f"model.moe.routed_scaling_factor={v.routed_scaling_factor} must be a positive number")
        need(v.qb_bins >= 2, f"model.moe.qb_bins={v.qb_bins} must be >= 2")
        ids = dict(bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
                   pad_token_id=self.pad_token_id, media_placeholder_token_id=self.media_placeholder_token_id)
        for f, val in ids.items():
            need(0 <= val < self.vocab_size, f"model.{f}={val} must lie in [0, model.vocab_size={self.vocab_size})")
        if self.vision.enabled:
            vi = self.vision
            for name in ("num_layers", "hidden_size", "num_heads", "head_dim", "intermediate_size",
                         "patch_size", "pos_grid", "merge", "projector_hidden", "in_channels"):
                need(getattr(vi, name) > 0, f"model.vision.{name}={getattr(vi, name)} must be positive")
        return self


def _structured():
    from omegaconf import OmegaConf

    return OmegaConf.structured(ModelConfig)


def model_config_from_dict(d) -> ModelConfig:
    """Build a validated ModelConfig from a dict / DictConfig; unknown keys raise with the key name."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, ValidationError

    try:
        merged = OmegaConf.merge(_structured(), d)
    except (ConfigKeyError, ValidationError) as e:  # unknown field or wrong type
        raise ValueError(f"invalid model config: {e.msg if hasattr(e, 'msg') else e}") from None
    cfg = OmegaConf.to_object(merged)
    return cfg.validate()


def available_models() -> List[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def load_model_config(name: str, **overrides) -> ModelConfig:
    """Load ``conf/model/<name>.yaml`` onto the schema, apply dotted ``overrides`` (``kda.num_heads=8``)."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"unknown model '{name}': choose one of {available_models()} (conf/model/*.yaml)")
    base = OmegaConf.load(path)
    if overrides:
        base = OmegaConf.merge(base, OmegaConf.from_dotlist([f"{k}={v}" for k, v in overrides.items()]))
    return model_config_from_dict(base)


def replace(cfg, **kw):
    """dataclasses.replace that re-validates ModelConfig."""
    out = dataclasses.replace(cfg, **kw)
    return out.validate() if isinstance(out, ModelConfig) else out
