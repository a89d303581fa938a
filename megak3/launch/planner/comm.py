"""Communication per rank per optimizer step and the step time of a pipeline stage.

Communication per rank per optimizer step (bytes; ring algorithms, (n-1)/n of the data moved),
counted for every pipeline stage; the plan reports the stage with the longest step:
  tp   4 collectives of [tokens, d] per layer per micro-batch (all-gather + reduce-scatter under SP,
       all-reduce without, forward and backward; 6 with activation checkpointing: the recompute
       runs the forward's two again), activation dtype; + the vocab-parallel embedding (first
       stage) and lm_head (last) 2 each
  tp_grad_sync  the partial gradients of replicated params summed over TP once per step
       (parallel/parallelize.sync_partial_grads: under SP every replicated non-vision param)
  ep   MoonEP dispatch + combine of [S*K, latent] per MoE layer, forward and backward (+ the
       recompute forward's dispatch and combine under activation checkpointing: x 1.5)
  ep_replicas_max  MoonEP replica weights with all M slots filled (an upper bound): M experts'
       w1|w3|w2 per MoE layer fetched per forward (and recompute forward) in the compute dtype, their
       gradients sent back in backward (moonep_replica_figures). Not in the step time: how many
       slots a batch fills depends on its routing (none for near-uniform routing with
       moonep.tolerance > 0; tools/bench_moonep.py prints replicas under Zipf skew)
  dp   ZeRO-1 reduce-scatter of fp32 grads + all-gather of params, dense over dp, experts over edp
  pp   the AttnRes depth state (partial + committed blocks) per micro-batch, to the next stage and
       its gradient back
  qb   QB statistics (qb_figures): histogram all-reduce of [E, bins] int64 per MoE layer over tp
       (under SP) and dp, or the exact margins' all-gather
Step time of a stage: compute (its layers' FLOPs over the stage's ranks) / (peak * mfu) + exposed tp
and ep comm + pp transfers, times the schedule's bubble factor 1 / (1 - closed-form bubble):
1 + (pp - 1) / m for 1F1B and AFAB, 1 + (pp - 1) / (vp m) interleaved, 1 + (pp - 1) / (3 m) for
ZB-H1 (t_F = t_B = t_W); then + the TP gradient sync, (1 - dp_overlap) of the dp comm and the QB
reduction, which run after the last backward. The step is the slowest stage's. Interleaving sends
vp times as many stage transfers. Activations in flight on stage s: 1F1B p - s micro-batches, AFAB
all m, interleaved (2 (p - 1 - s) + (vp - 1) p + 1) / vp (its warm-up, in whole-stage units), ZB-H1
p - s plus ~0.5 per postponed W (s of them; tools/bench_pipeline.py).
A group inside one node uses the NVLink bandwidth, one spanning nodes the per-GPU network bandwidth
(hardware table); the expert grid puts ep fastest (etp = 1), so an EP group spans ep ranks.
"""
from __future__ import annotations

import math

from ...config import ModelConfig
from .activations import cp_layer_figures
from .config import PlanConfig, _ring
from .flops import _mla_scores, layer_flops_per_token
from .inventory import _places, _stage_layer_list
from .memory import _n_moe, _param_memory, moonep_replica_figures, qb_figures
from .vision import vision_figures


def comm_per_step(cfg: ModelConfig, pc: PlanConfig, stage: int) -> dict:
    """Bytes one rank of pipeline stage ``stage`` sends per optimizer step, by axis (module docstring)."""
    a = 2 if pc.precision == "bf16" else 4
    pbytes = 4 if pc.param_dtype == "fp32" else 2
    m_count = pc.micro_batches
    layers = _stage_layer_list(cfg, pc, stage)
    first, last = stage == 0, stage == pc.pp - 1
    n_layers, n_moe = len(layers), _n_moe(cfg, layers)
    t = pc.local_tokens if pc.cp > 1 else pc.micro_batch_size * pc.seq_len
    t_sp = t / pc.tp if pc.sequence_parallel else t
    d = cfg.hidden_size
    # forward + backward, + the forward again when activation checkpointing recomputes the layer
    passes = 3 if pc.activation_checkpointing else 2
    tp_unit = t * d * a * _ring(pc.tp) * m_count
    tp = 2 * passes * 2 * n_layers * tp_unit       # 2 regions x (enter + exit) per pass
    tp += 2 * tp_unit * (first + last)               # vocab-parallel embedding / lm_head (not recomputed)
    vis = vision_figures(cfg, pc) if first else {}
    tp_vision = vis["gather_bytes_per_micro_batch"] * m_count if vis else 0.0
    if vis:
        tp += tp_vision                              # the merged image tokens' all-gather (forward only)
    partial = 0
    if pc.tp > 1:
        for place in _places(cfg, layers, first, last):
            partial += place["partial_attn"]
            if pc.sequence_parallel:
                partial += place["partial_sp"] + (place["partial_sp_expert"] if pc.ep == 1 else 0)
    tp_sync = 2 * _ring(pc.tp) * partial * pbytes  # sync_partial_grads: one all-reduce per step
    ep = 2 * passes * n_moe * t_sp * cfg.moe.top_k * cfg.moe.latent_size * a * _ring(pc.ep) * m_count
    ep_replicas_max = passes * m_count * n_moe * moonep_replica_figures(cfg, pc, n_moe)["fetch_bytes_per_layer_pass"]
    mem = _param_memory(cfg, pc, layers, first, last)
    dp_dense = mem["local_dense"] * (4 + pbytes) * _ring(pc.dp_cp)
    dp_expert = mem["local_expert"] * (4 + pbytes) * _ring(pc.expert_dp)
    n_blocks = math.ceil(cfg.num_layers / cfg.attn_res_block_size)
    pp = (2 * m_count * pc.vp * (n_blocks + 1) * t_sp * d * a) if pc.pp > 1 else 0.0
    qb = qb_figures(cfg, pc, n_moe)
    # context parallelism: per layer the forward collectives (again in the recompute forward) + the backward's
    cp_kind = {"kda": 0.0, "mla": 0.0}
    if pc.cp > 1:
        kinds = cfg.layer_kinds()
        for kind in cp_kind:
            f = cp_layer_figures(cfg, pc, kind)
            n = sum(1 for i in layers if kinds[i] == kind)
            cp_kind[kind] = n * m_count * ((passes - 1) * f["sent_fwd"] + f["sent_bwd"])
    out = {"tp": tp, "tp_grad_sync": tp_sync, "ep": ep, "ep_replicas_max": ep_replicas_max, "dp": dp_dense + dp_expert,
           "pp": pp, "qb": qb["comm"], "cp": cp_kind["kda"] + cp_kind["mla"],
           "cp_kda": cp_kind["kda"], "cp_mla": cp_kind["mla"],
           "dp_dense": dp_dense, "dp_expert": dp_expert, "qb_tp": qb["comm_tp"], "qb_dp": qb["comm_dp"],
           "micro_batches": m_count, "stage": stage}
    if pc.vision_fraction > 0:
        out["tp_vision"] = tp_vision
    return out


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


def stage_time(cfg: ModelConfig, pc: PlanConfig, hw, stage: int, comm: dict, bubble: float) -> dict:
    """Seconds of one step as seen from pipeline stage ``stage`` (module docstring)."""
    per, head = layer_flops_per_token(cfg, pc.seq_len)
    layers = _stage_layer_list(cfg, pc, stage)
    fwd_layers = sum(per[i] for i in layers)
    fwd_head = head if stage == pc.pp - 1 else 0.0
    if pc.cp > 1 and pc.cp_balance:  # even score work; each query block re-expands its key prefix
        kinds = cfg.layer_kinds()
        n_mla = sum(1 for i in layers if kinds[i] == "mla")
        m = cfg.mla
        expand = 2 * m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)  # per key
        # x 4/3: the forward expansion, its re-expansion in backward and that one's backward (2x)
        fwd_layers += n_mla * expand * ((pc.cp * pc.cp_balance_split + 1) / 2 - 1) * 4 / 3
    elif pc.cp > 1:  # contiguous placement: the last CP rank does (2cp - 1) / cp x the average MLA score work
        kinds = cfg.layer_kinds()
        n_mla = sum(1 for i in layers if kinds[i] == "mla")
        fwd_layers += n_mla * _mla_scores(cfg, pc.seq_len) * ((2 * pc.cp - 1) / pc.cp - 1)
    train = 3.0 * (fwd_layers + fwd_head) + (fwd_layers if pc.activation_checkpointing else 0.0)
    tokens_step = pc.global_batch_size * pc.seq_len
    compute = train * tokens_step / (pc.world_size // pc.pp) / (hw.peak_flops(pc.precision) * hw.mfu)
    vis = vision_figures(cfg, pc) if stage == 0 else {}
    if vis:  # the tower (3 x forward + its blocks' recompute), its images spread over the stage's tp x dp ranks
        vision_s = vis["train_flops_per_step"] / (pc.world_size // pc.pp) / (hw.peak_flops(pc.precision) * hw.mfu)
        compute += vision_s
    # rank order tp fastest, then ep / dp, pp last (parallel/grid.py default 'tp-cp-ep-dp-pp'); the
    # expert grid (etp = 1) puts ep fastest
    t_tp = comm["tp"] / _link(pc.tp, hw)
    t_sync = comm["tp_grad_sync"] / _link(pc.tp, hw)
    t_ep = comm["ep"] / _link(pc.ep, hw)
    t_cp = comm["cp"] / _link(pc.tp * pc.cp, hw) if pc.cp > 1 else 0.0
    expert_span = pc.ep * pc.edp if pc.ep > 1 else pc.tp * pc.dp_cp
    t_dp = (comm["dp_dense"] / _link(pc.tp * pc.dp_cp, hw) + comm["dp_expert"] / _link(expert_span, hw)) \
        * (1 - pc.dp_overlap)
    t_qb = comm["qb_tp"] / _link(pc.tp, hw) + comm["qb_dp"] / _link(pc.tp * pc.dp_cp, hw)
    t_pp = comm["pp"] / _link(pc.world_size, hw) if pc.pp > 1 else 0.0
    step = (compute + t_tp + t_ep + t_cp + t_pp) * bubble + t_sync + t_dp + t_qb
    if pc.offload == "cpu":  # HostAdamW.step: copies out, host update, copy back, in sequence after backward
        off = _param_memory(cfg, pc, layers, stage == 0, stage == pc.pp - 1)
        t_off = off["pcie_bytes_per_step"] / hw.pcie_bw + off["host_update_bytes_per_step"] / hw.host_mem_bw
        step += t_off
    out = {"stage": stage, "compute_s": compute, "tp_s": t_tp, "ep_s": t_ep, "cp_s": t_cp, "pp_s": t_pp,
           "bubble": bubble,
           "tp_grad_sync_s": t_sync, "dp_exposed_s": t_dp, "qb_s": t_qb, "step_s": step}
    if pc.offload == "cpu":
        out["offload_s"] = t_off
    if pc.vision_fraction > 0:
        out["vision_compute_s"] = vision_s if vis else 0.0
    return out
