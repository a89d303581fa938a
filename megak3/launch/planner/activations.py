"""Bytes saved for backward per decoder layer and the output head (the calibrated coefficients
ACT_COEF over each module's widths), and what context parallelism adds.

Context parallelism (parallel.cp, parallel/context_parallel.py; cp = 1 plans exactly as before):
  layout     world = tp x cp x dp x pp; every CP rank of a group holds the same rows' contiguous
             segment of seq_len / cp tokens (seq_len divisible by cp, by cp x tp under SP, and
             seq_len / cp >= the KDA conv halo); the global batch is a multiple of micro-batch x dp
             (not cp). Dense gradients, ZeRO-1 ownership, checkpoint savers and QB statistics are
             over dp x cp; routed experts fold over cp x dp (edp = world / (pp ep)).
  tokens     every per-rank token count (activations, kept layer inputs, TP / EP / PP traffic,
             MoonEP buffers, QB margins) is the micro-batch's mbs x seq_len / cp (/ tp under SP).
  KDA layer  (cp_layer_figures) the coefficients' activations of the local tokens; on ranks > 0
             the local pass runs on [v | 0_K] from [0 | I] (parallel/kda_cp.py), which adds the
             identity block's chunk states (the HKK_C term again x K/V), the zero value block and u
             ([t, H/tp, K] fp32 each); + the fixed summaries, own [B, H/tp, K, K+V] and gathered
             [cp, B, H/tp, K, K+V] fp32. Nothing grows faster than T / cp.
  MLA layer  the coefficients' activations of the local tokens WITHOUT the HT (T^2) term (under CP
             MLA always runs the chunked attention, ops/attention.py); + per key of the last CP
             rank's prefix (all T tokens of the row: the worst rank) what the code saves: the
             gathered latent (kv_lora_rank + rope, activation dtype), its normed kv part
             (kv_lora_rank), the norm's fp32 rstd, the expanded K and V of every key in fp32
             (H/tp x (qk_nope + rope + v) x 4 B, saved by the chunked attention) and the keys'
             int64 document ids. Linear in T (the prefix), no [T, T] tensor; the expanded prefix
             K/V dominates at long T (a kernel that expands K/V per key chunk from the latent would
             make it O(chunk)). (At cp = 1 the calibrated HT term stays: it was measured from CPU
             SDPA's math path on unpacked rows, an upper bound for the GPU flash / chunked paths.)
  comm (cp)  bytes one rank sends per step, ring / bandwidth-optimal as comm_log counts them:
             KDA per layer and micro-batch: all-gather of the summaries (cp-1) x B x H/tp x K x
             (K+V) x 4 B forward and the same in its backward reduce-scatter, + conv halos (q, k, v)
             (kernel-1) x B x H/tp x (2K+V) in the activation dtype each way; MLA: the latent
             all-gather (cp-1) x B x seq_len/cp x (kv_lora_rank + rope) in the activation dtype
             forward and its reduce-scatter backward (every TP rank gathers the whole latent: it
             is not TP-sharded). The forward collectives run again in the recompute forward under
             activation checkpointing. A CP group spans tp x cp consecutive ranks (order
             tp-cp-ep-dp-pp): NVLink when that fits in a node. In the step time like tp and ep
             (exposed, inside the bubble factor).
  MLA imbalance  contiguous placement: the last CP rank's queries see (cp - 1/2) segments of keys,
             (2cp - 1) / cp x the average MLA score work; the step waits for it, so a stage's MLA
             score FLOPs count x (2cp - 1) / cp. Under cp_balance (parallel/context_parallel.py) the
             score work is even (x 1, one document per row) and each computed query block expands
             its whole key prefix again, block by block: on average (cp x split + 1) / 2 key
             expansions per local token instead of one, 2 x kv_lora_rank x H x (nope + v) FLOPs
             each (x 4 in training: forward, re-expansion in backward, its backward); the MLA CP memory is then the gathered latent and document ids of all T keys
             (kv_lora_rank + rope in the activation dtype + 8 B) plus the computed blocks' fp32
             q, o and lse (nothing per expanded key is saved); the sent bytes add the local q and
             o in fp32 (the query all-to-all out and back, reversed in backward).
"""
from __future__ import annotations

import math
from typing import Dict

from ...config import ModelConfig
from .config import PlanConfig, _key


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


def _coef(kind: str, precision: str) -> Dict[str, float]:
    table = ACT_COEF[precision]
    return table[kind]


def _bytes(kind, feats, precision) -> float:
    c = _coef(kind, precision)
    return max(0.0, sum(c[k] * feats.get(k, 0.0) for k in c))


_LAYER_ACTS: Dict[tuple, dict] = {}


def cp_layer_figures(cfg: ModelConfig, pc: PlanConfig, kind: str) -> dict:
    """What context parallelism adds to one ``kind`` ('kda' | 'mla') layer for one micro-batch on the
    worst CP rank (module docstring, "Context parallelism"): saved bytes beyond the coefficients'
    local activations, and the bytes the rank sends per pass. All zero at cp = 1.

    Returns: saved (bytes), kda_states (the chunk states incl. the identity block, KDA), summaries
    (own + gathered, KDA), prefix_keys (keys of the worst rank's prefix per row, MLA),
    prefix_bytes_per_key (MLA), sent_fwd / sent_bwd (bytes sent in one forward / one backward),
    and their parts: scan_fwd, scan_bwd, halo_fwd, halo_bwd (KDA), latent_fwd, latent_bwd (MLA).
    """
    out = dict.fromkeys(("saved", "kda_states", "summaries", "prefix_keys", "prefix_bytes_per_key", "sent_fwd",
                         "sent_bwd", "scan_fwd", "scan_bwd", "halo_fwd", "halo_bwd", "latent_fwd",
                         "latent_bwd"), 0.0)
    cp = pc.cp
    if cp == 1:
        return out
    a = 2 if pc.precision == "bf16" else 4
    B, T = pc.micro_batch_size, pc.seq_len
    t = B * T / cp                                       # local tokens of the micro-batch
    if kind == "kda":
        k = cfg.kda
        H, K, V, C = k.num_heads / pc.tp, k.head_dim, k.head_dim, k.chunk_size
        chunks = B * math.ceil(T / cp / C)
        feats = module_features(cfg, "kda", tokens_per_seq=T // cp, tp=pc.tp)
        states_term = _coef("kda", pc.precision).get("HKK_C", 0.0) * feats["HKK_C"] * t
        summary = B * H * K * (K + V) * 4
        out["kda_states"] = chunks * H * K * (K + V) * 4
        out["summaries"] = (cp + 1) * summary
        # the identity block's states (K more value columns), the zero value block and u ([t, H, K] fp32)
        out["saved"] = states_term * K / V + 2 * t * H * K * 4 + out["summaries"]
        out["scan_fwd"] = out["scan_bwd"] = (cp - 1) * summary
        out["halo_fwd"] = out["halo_bwd"] = (k.conv_kernel - 1) * B * H * (2 * K + V) * a
        out["sent_fwd"] = out["scan_fwd"] + out["halo_fwd"]
        out["sent_bwd"] = out["scan_bwd"] + out["halo_bwd"]
    elif kind == "mla" and pc.cp_balance:
        m = cfg.mla
        H, L = m.num_heads / pc.tp, m.kv_lora_rank + m.qk_rope_head_dim
        qk, v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        out["prefix_keys"] = B * T / (pc.cp * pc.cp_balance_split)  # one key block expanded at a time
        out["prefix_bytes_per_key"] = L * a + 8                      # the gathered latent and document ids
        # + the computed query blocks' q, o and lse (fp32) saved by latent_attention
        out["saved"] = out["prefix_bytes_per_key"] * B * T + t * H * (qk + v + 1) * 4
        out["latent_fwd"] = out["latent_bwd"] = (cp - 1) * t * L * a
        # q out, o back (fp32; reversed in backward) for the local query blocks another rank computes,
        # on the rank that hands off most of them (head-tail pairing, one document per row: half of
        # them at cp 2, all of them on some rank from cp 4 on)
        moved = t * H * (qk + v) * 4 * _handed_off(pc.cp, pc.cp_balance_split)
        out["sent_fwd"], out["sent_bwd"] = out["latent_fwd"] + moved, out["latent_bwd"] + moved
    elif kind == "mla":
        m = cfg.mla
        H, L = m.num_heads / pc.tp, m.kv_lora_rank + m.qk_rope_head_dim
        per_key = L * a + m.kv_lora_rank * a + 4 + H * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 4 + 8
        out["prefix_keys"] = B * T                       # the last CP rank attends to every earlier token
        out["prefix_bytes_per_key"] = per_key
        out["saved"] = per_key * B * T
        out["latent_fwd"] = out["latent_bwd"] = (cp - 1) * t * L * a
        out["sent_fwd"], out["sent_bwd"] = out["latent_fwd"], out["latent_bwd"]
    return out


def layer_activations(cfg: ModelConfig, pc: PlanConfig, i: int) -> dict:
    """Saved bytes of decoder layer i for one micro-batch on one rank, by part."""
    key = (_key(cfg), pc.micro_batch_size, pc.seq_len, pc.tp, pc.sequence_parallel, pc.precision, pc.cp, i,
           pc.cp_balance, pc.cp_balance_split)
    if key not in _LAYER_ACTS:
        _LAYER_ACTS[key] = _layer_activations(cfg, pc, i)
    return _LAYER_ACTS[key]


def _layer_activations(cfg: ModelConfig, pc: PlanConfig, i: int) -> dict:
    t = pc.local_tokens if pc.cp > 1 else pc.micro_batch_size * pc.seq_len
    t_sp = t / pc.tp if pc.sequence_parallel else t
    T, tp, prec = pc.seq_len, pc.tp, pc.precision
    kind = cfg.layer_kinds()[i]
    bs = cfg.attn_res_block_size
    ctx = dict(tokens_per_seq=T, tp=tp)
    feats = module_features(cfg, kind, **ctx)
    cpf = cp_layer_figures(cfg, pc, kind)
    if pc.cp > 1 and "HT" in feats:
        feats["HT"] = 0.0   # under CP MLA runs the chunked attention: no T^2 term; prefix keys below
    attn = _bytes(kind, feats, prec) * t + cpf["saved"]
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
        if pc.cp > 1:
            kda_states = cpf["kda_states"]
    return {"attention": attn, "mlp": mlp, "attn_res": res, "norms": norms, "kda_states": kda_states,
            "cp_saved": cpf["saved"], "kind": kind, "mlp_kind": mlp_kind, "total": attn + mlp + res + norms}


def head_activations(cfg: ModelConfig, pc: PlanConfig) -> float:
    t = pc.local_tokens if pc.cp > 1 else pc.micro_batch_size * pc.seq_len
    t_sp = t / pc.tp if pc.sequence_parallel else t
    n_blocks = math.ceil(cfg.num_layers / cfg.attn_res_block_size)
    f = module_features(cfg, "head", tokens_per_seq=pc.seq_len, tp=pc.tp, sources=n_blocks + 1)
    # the AttnRes/norm part sees t_sp tokens; the vocab-parallel logits all t tokens
    c = _coef("head", pc.precision)
    return max(0.0, (c["Nd"] * f["Nd"] + c["d"] * f["d"] + c.get("one", 0.0)) * t_sp + c["V"] * f["V"] * t)


def _handed_off(cp: int, split: int) -> float:
    """Largest share of one CP rank's query blocks that the balanced schedule computes on another
    rank (parallel/context_parallel.py ``balanced_blocks``, one document per row)."""
    from parallel.context_parallel import balanced_blocks

    return max(len(set(range(split * r, split * (r + 1))) - set(balanced_blocks(cp, r, None, split)))
               for r in range(cp)) / split
