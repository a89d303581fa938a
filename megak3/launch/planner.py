"""Analytic per-rank memory, FLOPs per token, communication per step and step time of a layout.

    plan = make_plan(model_cfg, Layout(tp=8, pp=16, ep=64, world_size=2048), hw=load_hardware("h200"))
    plan["memory"]["total"], plan["time"]["step_s"], plan["fits"]

Memory per rank (bytes; the rank of the pipeline stage that needs the most), as the trainer keeps it:
  params     the rank's TP shard of dense weights + its EP share of routed experts, in param_dtype
             (fp32 as the trainer runs: bf16 autocast over fp32 master weights)
  grads      one gradient per local param (param dtype), accumulated over the step's micro-batches
  main       fp32 main copies of the params this rank OWNS under ZeRO-1 (0 when params are fp32:
             parallel/data_parallel.py then uses the param itself as the main copy)
  optimizer  owned share (1/dp of dense, 1/edp of expert params) of Muon momentum (4 B/elem) and
             AdamW exp_avg + exp_avg_sq (8 B/elem); whole-parameter ownership (+- one param)
  activations  per micro-batch: every decoder layer's saved tensors by module kind (KDA or MLA,
             dense FFN or LatentMoE, two AttnRes sites, two RMSNorms) + the head, from ACT_COEF
             (bytes per token per unit width, counted from this implementation's autograd graph,
             megak3/launch/calibrate.py); with activation checkpointing each layer keeps only its
             input (partial sum) and one layer is recomputed at a time. Under SP the modules
             outside TP regions see tokens/tp. Pipeline: 1F1B keeps min(pp - stage, micro-batches)
             micro-batches in flight on a stage.
  kda_states the chunk states [H/tp, K, K] fp32 every KDA layer saves per chunk (part of activations,
             shown separately)
  moonep     transient dispatch buffers of one MoE layer under EP: send, receive, expert output and
             combine, each [S*K, latent] (S = tokens of the rank, K = top_k)
  comm       ZeRO-1 bucket (fp32 reduce-scatter buffer of dp segments, parallel/data_parallel.py)
  backward transient: the largest single module's saved bytes again (its input gradients)
  peak       params + main + optimizer + comm + the working set: activations (+ grads when the step
             accumulates several micro-batches; with one, grads appear as activations are freed, so
             the larger of the two counts)

FLOPs per token (forward; training = 3x, + 1x of the layers with activation checkpointing):
  matmul     2 x active params (param counter: everything a token touches, top_k of E experts,
             embedding excluded) -- attention projections, MoE active experts, shared experts,
             latent projections, router, dense FFN, lm_head
  mla        per MLA layer, causal scores + values: H * (qk_head + v_head) * T  (average context T/2)
  kda        per KDA layer: H * (6 K^2 + 3 C K) (state read, write and delta correction 2K^2 each;
             intra-chunk QK^T and AV over C/2 on average; the WY/UT transform C K)
  vision     per image patch token: 2 x vision params + its attention over the patch sequence

Communication per rank per optimizer step (bytes; ring algorithms, (n-1)/n of the data moved):
  tp   4 collectives of [tokens, d] per layer per micro-batch (all-gather + reduce-scatter under SP,
       all-reduce without, forward and backward), activation dtype
  ep   MoonEP dispatch + combine of [S*K, latent] per MoE layer, forward and backward
  dp   ZeRO-1 reduce-scatter of fp32 grads + all-gather of params, dense over dp, experts over edp
  pp   the AttnRes depth state (partial + committed blocks) per micro-batch, to the next stage and
       its gradient back
Step time: compute / (peak * mfu) + exposed tp and ep comm + (1 - dp_overlap) of dp comm + pp
transfers, times the schedule's bubble factor 1 / (1 - closed-form bubble): 1 + (pp - 1) / m for
1F1B and AFAB, 1 + (pp - 1) / (vp m) interleaved, 1 + (pp - 1) / (3 m) for ZB-H1 (t_F = t_B = t_W);
interleaving sends vp times as many stage transfers. Activations in flight on stage s: 1F1B p - s
micro-batches, AFAB all m, interleaved (2 (p - 1 - s) + (vp - 1) p + 1) / vp (its warm-up, in
whole-stage units), ZB-H1 p - s plus ~0.5 per postponed W (s of them; tools/bench_pipeline.py).
A group inside one node uses the NVLink bandwidth, one spanning nodes the per-GPU network bandwidth
(hardware table).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional

from ..config import ModelConfig

GiB = 2 ** 30

# bytes saved for backward per token per unit of each feature, by module kind and precision;
# the output of megak3.launch.calibrate.fit() (python tools/plan.py --calibrate)
ACT_COEF: Dict[str, Dict[str, Dict[str, float]]] = {
    "fp32": {
        "norm": {"d": 8.029},
        "kda": {"HC": 85.393, "HKK_C": 33.384, "P": 68.057, "d": 4.048, "one": -308.979, "r": 3.987},
        "attn_res": {"N": 7.06, "Nd": 8.007, "one": 2.945},
        "dense": {"I": 28.0, "d": 4.0, "one": -0.0},
        "moe": {"E": 4.785, "Ish": 28.294, "K": 4.407, "KL": 8.636, "Km": 27.853, "L": 11.022, "d": 4.059, "one": 2.308},
        "mla": {"HT": 3.984, "Hqk": 8.196, "Hv": 15.85, "d": 4.005, "kvl": 4.423, "one": -0.435, "ql": 15.812},
        "head": {"Nd": 8.063, "V": 4.0, "d": 11.773, "one": 44.023},
    },
    "bf16": {
        "norm": {"d": 6.14},
        "kda": {"HC": 60.38, "HKK_C": 26.087, "P": 48.949, "d": 6.661, "one": 387.288, "r": 2.294},
        "attn_res": {"N": 7.037, "Nd": 8.008, "one": 2.853},
        "dense": {"I": 26.226, "d": 1.381, "one": -292.571},
        "moe": {"E": 25.748, "Ish": 19.153, "K": 0.0, "KL": 0.0, "Km": 43.137, "L": 8.558, "d": 4.773, "one": 16.803},
        "mla": {"HT": 1.207, "Hqk": 27.498, "Hv": 0.0, "d": 3.6, "kvl": 9.441, "one": 215.835, "ql": 0.0},
        "head": {"Nd": 8.189, "V": 5.511, "d": 18.368, "one": -1548.145},
    },
}


def module_features(cfg: ModelConfig, kind: str, tokens_per_seq: int, tp: int = 1, sources: int = 1,
                    sequence_parallel: bool = False) -> Dict[str, float]:
    """The widths (elements per token, per rank) a module's saved activations scale with."""
    d = cfg.hidden_size
    if kind == "kda":
        k = cfg.kda
        H = k.num_heads / tp
        return {"d": d, "P": H * k.head_dim, "HC": H * k.chunk_size, "HKK_C": H * k.head_dim ** 2 / k.chunk_size,
                "r": k.gate_rank, "one": 1.0}
    if kind == "mla":
        m = cfg.mla
        H = m.num_heads / tp
        return {"d": d, "ql": m.q_lora_rank, "kvl": m.kv_lora_rank + m.qk_rope_head_dim,
                "Hqk": H * (m.qk_nope_head_dim + m.qk_rope_head_dim), "Hv": H * m.v_head_dim,
                "HT": H * tokens_per_seq, "one": 1.0}
    if kind == "dense":
        return {"d": d, "I": cfg.dense_intermediate_size / tp, "one": 1.0}
    if kind == "moe":
        e = cfg.moe
        sh = e.num_shared_experts * e.expert_intermediate_size / tp * (tp if sequence_parallel else 1)
        return {"d": d, "E": e.num_experts, "L": e.latent_size, "KL": e.top_k * e.latent_size,
                "Km": e.top_k * e.expert_intermediate_size, "Ish": sh, "K": e.top_k, "one": 1.0}
    if kind == "attn_res":
        return {"Nd": sources * d, "N": sources, "one": 1.0}
    if kind == "norm":
        return {"d": d}
    if kind == "head":
        return {"Nd": sources * d, "d": d, "V": cfg.vocab_size / tp, "one": 1.0}
    raise ValueError(f"unknown module kind {kind!r}")


# ---- layout and inputs ------------------------------------------------------------------------
@dataclass
class PlanConfig:
    """What to plan: layout degrees, batch shape, precision, checkpointing, hardware."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 0
    """0: world_size / (tp * pp)"""
    world_size: int = 1
    sequence_parallel: bool = True
    """SP under tp > 1 (the trainer's EP x TP layouts require it)"""
    micro_batch_size: int = 1
    seq_len: int = 4096
    global_batch_size: int = 0
    """sequences per step; 0: micro_batch_size * dp * max(1, 2 * pp) (enough micro-batches for 1F1B)"""
    precision: str = "bf16"
    """activation dtype: 'bf16' (autocast) or 'fp32'"""
    param_dtype: str = "fp32"
    """'fp32' (the trainer: fp32 params = main copies) or 'bf16' (bf16 params + fp32 owned main copies)"""
    activation_checkpointing: bool = True
    pp_schedule: str = "1f1b"
    """parallel.pp_schedule: afab, 1f1b, interleaved_1f1b or zb_h1 (parallel/pipeline/schedules.py)"""
    vp: int = 1
    """parallel.vp: model chunks per pipeline rank (interleaved_1f1b)"""
    bucket_bytes: int = 40 * 2 ** 20
    dp_overlap: float = 0.8
    """fraction of the ZeRO-1 reduce-scatter / all-gather hidden behind compute"""

    def resolved(self) -> "PlanConfig":
        for f in ("tp", "pp", "ep", "world_size", "micro_batch_size", "seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{f}={v!r} must be an integer >= 1" if f in ("tp", "pp", "ep")
                                 else f"{f}={v!r} must be an integer >= 1")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"precision={self.precision!r} must be 'bf16' or 'fp32'")
        if self.param_dtype not in ("bf16", "fp32"):
            raise ValueError(f"param_dtype={self.param_dtype!r} must be 'bf16' or 'fp32'")
        model = self.tp * self.pp
        if self.world_size % model:
            raise ValueError(f"parallel.tp*pp = {model} does not divide world_size={self.world_size}")
        dp = self.dp or self.world_size // model
        if dp * model != self.world_size:
            raise ValueError(f"parallel.tp*pp*dp = {model}*{dp} must equal world_size={self.world_size}")
        if (self.world_size // self.pp) % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide world_size/pp = {self.world_size // self.pp}")
        gbs = self.global_batch_size or self.micro_batch_size * dp * max(1, 2 * self.pp)
        if gbs % (self.micro_batch_size * dp):
            raise ValueError(f"global_batch_size={gbs} must be a multiple of micro_batch_size x dp = "
                             f"{self.micro_batch_size} x {dp}")
        if self.pp > 1:
            from parallel.pipeline.schedules import check_schedule

            check_schedule(self.pp_schedule, self.pp, self.vp, gbs // (self.micro_batch_size * dp))
        return replace(self, dp=dp, global_batch_size=gbs, sequence_parallel=self.sequence_parallel and self.tp > 1)

    @property
    def edp(self) -> int:
        return self.world_size // (self.pp * self.ep)


def check_model(cfg: ModelConfig, pc: PlanConfig) -> None:
    """The divisibility the layout needs (as parallel/grid.validate_layout)."""
    from parallel.grid import Layout, validate_layout

    validate_layout(Layout(world_size=pc.world_size, tp=pc.tp, dp=pc.dp, pp=pc.pp, ep=pc.ep), cfg)


# ---- parameters from the real module tree -------------------------------------------------------
_TP_SHARDED = ("q_proj.", "k_proj.", "v_proj.", "g_proj.", "f_b_proj.", "b_proj.", "q_conv1d.", "k_conv1d.",
               "v_conv1d.", "A_log", "dt_bias", "o_proj.", "q_b_proj.", "kv_b_proj.")


def _tp_sharded(name: str) -> bool:
    """Mirrors parallel/parallelize.parallelize_tp: which tensors are split tp ways."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return True
    if name.startswith("vision."):
        return False
    local = name.split(".self_attn.", 1)[1] if ".self_attn." in name else None
    if local is not None:
        return local.startswith(_TP_SHARDED)
    if ".mlp.shared_experts." in name:
        return True
    if ".mlp." in name and ".mlp.experts." not in name and ".mlp.gate." not in name \
            and ".mlp.routed_expert" not in name:
        return True  # dense FFN
    return False


_INVENTORY: Dict[str, tuple] = {}


def _inventory(cfg: ModelConfig) -> tuple:
    """((name, numel, layer index or -1 embed / -2 head, tp_sharded, expert, optimizer), ...)"""
    import torch

    from ..model.k3 import K3Model
    from ..optim.param_groups import classify_parameters

    with torch.device("meta"):
        model = K3Model(cfg)
    opt = {s.name: s.optimizer for s in classify_parameters(model)}
    out = []
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            where = int(name.split(".")[1])
        elif name.startswith(("embed_tokens.", "vision.")):
            where = -1
        else:
            where = -2
        out.append((name, p.numel(), where, _tp_sharded(name), ".mlp.experts." in name, opt.get(name, "adamw")))
    return tuple(out)


def inventory(cfg: ModelConfig) -> tuple:
    key = repr(cfg)
    if key not in _INVENTORY:
        _INVENTORY[key] = _inventory(cfg)
    return _INVENTORY[key]


def stage_layers(num_layers: int, pp: int) -> List[range]:
    """Contiguous layer ranges per pipeline stage; the first num_layers % pp stages get one more."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


_AGG: Dict[str, dict] = {}


def _aggregate(cfg: ModelConfig) -> dict:
    """{(where, tp_sharded, expert, optimizer): numel} of the inventory (cached per config)."""
    key = repr(cfg)
    if key not in _AGG:
        agg: dict = {}
        for _, n, where, tp_sh, is_exp, opt in inventory(cfg):
            k = (where, tp_sh, is_exp, opt)
            agg[k] = agg.get(k, 0) + n
        _AGG[key] = agg
    return _AGG[key]


def _param_memory(cfg: ModelConfig, pc: PlanConfig, layers: range, first: bool, last: bool) -> dict:
    pbytes = 4 if pc.param_dtype == "fp32" else 2
    local = dense = expert = 0.0
    state = 0.0
    for (where, tp_sh, is_exp, opt), n in _aggregate(cfg).items():
        if where >= 0 and where not in layers:
            continue
        if where == -1 and not first or where == -2 and not last:
            continue
        if is_exp:
            n_loc = n / pc.ep
            owners = pc.edp
            expert += n_loc
        else:
            n_loc = n / pc.tp if tp_sh else n
            owners = pc.dp
            dense += n_loc
        local += n_loc
        state += n_loc / owners * (4 if opt == "muon" else 8)
    main = 0.0 if pc.param_dtype == "fp32" else 4 * (dense / pc.dp + expert / pc.edp)
    return {"params": local * pbytes, "grads": local * pbytes, "main_params": main, "optimizer_state": state,
            "local_params": local, "local_dense": dense, "local_expert": expert}


# ---- activations ------------------------------------------------------------------------------
def _coef(kind: str, precision: str) -> Dict[str, float]:
    table = ACT_COEF[precision]
    return table[kind]


def _bytes(kind, feats, precision) -> float:
    c = _coef(kind, precision)
    return max(0.0, sum(c[k] * feats.get(k, 0.0) for k in c))


def layer_activations(cfg: ModelConfig, pc: PlanConfig, i: int) -> dict:
    """Saved bytes of decoder layer i for one micro-batch on one rank, by part."""
    t = pc.micro_batch_size * pc.seq_len
    t_sp = t / pc.tp if pc.sequence_parallel else t
    T, tp, prec = pc.seq_len, pc.tp, pc.precision
    kind = cfg.layer_kinds()[i]
    bs = cfg.attn_res_block_size
    ctx = dict(tokens_per_seq=T, tp=tp)
    attn = _bytes(kind, module_features(cfg, kind, **ctx), prec) * t
    mlp_kind = "moe" if cfg.is_moe_layer(i) else "dense"
    if mlp_kind == "moe":
        mlp = _bytes("moe", module_features(cfg, "moe", sequence_parallel=pc.sequence_parallel, **ctx), prec) * t_sp
    else:
        mlp = _bytes("dense", module_features(cfg, "dense", **ctx), prec) * t
    res = 0.0
    blocks_attn = (i + bs - 1) // bs
    if blocks_attn:
        res += _bytes("attn_res", module_features(cfg, "attn_res", sources=blocks_attn + 1, **ctx), prec) * t_sp
    res += _bytes("attn_res", module_features(cfg, "attn_res", sources=i // bs + 2, **ctx), prec) * t_sp
    norms = 2 * _bytes("norm", module_features(cfg, "norm", **ctx), prec) * t_sp
    kda_states = 0.0
    if kind == "kda":
        k = cfg.kda
        kda_states = pc.micro_batch_size * math.ceil(T / k.chunk_size) * (k.num_heads / tp) * k.head_dim ** 2 * 4
    return {"attention": attn, "mlp": mlp, "attn_res": res, "norms": norms, "kda_states": kda_states,
            "kind": kind, "mlp_kind": mlp_kind, "total": attn + mlp + res + norms}


def head_activations(cfg: ModelConfig, pc: PlanConfig) -> float:
    t = pc.micro_batch_size * pc.seq_len
    t_sp = t / pc.tp if pc.sequence_parallel else t
    n_blocks = math.ceil(cfg.num_layers / cfg.attn_res_block_size)
    f = module_features(cfg, "head", tokens_per_seq=pc.seq_len, tp=pc.tp, sources=n_blocks + 1)
    # the AttnRes/norm part sees t_sp tokens; the vocab-parallel logits all t tokens
    c = _coef("head", pc.precision)
    return max(0.0, (c["Nd"] * f["Nd"] + c["d"] * f["d"] + c.get("one", 0.0)) * t_sp + c["V"] * f["V"] * t)


def stage_memory(cfg: ModelConfig, pc: PlanConfig, stage: int) -> dict:
    ranges = stage_layers(cfg.num_layers, pc.pp)
    layers = ranges[stage]
    first, last = stage == 0, stage == pc.pp - 1
    mem = _param_memory(cfg, pc, layers, first, last)
    m_count = pc.global_batch_size // (pc.micro_batch_size * pc.dp)
    in_flight = _in_flight(pc, stage, m_count)
    t = pc.micro_batch_size * pc.seq_len
    t_sp = t / pc.tp if pc.sequence_parallel else t
    a = 2 if pc.precision == "bf16" else 4
    per_layer = [layer_activations(cfg, pc, i) for i in layers]
    by_kind: Dict[str, float] = {}
    for la in per_layer:
        by_kind[la["kind"]] = by_kind.get(la["kind"], 0.0) + la["attention"]
        by_kind[la["mlp_kind"]] = by_kind.get(la["mlp_kind"], 0.0) + la["mlp"]
        by_kind["attn_res+norms"] = by_kind.get("attn_res+norms", 0.0) + la["attn_res"] + la["norms"]
    full = sum(la["total"] for la in per_layer)
    biggest = max((la["total"] for la in per_layer), default=0.0)
    if pc.activation_checkpointing:
        # kept: each layer's input (fp32 partial sum) and the committed AttnRes blocks; one layer recomputed
        n_blocks = len({i // cfg.attn_res_block_size for i in layers})
        kept = (len(layers) + n_blocks) * t_sp * 4
        acts = kept * in_flight + biggest
    else:
        acts = full * in_flight
    head = head_activations(cfg, pc) if last else 0.0
    acts += head
    moonep = 0.0
    if pc.ep > 1 and any(cfg.is_moe_layer(i) for i in layers):
        moonep = 4 * t_sp * cfg.moe.top_k * cfg.moe.latent_size * a
    comm = 2 * pc.bucket_bytes if pc.dp > 1 or pc.edp > 1 else 0.0
    # bf16 autocast over fp32 weights caches a bf16 copy of every weight it uses during a forward
    autocast_copies = 2 * mem["local_params"] if pc.precision == "bf16" and pc.param_dtype == "fp32" else 0.0
    transient = max(biggest, head)
    kda_states = sum(la["kda_states"] for la in per_layer) * (1 if pc.activation_checkpointing else in_flight)
    # gradients are released after every step (zero_grad(set_to_none)): with one micro-batch per step
    # they grow during backward while the activations shrink, so the peak is the larger of the two
    # ends; with gradient accumulation (or a pipeline) they are live while activations are
    fwd_peak = acts + moonep + transient + autocast_copies
    # the ZeRO-1 bucket buffers live during reduce_gradients, after the last backward
    working = max(fwd_peak + (mem["grads"] if m_count > 1 else 0.0), mem["grads"] + comm)
    total = mem["params"] + mem["main_params"] + mem["optimizer_state"] + working
    return {"stage": stage, "layers": [layers.start, layers.stop], "in_flight_micro_batches": in_flight,
            "params": mem["params"], "grads": mem["grads"], "main_params": mem["main_params"],
            "optimizer_state": mem["optimizer_state"], "activations": acts,
            "activations_by_kind_per_micro_batch": by_kind, "activations_no_checkpointing": full * in_flight + head,
            "kda_states": kda_states, "moonep_buffers": moonep, "comm_buffers": comm,
            "backward_transient": transient, "autocast_weight_copies": autocast_copies, "total": total, "local_params": mem["local_params"]}


# ---- FLOPs ------------------------------------------------------------------------------------
_COUNTS: Dict[str, dict] = {}


def _counts(cfg: ModelConfig) -> dict:
    from ..model.param_count import count_parameters

    key = repr(cfg)
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
    m, k = cfg.mla, cfg.kda
    out = {
        "attention_proj": 2.0 * comp["attention"],
        "moe_active": 2.0 * moe_active,
        "dense_ffn": 2.0 * comp["dense_ffn"],
        "lm_head": 2.0 * comp["lm_head"],
        "norms_attn_res": 2.0 * comp["norms_attn_res"],
        "mla_scores": n_mla * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * seq_len,
        "kda_recurrence": n_kda * k.num_heads * (6 * k.head_dim ** 2 + 3 * k.chunk_size * k.head_dim),
    }
    out["forward"] = sum(out.values())
    out["matmul_forward"] = 2.0 * pc["active"]
    out["train"] = 3.0 * out["forward"]
    v = cfg.vision
    if v.enabled:
        patches = v.pos_grid ** 2
        out["vision_per_patch_forward"] = 2.0 * comp["vision"] + 2 * v.num_layers * v.num_heads * v.head_dim * patches
    out["active_params"] = pc["active"]
    out["total_params"] = pc["total"]
    return out


# ---- communication and time ----------------------------------------------------------------------
def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def comm_per_step(cfg: ModelConfig, pc: PlanConfig, stage_mem: dict) -> dict:
    a = 2 if pc.precision == "bf16" else 4
    pbytes = 4 if pc.param_dtype == "fp32" else 2
    m_count = pc.global_batch_size // (pc.micro_batch_size * pc.dp)
    layers = stage_layers(cfg.num_layers, pc.pp)[0]
    n_layers = len(layers)
    n_moe = sum(cfg.is_moe_layer(i) for i in layers)
    t = pc.micro_batch_size * pc.seq_len
    t_sp = t / pc.tp if pc.sequence_parallel else t
    tp = 4 * 2 * n_layers * t * cfg.hidden_size * a * _ring(pc.tp) * m_count  # 2 regions x 4 collectives
    ep = 4 * n_moe * t_sp * cfg.moe.top_k * cfg.moe.latent_size * a * _ring(pc.ep) * m_count
    dense, expert = stage_mem["local_dense"], stage_mem["local_expert"]
    dp = dense * (4 + pbytes) * _ring(pc.dp) + expert * (4 + pbytes) * _ring(pc.edp)
    n_blocks = math.ceil(cfg.num_layers / cfg.attn_res_block_size)
    pp = (2 * m_count * pc.vp * (n_blocks + 1) * t_sp * cfg.hidden_size * a) if pc.pp > 1 else 0.0
    return {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "micro_batches": m_count}


def _in_flight(pc: PlanConfig, stage: int, m: int) -> float:
    """Micro-batches of one whole stage's activations that stage ``stage`` holds at its peak."""
    p = pc.pp
    if p == 1:
        return 1.0
    if pc.pp_schedule == "afab":
        return float(m)
    if pc.pp_schedule == "interleaved_1f1b":
        return min((2 * (p - 1 - stage) + (pc.vp - 1) * p + 1) / pc.vp, float(m))
    held = float(min(p - stage, m))
    return held + 0.5 * min(stage, m) if pc.pp_schedule == "zb_h1" else held


def bubble_factor(pc: PlanConfig, m: int) -> float:
    """Step time over bubble-free time for the schedule: 1 / (1 - closed-form bubble fraction)."""
    from parallel.pipeline.schedules import closed_form_bubble

    if pc.pp == 1:
        return 1.0
    b = closed_form_bubble("1f1b" if pc.pp_schedule == "afab" else pc.pp_schedule, pc.pp, m, pc.vp)
    return 1.0 / (1.0 - b)


def _link(group_span: int, hw) -> float:
    """Bandwidth (bytes/s per GPU) of a group whose ranks span `group_span` consecutive ranks."""
    return hw.nvlink_bw if group_span <= hw.gpus_per_node else hw.net_bw


def make_plan(cfg: ModelConfig, pc: PlanConfig, hw) -> dict:
    """Memory (worst stage), FLOPs, comm, step time, fits -- see the module docstring."""
    pc = pc.resolved()
    check_model(cfg, pc)
    stages = [stage_memory(cfg, pc, s) for s in range(pc.pp)]
    worst = max(stages, key=lambda s: s["total"])
    mem_p = _param_memory(cfg, pc, stage_layers(cfg.num_layers, pc.pp)[0], True, pc.pp == 1)
    comm = comm_per_step(cfg, pc, mem_p)
    fl = flops_per_token(cfg, pc.seq_len)
    tokens_step = pc.global_batch_size * pc.seq_len
    recompute = 4.0 / 3.0 if pc.activation_checkpointing else 1.0
    flops_rank = fl["train"] * recompute * tokens_step / pc.world_size
    compute_s = flops_rank / (hw.peak_flops(pc.precision) * hw.mfu)
    # rank order tp fastest, then ep/dp, pp last (parallel/grid.py default 'tp-cp-ep-dp-pp')
    t_tp = comm["tp"] / _link(pc.tp, hw)
    t_ep = comm["ep"] / _link(pc.tp * pc.ep, hw)
    t_dp = comm["dp"] / _link(pc.tp * pc.dp, hw) * (1 - pc.dp_overlap)
    t_pp = comm["pp"] / _link(pc.world_size, hw) if pc.pp > 1 else 0.0
    bubble = bubble_factor(pc, comm["micro_batches"])
    step = (compute_s + t_tp + t_ep + t_pp) * bubble + t_dp
    usable = hw.memory_bytes * hw.usable_memory_fraction
    return {
        "layout": {"tp": pc.tp, "pp": pc.pp, "ep": pc.ep, "dp": pc.dp, "edp": pc.edp, "world_size": pc.world_size,
                   "sequence_parallel": pc.sequence_parallel, "micro_batch_size": pc.micro_batch_size,
                   "seq_len": pc.seq_len, "global_batch_size": pc.global_batch_size,
                   "micro_batches": comm["micro_batches"], "activation_checkpointing": pc.activation_checkpointing,
                   "pp_schedule": pc.pp_schedule, "vp": pc.vp,
                   "precision": pc.precision, "param_dtype": pc.param_dtype},
        "hardware": hw.name,
        "memory": worst, "stages": stages,
        "flops_per_token": fl,
        "comm_bytes_per_step": {k: comm[k] for k in ("tp", "ep", "dp", "pp")},
        "time": {"compute_s": compute_s, "tp_s": t_tp, "ep_s": t_ep, "dp_exposed_s": t_dp, "pp_s": t_pp,
                 "bubble": bubble, "step_s": step, "tokens_per_s": tokens_step / step,
                 "mfu": fl["train"] * tokens_step / pc.world_size / step / hw.peak_flops(pc.precision)},
        "fits": worst["total"] <= usable, "usable_memory": usable,
    }


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(cfg: ModelConfig, world_size: int, hw, top: int = 3, base: Optional[PlanConfig] = None) -> List[dict]:
    """The `top` fitting layouts by estimated tokens/s over tp (<= one node), pp, ep and micro-batch size."""
    base = base or PlanConfig()
    if not base.global_batch_size:  # compare layouts at one batch: 1024 sequences unless given
        base = replace(base, global_batch_size=1024)
    found = []
    for tp in [d for d in _divisors(world_size) if d <= hw.gpus_per_node]:
        for pp in [d for d in _divisors(world_size // tp) if d <= cfg.num_layers]:
            for ep in _divisors(world_size // pp):
                if cfg.moe.num_experts % ep or (ep > 1 and ep < tp):
                    continue
                for mbs in (1, 2, 4):
                    pc = replace(base, tp=tp, pp=pp, ep=ep, dp=0, world_size=world_size, micro_batch_size=mbs,
                                 global_batch_size=base.global_batch_size)
                    try:
                        p = make_plan(cfg, pc, hw)
                    except ValueError:
                        continue
                    if p["fits"]:
                        found.append(p)
    found.sort(key=lambda p: -p["time"]["tokens_per_s"])
    return found[:top]
