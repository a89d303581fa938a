"""Memory per rank of a pipeline stage (stage_memory), and its parts: the parameters, gradients
and optimizer state of the stage's layers, the Quantile-Balancing statistics, MoonEP's replica
buffers and the optimizer offload.

Memory per rank (bytes; the rank of the pipeline stage that needs the most), as the trainer keeps it:
  params     the rank's TP shard of dense weights + its EP share of routed experts, in param_dtype
             (fp32 as the trainer runs: bf16 autocast over fp32 master weights)
  grads      one gradient per local param (param dtype), accumulated over the step's micro-batches
  main       fp32 main copies of the params this rank OWNS under ZeRO-1 (0 when params are fp32:
             parallel/data_parallel/ then uses the param itself as the main copy)
  optimizer  owned share (1/dp of dense, 1/edp of expert params; without EP the experts are on the
             dp group) of Muon momentum (4 B/elem) and AdamW exp_avg + exp_avg_sq (8 B/elem); the
             average share (per_rank_figures has a given rank's whole-parameter ownership)
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
  moonep_replica_buffers  MoonEP's persistent weight buffers (moonep_replica_figures), shared by
             the layers: [E/ep + M, 3 x latent x expert width] in the compute dtype (M =
             moonep.max_replicas_per_rank, 0 = E/ep); one per rank with activation checkpointing, else
             one per MoE layer and forward in flight on the stage; allocated at first use, kept for the run
  qb_stats   Quantile-Balancing statistics of the stage's MoE layers (qb_figures): histogram
             int64 [E, bins] per layer, or the exact method's fp32 margins of the rank's tokens of the
             step [T_rank, E] per layer + at the step end one layer's gathered [T_group, E] twice
  comm       ZeRO-1 bucket (fp32 reduce-scatter buffer of dp segments, parallel/data_parallel/)
  backward transient: the largest single module's saved bytes again (its input gradients)
  peak       params + main + optimizer + QB stats + MoonEP replica buffers + comm + the working set:
             activations (+ grads when the step accumulates several micro-batches; with one, grads
             appear as activations are freed, so the larger of the two counts), or the exact QB
             gather after the step

Optimizer offload (PlanConfig.offload = optim.offload; 'none' plans exactly as before): with 'cpu'
the AdamW moments of the owned AdamW elements leave the device (8 B each); host memory holds them and
the fp32 weight/gradient copies the update runs on (16 B each); every step copies 12 B each over
PCIe (hardware pcie_bw) and streams 28 B each through host memory (host_mem_bw), in sequence after
the backward (megak3/optim/offload.py does not overlap them). Muon stays on the device. offload_figures().
"""
from __future__ import annotations

import math
from typing import Dict

from ...config import ModelConfig
from ...model.balancing import resolve_qb_method
from .activations import head_activations, layer_activations
from .config import PlanConfig, _ring
from .inventory import _places, _stage_layer_list, stage_chunks
from .vision import vision_figures


def _param_memory(cfg: ModelConfig, pc: PlanConfig, layers, first: bool, last: bool) -> dict:
    """Average ZeRO-1 shares (1/dp of the dense, 1/expert_dp of the expert params); see
    per_rank_figures for a given rank's exact whole-parameter ownership."""
    pbytes = 4 if pc.param_dtype == "fp32" else 2
    local = dense = expert = 0.0
    state = adamw = 0.0
    for place in _places(cfg, layers, first, last):
        for (tp_sh, is_exp, opt), n in place["numel"].items():
            if is_exp and pc.ep > 1:
                n_loc = n / pc.ep
                owners = pc.edp
                expert += n_loc
            elif is_exp:
                n_loc, owners = n, pc.dp_cp
                expert += n_loc
            else:
                n_loc = n / pc.tp if tp_sh else n
                owners = pc.dp_cp
                dense += n_loc
            local += n_loc
            state += n_loc / owners * (4 if opt == "muon" else 8)
            adamw += n_loc / owners if opt != "muon" else 0.0
    main = 0.0 if pc.param_dtype == "fp32" else 4 * (dense / pc.dp_cp + expert / pc.expert_dp)
    out = {"params": local * pbytes, "grads": local * pbytes, "main_params": main, "optimizer_state": state,
           "local_params": local, "local_dense": dense, "local_expert": expert}
    if pc.offload == "cpu":
        out.update(offload_figures(adamw))
        out["optimizer_state"] = state - out["optimizer_state_host"]
    return out


OFFLOAD_HOST_BYTES_PER_ELEM = 16
"""optim.offload=cpu, per owned AdamW element in host memory: exp_avg + exp_avg_sq (8 B) and the fp32
host copies of the weight and its gradient the update runs on (8 B; megak3/optim/offload.py)"""
OFFLOAD_PCIE_BYTES_PER_ELEM = 12
"""per owned AdamW element and step over PCIe: weight and gradient to the host, weight back (3 x 4 B)"""
OFFLOAD_HOST_UPDATE_BYTES_PER_ELEM = 28
"""per owned AdamW element and step through host memory in the fused CPU AdamW: reads weight,
gradient, exp_avg, exp_avg_sq (16 B), writes weight, exp_avg, exp_avg_sq (12 B)"""


def offload_figures(adamw_numel: float) -> dict:
    """optim.offload=cpu for ``adamw_numel`` owned AdamW elements (one rank): the AdamW state leaves
    the device (``optimizer_state_host``: its 8 B per element), host memory holds it and the two host
    copies (``host_bytes``: 16 B), and every step copies 12 B per element over PCIe and streams 28 B
    through host memory (``pcie_bytes_per_step``, ``host_update_bytes_per_step``). Muon stays on the
    device. tests/test_plan_offload.py measures the host bytes and the copies of HostAdamW."""
    return {"adamw_owned_numel": adamw_numel, "optimizer_state_host": 8.0 * adamw_numel,
            "host_bytes": OFFLOAD_HOST_BYTES_PER_ELEM * adamw_numel,
            "pcie_bytes_per_step": OFFLOAD_PCIE_BYTES_PER_ELEM * adamw_numel,
            "host_update_bytes_per_step": OFFLOAD_HOST_UPDATE_BYTES_PER_ELEM * adamw_numel}


# ---- Quantile Balancing statistics -------------------------------------------------------------
def qb_method(cfg: ModelConfig, pc: PlanConfig) -> str:
    """'exact' or 'histogram': PlanConfig.qb_method, else model.moe.qb_method; 'auto' (and a
    missing value) resolves through the trainer's own rule (megak3.model.balancing.resolve_qb_method):
    the histogram when one layer's gathered margins, global batch x seq_len x num_experts x 4 B,
    exceed QB_EXACT_MAX_BYTES (64 MiB), else exact margins. Any other value: ValueError naming the field."""
    m = pc.qb_method or getattr(cfg.moe, "qb_method", "auto")
    return resolve_qb_method(m, pc.global_batch_size * pc.seq_len, cfg.moe.num_experts)


def qb_figures(cfg: ModelConfig, pc: PlanConfig, n_moe: int) -> dict:
    """Memory and communication of the Quantile-Balancing statistics of ``n_moe`` MoE layers on one
    rank per optimizer step (megak3/model/balancing.QBAccumulator, parallel/moe_stats.reduce_balancer;
    the trainer reduces over tp under SP, then over dp).

    histogram: an int64 [E, bins] counts tensor (+ a token count) per layer, all-reduced once per
      step over each group (ring: 2 (n-1)/n of it per group).
    exact: every margin of the rank's tokens of the step, [T_rank, E] fp32 per layer; at the step
      end each layer's margins are all-gathered over the group (the rank receives the others',
      (T_group - T_rank) x E x 4 B) and concatenated for the top-k (2 x T_group x E x 4 B transient,
      one layer at a time), T_group = global batch x seq_len.
    """
    out = {"method": qb_method(cfg, pc), "bins": 0, "persistent": 0.0, "transient": 0.0, "comm": 0.0,
           "comm_tp": 0.0, "comm_dp": 0.0}
    if getattr(cfg.moe, "balancing", "quantile") != "quantile" or not n_moe:
        out["method"] = "none" if not n_moe else out["method"]
        return out
    E = cfg.moe.num_experts
    t_group = pc.global_batch_size * pc.seq_len
    tp_group = pc.tp if pc.sequence_parallel else 1
    dp = pc.dp_cp  # reduced over dp x cp (ParallelPlan.token_groups)
    t_rank = t_group / (dp * tp_group)
    if out["method"] == "histogram":
        bins = pc.qb_bins or getattr(cfg.moe, "qb_bins", 4096) or 4096
        size = E * bins * 8 + 8
        out.update(bins=bins, persistent=n_moe * size)
        out["comm_tp"] = n_moe * 2 * _ring(tp_group) * size
        out["comm_dp"] = n_moe * 2 * _ring(dp) * size
    else:
        out.update(persistent=n_moe * t_rank * E * 4.0,
                   transient=2.0 * t_group * E * 4 if tp_group * dp > 1 else t_rank * E * 4.0)
        out["comm_tp"] = n_moe * (tp_group - 1) * t_rank * E * 4.0
        out["comm_dp"] = n_moe * (dp - 1) * tp_group * t_rank * E * 4.0
    out["comm"] = out["comm_tp"] + out["comm_dp"]
    return out


def _n_moe(cfg: ModelConfig, layers) -> int:
    return sum(1 for i in layers if cfg.is_moe_layer(i))


# ---- MoonEP replica slots ------------------------------------------------------------------------
def moonep_replica_figures(cfg: ModelConfig, pc: PlanConfig, n_moe: int, in_flight: float = 1.0) -> dict:
    """Memory and traffic of MoonEP's replica weights for ``n_moe`` MoE layers on one EP rank.

    moonep/moonep.py: the dispatchers of a model's MoE layers draw persistent ``[J, P]`` buffers from
    one shared ``ReplicaBuffers`` (parallelize_ep), J = E/ep home experts + M replica slots
    (moonep.max_replicas_per_rank, 0 = E/ep), P = w1 + w3 + w2 of one expert = 3 x latent x expert
    width, in the compute dtype (bf16 under autocast, else the param dtype). A buffer stays busy
    while autograd holds the views of a layer's forward. With activation checkpointing the forward
    saves nothing and the recompute runs one layer at a time, refetching its replicas: ONE buffer
    per rank serves every layer. Without it every MoE layer's forward keeps its own until its
    backward: one per layer and forward in flight on the stage (``in_flight``, rounded up). Buffers
    are allocated at first use and kept for the run, so they are counted in full. Traffic per layer
    and forward (and recompute forward): at most M experts' weights received (the average rank
    sends as much), and in backward their gradients sent back, in the same dtype. Nothing under
    the baseline dispatcher (``moonep=False``) or without EP.

    Returns slots (M), rows_per_buffer (J), elements_per_row (P), bytes_per_element,
    buffer_bytes (one buffer), buffers (how many the rank holds), memory (bytes), and
    fetch_bytes_per_layer_pass (M x P x bytes).
    """
    out = {"slots": 0, "rows_per_buffer": 0, "elements_per_row": 0, "bytes_per_element": 0, "buffer_bytes": 0,
           "buffers": 0, "memory": 0.0, "fetch_bytes_per_layer_pass": 0.0}
    if pc.ep <= 1 or not pc.moonep or not n_moe:
        return out
    e = cfg.moe
    el = e.num_experts // pc.ep
    m = pc.max_replicas_per_rank or el
    p = 3 * e.latent_size * e.expert_intermediate_size
    b = 2 if pc.precision == "bf16" or pc.param_dtype == "bf16" else 4
    bufs = 1 if pc.activation_checkpointing else n_moe * max(1, math.ceil(in_flight - 1e-9))
    out.update(slots=m, rows_per_buffer=el + m, elements_per_row=p, bytes_per_element=b,
               buffer_bytes=(el + m) * p * b, buffers=bufs,
               memory=float(bufs * (el + m) * p * b), fetch_bytes_per_layer_pass=float(m * p * b))
    return out


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


def stage_memory(cfg: ModelConfig, pc: PlanConfig, stage: int) -> dict:
    layers = _stage_layer_list(cfg, pc, stage)
    first, last = stage == 0, stage == pc.pp - 1
    mem = _param_memory(cfg, pc, layers, first, last)
    m_count = pc.micro_batches
    in_flight = _in_flight(pc, stage, m_count)
    t = pc.local_tokens if pc.cp > 1 else pc.micro_batch_size * pc.seq_len
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
    # the vision tower (first stage): its saved tensors for every micro-batch in flight
    vis = vision_figures(cfg, pc) if first else {}
    vision_acts = vis["activations_per_micro_batch"] * in_flight if vis else 0.0
    if vis:
        acts += vision_acts
    n_moe = _n_moe(cfg, layers)
    moonep = 0.0
    if pc.ep > 1 and n_moe:
        moonep = 4 * t_sp * cfg.moe.top_k * cfg.moe.latent_size * a
    qb = qb_figures(cfg, pc, n_moe)
    replicas = moonep_replica_figures(cfg, pc, n_moe, in_flight)
    comm = 2 * pc.bucket_bytes if pc.dp_cp > 1 or pc.expert_dp > 1 else 0.0
    # bf16 autocast over fp32 weights caches a bf16 copy of every weight it uses during a forward
    autocast_copies = 2 * mem["local_params"] if pc.precision == "bf16" and pc.param_dtype == "fp32" else 0.0
    transient = max(biggest, head, vis["block_bytes_per_image"]) if vis else max(biggest, head)
    kda_states = sum(la["kda_states"] for la in per_layer) * (1 if pc.activation_checkpointing else in_flight)
    cp_saved = {k: sum(la["cp_saved"] for la in per_layer if la["kind"] == k) for k in ("kda", "mla")}
    # gradients are released after every step (zero_grad(set_to_none)): with one micro-batch per step
    # they grow during backward while the activations shrink, so the peak is the larger of the two
    # ends; with gradient accumulation (or a pipeline) they are live while activations are
    fwd_peak = acts + moonep + transient + autocast_copies
    # the ZeRO-1 bucket buffers live during reduce_gradients, after the last backward; the exact QB
    # margins are gathered after the optimizer step (gradients released)
    working = max(fwd_peak + (mem["grads"] if m_count > 1 else 0.0), mem["grads"] + comm, qb["transient"])
    total = mem["params"] + mem["main_params"] + mem["optimizer_state"] + qb["persistent"] + replicas["memory"] \
        + working
    out = {"stage": stage, "layers": [[c.start, c.stop] for c in stage_chunks(cfg, pc, stage)],
            "num_layers": len(layers), "moe_layers": n_moe, "in_flight_micro_batches": in_flight,
            "params": mem["params"], "grads": mem["grads"], "main_params": mem["main_params"],
            "optimizer_state": mem["optimizer_state"], "activations": acts,
            "activations_by_kind_per_micro_batch": by_kind, "activations_no_checkpointing": full * in_flight + head,
            "kda_states": kda_states, "cp_saved_per_micro_batch": cp_saved, "moonep_buffers": moonep, "moonep_replica_buffers": replicas["memory"],
            "moonep_replica_slots": replicas["slots"], "moonep_replica_buffer_count": replicas["buffers"],
            "comm_buffers": comm,
            "qb_stats": qb["persistent"], "qb_transient": qb["transient"], "qb_method": qb["method"],
            "backward_transient": transient, "autocast_weight_copies": autocast_copies, "total": total,
            "local_params": mem["local_params"], "local_dense": mem["local_dense"],
            "local_expert": mem["local_expert"]}
    if pc.offload == "cpu":  # (plans without offload keep exactly their keys)
        out.update({k: mem[k] for k in ("adamw_owned_numel", "optimizer_state_host", "host_bytes",
                                        "pcie_bytes_per_step", "host_update_bytes_per_step")})
    if pc.vision_fraction > 0:  # (text-only plans keep exactly their keys)
        out["activations_no_checkpointing"] += vision_acts
        out.update(vision_activations=vision_acts, vision_images_per_rank=vis.get("images_per_rank", 0))
    return out
