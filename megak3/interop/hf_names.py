"""The state-dict adapter between megak3's canonical names and the released Kimi-K3 HF names.

Every renaming, padding and expert split between the two lives here, as tables (one per layer
kind) and two functions that read them: :func:`to_hf_name` (canonical -> HF) and
:func:`from_hf_name` (HF -> canonical, legacy spellings accepted). :func:`hf_tensors` lists what
an export writes (name, on-disk shape and dtype, how it is derived) from a ModelConfig alone, on
the meta device; the exporter (tools/convert_hf.py), the importer (hf_load.py) and the inventory
all walk that list.

Layout of the release (K3_SPEC.md §1-2, §10.1; the public weight-class list of the 96-shard
checkpoint; NEMO's ``KimiK3StateDictAdapter``)::

    language_model.model.embed_tokens.weight          language_model.lm_head.weight
    language_model.model.norm.weight                  language_model.model.output_attn_res_{norm,proj}.weight
    language_model.model.layers.{i}.
        input_layernorm / post_attention_layernorm / self_attention_res_{norm,proj} / mlp_res_{norm,proj}
        self_attn.*             KDA or MLA by the layer's kind (config full_attn_layers)
        mlp.{gate,up,down}_proj                       dense layers (i < first_k_dense_replace)
        block_sparse_moe.gate.weight, .gate.e_score_correction_bias, routed_expert_{down_proj,norm,up_proj},
        shared_experts.{gate,up,down}_proj, experts.{e}.{w1,w2,w3}.weight_packed/.weight_scale
    vision_tower.patch_embed.{proj,pos_emb}, vision_tower.encoder.blocks.{j}.*, .final_layernorm, mm_projector.*

megak3 keeps routed experts stacked (``layers.{i}.mlp.experts.w1`` [E, m, L], w3 alike, w2 [E, L, m],
rows = outputs like nn.Linear); the release stores one tensor per expert (w1 = gate, w3 = up,
w2 = down). ``g_proj`` exists in both attention kinds and means different tensors (KDA: the
full-rank output gate d -> H*dk; MLA: the output gate d -> H*v); the layer's kind picks the table,
so the name never has to be interpreted on its own.

Padding (a table keyed by tensor kind, sizes from the config: :func:`padded_sizes`): KDA ``A_log``
[H] is stored as [ceil(H/128)*128] with the live heads first and zeros after (K3: 96 -> 128, FERROX
shard headers, NEMO ``_pad_checkpoint_a_log``). Export pads with zeros; import checks the padding
is zero and refuses it otherwise.

On-disk dtypes: bf16 by default (``dtype``; fp32 on request, which makes an export -> import round
trip bit-exact); A_log, dt_bias, the q/k/v short-conv weights and the router's
e_score_correction_bias and the KDA ``o_norm.weight`` are always fp32 (K3_SPEC §1.1 "kept fp32", §7.3;
the release's shard headers); routed experts MXFP4
(``experts="mxfp4"``) or ``dtype`` (``experts="bf16"``, names ``experts.{e}.w1.weight``).

Where this differs from the issue's description or from the release (K3_SPEC wins where they
disagree):

* The router bias is ``block_sparse_moe.gate.e_score_correction_bias`` (the issue and the release
  agree; an MLX-style ``block_sparse_moe.e_score_correction_bias`` is accepted on import).
* AttnRes: ``self_attention_res_{norm,proj}``, ``mlp_res_{norm,proj}``, ``output_attn_res_{norm,proj}``
  with a ``.weight`` suffix; the module-dotted (``self_attention_res.norm.weight``) and MLX
  (``self_attention_res.norm_weight``) spellings are the legacy forms accepted on import (LEGACY).
* A_log: the issue says "128 entries of which the first 96 are live"; K3_SPEC §2.1 (FERROX) says
  the same. The pad target generalises to ceil(H/128)*128 so scaled-down configs pad too.
* Vision: megak3's tower is a scaled MoonViT-style encoder (megak3/model/vision.py) whose
  projector normalises its INPUT (RMSNorm over m*m*D, then fc1 -> GELU -> fc2). The release's
  ``patchmergerv2`` has ``mm_projector.proj.{0,2}`` and a ``post_norm`` on the output side
  (K3_SPEC §17: projector internals unverified), so megak3's norm is written as
  ``mm_projector.pre_norm.weight`` rather than pretending to be ``post_norm``; the key count is the
  same (3 projector tensors). ``vision_tower.patch_embed.proj.weight`` is stored as the Conv2d
  weight [D, C, p, p] (megak3's patch_embed is the same GEMM, [D, C*p*p]). A real K3 vision tower
  therefore does not import into megak3's; importing a release into a text-only model
  (``model.vision.enabled=false``) skips ``vision_tower.*`` / ``mm_projector.*``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from megak3.config import ModelConfig

TEXT = "language_model.model"
EXPERTS_FORMATS = ("mxfp4", "bf16")
MXFP4_BLOCK = 32

# ---- the tables: canonical name (local part) -> HF name (local part) -----------------------------
GLOBAL = {
    "embed_tokens.weight": f"{TEXT}.embed_tokens.weight",
    "norm.weight": f"{TEXT}.norm.weight",
    "output_attn_res.norm.weight": f"{TEXT}.output_attn_res_norm.weight",
    "output_attn_res.proj.weight": f"{TEXT}.output_attn_res_proj.weight",
    "lm_head.weight": "language_model.lm_head.weight",
}
"""model-level tensors (full names on both sides)"""

LAYER_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "attn_res.norm.weight": "self_attention_res_norm.weight",
    "attn_res.proj.weight": "self_attention_res_proj.weight",
    "mlp_res.norm.weight": "mlp_res_norm.weight",
    "mlp_res.proj.weight": "mlp_res_proj.weight",
}
"""every decoder layer (under ``layers.{i}.`` / ``language_model.model.layers.{i}.``)"""

KDA_ATTN = {f"self_attn.{n}": f"self_attn.{n}" for n in (
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
    "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_proj.weight", "A_log", "dt_bias",
    "o_norm.weight", "o_proj.weight")}
"""KDA layers; g_proj = the full-rank output gate d -> H*dk"""

MLA_ATTN = {f"self_attn.{n}": f"self_attn.{n}" for n in (
    "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
    "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "g_proj.weight")}
"""Gated-MLA layers; g_proj = the sigmoid output gate d -> H*v"""

DENSE_MLP = {f"mlp.{n}.weight": f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
"""dense SiTU-GLU layers (i < first_k_dense)"""

MOE_MLP = {
    "mlp.gate.weight": "block_sparse_moe.gate.weight",
    "mlp.gate.e_score_correction_bias": "block_sparse_moe.gate.e_score_correction_bias",
    "mlp.routed_expert_down_proj.weight": "block_sparse_moe.routed_expert_down_proj.weight",
    "mlp.routed_expert_norm.weight": "block_sparse_moe.routed_expert_norm.weight",
    "mlp.routed_expert_up_proj.weight": "block_sparse_moe.routed_expert_up_proj.weight",
    "mlp.shared_experts.gate_proj.weight": "block_sparse_moe.shared_experts.gate_proj.weight",
    "mlp.shared_experts.up_proj.weight": "block_sparse_moe.shared_experts.up_proj.weight",
    "mlp.shared_experts.down_proj.weight": "block_sparse_moe.shared_experts.down_proj.weight",
}
"""Stable-LatentMoE layers, everything but the routed experts"""

MOE_EXPERTS = {
    "mlp.experts.w1": "block_sparse_moe.experts.{e}.w1",   # gate [m, L]
    "mlp.experts.w3": "block_sparse_moe.experts.{e}.w3",   # up   [m, L]
    "mlp.experts.w2": "block_sparse_moe.experts.{e}.w2",   # down [L, m]
}
"""stacked [E, out, in] -> one HF base name per expert (+ .weight or .weight_packed/.weight_scale)"""

VISION = {
    "vision.patch_embed.weight": "vision_tower.patch_embed.proj.weight",
    "vision.pos_embed": "vision_tower.patch_embed.pos_emb.weight",
    "vision.final_norm.weight": "vision_tower.encoder.final_layernorm.weight",
    "vision.merger.norm.weight": "mm_projector.pre_norm.weight",
    "vision.merger.fc1.weight": "mm_projector.proj.0.weight",
    "vision.merger.fc2.weight": "mm_projector.proj.2.weight",
}
"""vision tower and projector, model-level"""

VISION_BLOCK = {
    "norm1.weight": "norm0.weight",
    "attn.qkv.weight": "wqkv.weight",
    "attn.proj.weight": "wo.weight",
    "norm2.weight": "norm1.weight",
    "mlp.fc1.weight": "mlp.fc0.weight",
    "mlp.fc2.weight": "mlp.fc1.weight",
}
"""per vision block (``vision.blocks.{j}.`` / ``vision_tower.encoder.blocks.{j}.``)"""

LEGACY = {
    **{f"{a}.{p}.weight": f"{a}_{p}.weight" for a in ("self_attention_res", "mlp_res") for p in ("norm", "proj")},
    **{f"{a}.{p}_weight": f"{a}_{p}.weight" for a in ("self_attention_res", "mlp_res") for p in ("norm", "proj")},
    "block_sparse_moe.e_score_correction_bias": "block_sparse_moe.gate.e_score_correction_bias",
}
"""older HF spellings of layer-local names, accepted on import (module-dotted and MLX-style AttnRes)"""

LEGACY_GLOBAL = {
    **{f"{TEXT}.output_attn_res.{p}.weight": f"{TEXT}.output_attn_res_{p}.weight" for p in ("norm", "proj")},
    **{f"{TEXT}.output_attn_res.{p}_weight": f"{TEXT}.output_attn_res_{p}.weight" for p in ("norm", "proj")},
}

FP32_ON_DISK = ("self_attn.A_log", "self_attn.dt_bias", "self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight",
                "self_attn.v_conv1d.weight", "self_attn.o_norm.weight", "mlp.gate.e_score_correction_bias")
"""layer-local tensors always stored fp32 (K3_SPEC §1.1 dtype row, §7.3; the KDA output norm
``o_norm.weight`` [dv] as the release's shard headers store it: F32 [128])"""

PADDED = {"self_attn.A_log": "kda.A_log"}
"""layer-local tensor -> padding kind (sizes: :func:`padded_sizes`)"""

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_VBLOCK_RE = re.compile(r"^vision\.blocks\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(rf"^{re.escape(TEXT)}\.layers\.(\d+)\.(.+)$")
_HF_VBLOCK_RE = re.compile(r"^vision_tower\.encoder\.blocks\.(\d+)\.(.+)$")
_HF_EXPERT_RE = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")


def _inverse(table: dict) -> dict:
    return {v: k for k, v in table.items()}


_INV = {id(t): _inverse(t) for t in (GLOBAL, LAYER_NORMS, KDA_ATTN, MLA_ATTN, DENSE_MLP, MOE_MLP, VISION, VISION_BLOCK)}
_INV_EXPERTS = {v.split(".")[-1]: k for k, v in MOE_EXPERTS.items()}  # "w1" -> "mlp.experts.w1"


def padded_sizes(cfg: ModelConfig) -> dict:
    """Padding kind -> stored length: KDA A_log [H] is stored as [ceil(H/128)*128]."""
    H = cfg.kda.num_heads
    return {"kda.A_log": -(-H // 128) * 128}


def layer_tables(cfg: ModelConfig, i: int) -> Tuple[dict, ...]:
    """The tables that name layer ``i``'s tensors (by its attention kind and FFN kind)."""
    attn = KDA_ATTN if cfg.layer_kinds()[i] == "kda" else MLA_ATTN
    return (LAYER_NORMS, attn, MOE_MLP if cfg.is_moe_layer(i) else DENSE_MLP)


def to_hf_name(canonical: str, cfg: ModelConfig) -> str:
    """HF name of a canonical tensor; for stacked experts the base with an ``{e}`` placeholder
    (``...experts.{e}.w1``). ValueError for a name no table knows."""
    m = _LAYER_RE.match(canonical)
    if m and int(m.group(1)) < cfg.num_layers:
        i, local = int(m.group(1)), m.group(2)
        tables = layer_tables(cfg, i) + ((MOE_EXPERTS,) if cfg.is_moe_layer(i) else ())
        for t in tables:
            if local in t:
                return f"{TEXT}.layers.{i}.{t[local]}"
    m = _VBLOCK_RE.match(canonical)
    if m and m.group(2) in VISION_BLOCK:
        return f"vision_tower.encoder.blocks.{m.group(1)}.{VISION_BLOCK[m.group(2)]}"
    for t in (GLOBAL, VISION):
        if canonical in t:
            return t[canonical]
    raise ValueError(f"no Hugging Face name for megak3 tensor {canonical!r} (megak3/interop/hf_names.py tables)")


@dataclass(frozen=True)
class HFName:
    """What an HF tensor name refers to in megak3."""

    canonical: str
    """megak3 canonical name"""
    expert: Optional[int] = None
    """expert index into the stacked [E, out, in] tensor (routed experts only)"""
    part: Optional[str] = None
    """'weight' | 'weight_packed' | 'weight_scale' for routed experts, None otherwise"""


def from_hf_name(hf_name: str, cfg: ModelConfig) -> Optional[HFName]:
    """The canonical tensor an HF name belongs to (legacy spellings accepted), or None when no
    table knows the name for this config (an unknown key)."""
    m = _HF_LAYER_RE.match(hf_name)
    if m:
        i, local = int(m.group(1)), m.group(2)
        if i >= cfg.num_layers:
            return None
        local = LEGACY.get(local, local)
        me = _HF_EXPERT_RE.match(local)
        if me:
            e = int(me.group(1))
            if not cfg.is_moe_layer(i) or e >= cfg.moe.num_experts:
                return None
            return HFName(f"layers.{i}.{_INV_EXPERTS[me.group(2)]}", e, me.group(3))
        for t in layer_tables(cfg, i):
            inv = _INV[id(t)]
            if local in inv:
                return HFName(f"layers.{i}.{inv[local]}")
        return None
    m = _HF_VBLOCK_RE.match(hf_name)
    if m:
        inv = _INV[id(VISION_BLOCK)]
        j = int(m.group(1))
        if m.group(2) in inv and cfg.vision.enabled and j < cfg.vision.num_layers:
            return HFName(f"vision.blocks.{j}.{inv[m.group(2)]}")
        return None
    name = LEGACY_GLOBAL.get(hf_name, hf_name)
    if name in _INV[id(GLOBAL)]:
        return HFName(_INV[id(GLOBAL)][name])
    if name in _INV[id(VISION)] and cfg.vision.enabled:
        return HFName(_INV[id(VISION)][name])
    return None


def is_vision_name(hf_name: str) -> bool:
    return hf_name.startswith(("vision_tower.", "mm_projector."))


# ---- what an export writes ------------------------------------------------------------------------
@dataclass(frozen=True)
class HFTensor:
    """One tensor of an HF export: its name, on-disk shape and dtype, and how it derives from megak3."""

    name: str
    """HF name"""
    canonical: str
    """megak3 canonical tensor it comes from"""
    kind: str
    """'plain' (same values), 'padded' (zero-padded 1-D), 'conv2d' (patch GEMM as a Conv2d weight),
    'expert' (row e of a stacked tensor), 'packed' / 'scale' (row e, MXFP4)"""
    shape: Tuple[int, ...]
    """on-disk shape"""
    dtype: torch.dtype
    """on-disk dtype"""
    expert: Optional[int] = None

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def canonical_shapes(cfg: ModelConfig) -> dict:
    """{canonical name: global shape} of every parameter and persistent buffer, in state-dict order
    (built on the meta device: no memory, any config size)."""
    from megak3.model.k3 import build_model

    model = build_model(cfg, device="meta")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _layer_local(canonical: str) -> str:
    m = _LAYER_RE.match(canonical)
    return m.group(2) if m else canonical


def hf_tensors(cfg: ModelConfig, experts: str = "mxfp4", dtype: torch.dtype = torch.bfloat16,
               shapes: Optional[dict] = None) -> List[HFTensor]:
    """Every tensor an export of a ``cfg`` model writes, in model order (layer by layer, expert by
    expert, then the vision tower). ``experts``: 'mxfp4' (weight_packed + weight_scale pairs) or
    'bf16' (``dtype`` weights). ``shapes``: canonical shapes when already known."""
    if experts not in EXPERTS_FORMATS:
        raise ValueError(f"--experts {experts!r}: choose one of {', '.join(EXPERTS_FORMATS)}")
    shapes = shapes if shapes is not None else canonical_shapes(cfg)
    pads = padded_sizes(cfg)
    out: List[HFTensor] = []
    for name, shape in shapes.items():
        hf = to_hf_name(name, cfg)
        local = _layer_local(name)
        dt = torch.float32 if local in FP32_ON_DISK else dtype
        if "{e}" in hf:
            E, O, I = shape
            for e in range(E):
                base = hf.format(e=e)
                if experts == "mxfp4":
                    if I % MXFP4_BLOCK:
                        raise ValueError(f"{name}: input dim {I} is not a multiple of {MXFP4_BLOCK}; MXFP4 cannot "
                                         "store it, use --experts bf16")
                    out.append(HFTensor(f"{base}.weight_packed", name, "packed", (O, I // 2), torch.uint8, e))
                    out.append(HFTensor(f"{base}.weight_scale", name, "scale", (O, I // MXFP4_BLOCK), torch.uint8, e))
                else:
                    out.append(HFTensor(f"{base}.weight", name, "expert", (O, I), dt, e))
        elif local in PADDED:
            out.append(HFTensor(hf, name, "padded", (pads[PADDED[local]],), dt))
        elif name == "vision.patch_embed.weight":
            v, (D, _) = cfg.vision, shape
            out.append(HFTensor(hf, name, "conv2d", (D, v.in_channels, v.patch_size, v.patch_size), dt))
        else:
            out.append(HFTensor(hf, name, "plain", shape, dt))
    return out


def inventory_totals(tensors: List[HFTensor]) -> dict:
    """Key count, MXFP4 packed/scale pairs, bytes (total and per kind) of an export listing."""
    pairs = sum(1 for t in tensors if t.kind == "packed")
    return {"tensors": len(tensors), "mxfp4_pairs": pairs, "bytes": sum(t.nbytes for t in tensors),
            "text_tensors": sum(1 for t in tensors if not is_vision_name(t.name)),
            "vision_tensors": sum(1 for t in tensors if is_vision_name(t.name))}
