"""Analytic per-rank memory, FLOPs per token, communication per step and step time of a layout.

    plan = make_plan(model_cfg, PlanConfig(tp=8, pp=16, ep=64, world_size=2048), hw=load_hardware("h200"))
    plan["memory"]["total"], plan["time"]["step_s"], plan["fits"]
    search(model_cfg, 2048, hw)          # the fitting layouts, fastest first (tools/plan.py --search)
    min_gpus(model_cfg, hw)              # the smallest world size where some layout fits (--min-gpus)
    per_rank_figures(model_cfg, pc, "middle")   # exact params / grads / optimizer / checkpoint bytes

Batch: a plan, a search and min_gpus all assume the same global batch when none is given,
default_global_batch(): ~4 Mi tokens per step (1024 x 4096), rounded up to whole micro-batch rounds.
Stages: the trainer's partition (parallel/pipeline/partition.rank_chunks: cost-balanced, cuts at
AttnRes block starts unless parallel.pp_split_blocks, which the plan turns on when pp x vp needs it).

Memory per rank (bytes; the rank of the pipeline stage that needs the most), as the trainer keeps it:
  params     the rank's TP shard of dense weights + its EP share of routed experts, in param_dtype
             (fp32 as the trainer runs: bf16 autocast over fp32 master weights)
  grads      one gradient per local param (param dtype), accumulated over the step's micro-batches
  main       fp32 main copies of the params this rank OWNS under ZeRO-1 (0 when params are fp32:
             parallel/data_parallel.py then uses the param itself as the main copy)
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
  comm       ZeRO-1 bucket (fp32 reduce-scatter buffer of dp segments, parallel/data_parallel.py)
  backward transient: the largest single module's saved bytes again (its input gradients)
  peak       params + main + optimizer + QB stats + MoonEP replica buffers + comm + the working set:
             activations (+ grads when the step accumulates several micro-batches; with one, grads
             appear as activations are freed, so the larger of the two counts), or the exact QB
             gather after the step

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

Images (PlanConfig.vision_fraction = data.vision_fraction, image_side; 0 = text only: the plan is
exactly the text plan, no vision keys). vision_fraction of every row's tokens are <|media|> tokens
of square images of image_side px (default the position grid: 64 x 64 patches, 1024 tokens at K3);
vision_figures() has the load. The tower runs in stage 0's forward; under activation checkpointing
its blocks are recomputed like the decoder layers (VisionTower.recompute, set with K3Model.recompute),
so each keeps only its input. Stage 0 keeps, for every micro-batch in
flight, ceil(images per micro-batch / tp) whole images' saved tensors (TP round robin,
parallel/tensor_parallel/image_split.py) -- vision_activation_bytes(), linear in the patches (the
tower's attention runs a fused SDPA kernel: no [H, N, N] scores are kept) -- and its largest block
of one image as a backward transient. Step time: stage 0's compute
+ 3 x the tower's forward FLOPs of the step (+ the blocks' forward again when recomputed) over the stage's ranks; its TP traffic
+ the all-gather of the merged tokens ((tp-1)/tp x vision tokens x hidden x activation bytes per
micro-batch, forward only). MFU counts the tower's FLOPs. Images under CP are refused (as the
trainer does).

Optimizer offload (PlanConfig.offload = optim.offload; 'none' plans exactly as before): with 'cpu'
the AdamW moments of the owned AdamW elements leave the device (8 B each); host memory holds them and
the fp32 weight/gradient copies the update runs on (16 B each); every step copies 12 B each over
PCIe (hardware pcie_bw) and streams 28 B each through host memory (host_mem_bw), in sequence after
the backward (megak3/optim/offload.py does not overlap them). Muon stays on the device. offload_figures().

Context parallelism (parallel.cp, parallel/context_parallel.py; cp = 1 plans exactly as before):
  layout     world = tp x cp x dp x pp; every CP rank of a group holds the same rows' contiguous
             segment of seq_len / cp tokens (seq_len divisible by cp, by cp x tp under SP, and
             seq_len / cp >= the KDA conv halo); the global batch is a multiple of micro-batch x dp
             (not cp). Dense gradients, ZeRO-1 ownership, checkpoint savers and QB statistics are
             over dp x cp; routed experts fold over cp x dp (edp = world / (pp ep)).
  tokens     every per-rank token count (activations, kept layer inputs, TP / EP / PP traffic,
             MoonEP buffers, QB margins) is the micro-batch's mbs x seq_len / cp (/ tp under SP).
  KDA layer  (cp_layer_figures) the coefficients' activations of the local tokens; on ranks > 0
             the local pass runs on [v | 0_K] from [0 | I] (megak3/ops/kda_cp.py), which adds the
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
DEFAULT_STEP_TOKENS = 1024 * 4096
"""tokens per optimizer step a plan assumes when train.global_batch_size is not given (4 Mi)"""

QB_AUTO_EXACT_LIMIT = 64 * 2 ** 20
"""qb_method='auto': exact margins while tokens_per_step x num_experts x 4 B stays within this"""
QB_METHODS = ("auto", "exact", "histogram")
"""values of model.moe.qb_method (megak3.model.balancing.QB_METHODS; restated: the planner runs without the model)"""


def default_global_batch(seq_len: int, micro_batch_size: int, dp: int, pp: int = 1,
                         pp_schedule: str = "1f1b") -> int:
    """The global batch (sequences) every plan and search assumes when none is given: the smallest
    multiple of micro_batch_size x dp (x pp under interleaved_1f1b, which needs whole rounds) that
    holds at least DEFAULT_STEP_TOKENS tokens (1024 sequences of 4096 tokens)."""
    unit = micro_batch_size * dp * (pp if pp_schedule == "interleaved_1f1b" else 1)
    want = max(1, -(-DEFAULT_STEP_TOKENS // seq_len))
    return -(-want // unit) * unit


@dataclass
class PlanConfig:
    """What to plan: layout degrees, batch shape, precision, checkpointing, hardware."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 0
    """0: world_size / (tp * cp * pp)"""
    cp: int = 1
    """parallel.cp: context-parallel degree (each sequence split into cp contiguous segments)"""
    cp_balance: bool = False
    """parallel.cp_balance: MLA's balanced schedule (query blocks moved, K/V expanded per key block)"""
    cp_balance_split: int = 2
    """parallel.cp_balance_split: query blocks per CP rank under cp_balance"""
    world_size: int = 1
    sequence_parallel: bool = True
    """SP under tp > 1 (the trainer's EP x TP layouts require it)"""
    micro_batch_size: int = 1
    seq_len: int = 4096
    global_batch_size: int = 0
    """sequences per step; 0: default_global_batch() (~4 Mi tokens, whatever the layout)"""
    precision: str = "bf16"
    """activation dtype: 'bf16' (autocast) or 'fp32'"""
    param_dtype: str = "fp32"
    """'fp32' (the trainer: fp32 params = main copies) or 'bf16' (bf16 params + fp32 owned main copies)"""
    activation_checkpointing: bool = True
    pp_schedule: str = "1f1b"
    """parallel.pp_schedule: afab, 1f1b, interleaved_1f1b or zb_h1 (parallel/pipeline/schedules.py)"""
    vp: int = 1
    """parallel.vp: model chunks per pipeline rank (interleaved_1f1b)"""
    pp_split_blocks: Optional[bool] = None
    """parallel.pp_split_blocks; None: only when pp x vp exceeds the AttnRes block starts"""
    pp_layout: Optional[tuple] = None
    """parallel.pp_layout: explicit layers per model chunk; None: balanced as the trainer does"""
    moonep: bool = True
    """moonep.enabled (used when ep > 1): MoonEP with replica slots; False: the baseline dispatcher
    (home experts only: no replica buffers or traffic)"""
    max_replicas_per_rank: int = 0
    """moonep.max_replicas_per_rank: replica slots M per EP rank; 0 = num_experts / ep"""
    qb_method: str = ""
    """'' = model.moe.qb_method; 'auto' | 'exact' | 'histogram' (anything else: ValueError)"""
    qb_bins: int = 0
    """0 = model.moe.qb_bins (4096 when the config has none)"""
    bucket_bytes: int = 40 * 2 ** 20
    dp_overlap: float = 0.8
    """fraction of the ZeRO-1 reduce-scatter / all-gather hidden behind compute"""
    global_batch_default: bool = False
    """set by resolved(): the global batch came from default_global_batch()"""
    vision_fraction: float = 0.0
    """data.vision_fraction: share of every sequence's tokens that are <|media|> vision tokens (0: text
    only, the plan is exactly the text plan); the tower's activations, FLOPs and TP gather follow from it"""
    image_side: int = 0
    """data.image_side: side in pixels of the (square) images assumed; 0 = the position grid's
    pos_grid x patch_size (896 px, 64 x 64 patches, 1024 LM tokens at K3)"""
    offload: str = "none"
    """optim.offload: 'none' or 'cpu' (the AdamW state and update in host memory, megak3/optim/offload.py)"""

    def resolved(self) -> "PlanConfig":
        for f in ("tp", "pp", "ep", "cp", "vp", "world_size", "micro_batch_size", "seq_len"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{f}={v!r} must be an integer >= 1" if f in ("tp", "pp", "ep", "cp", "vp")
                                 else f"{f}={v!r} must be an integer >= 1")
        m = self.max_replicas_per_rank
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"moonep.max_replicas_per_rank={m!r} must be an integer >= 0 (0 = num_experts / ep)")
        f = self.vision_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            raise ValueError(f"data.vision_fraction={f!r} must be a number in [0, 1]")
        if isinstance(self.image_side, bool) or not isinstance(self.image_side, int) or self.image_side < 0:
            raise ValueError(f"data.image_side={self.image_side!r} must be an integer >= 0 (0 = the position grid)")
        if self.qb_method not in ("",) + QB_METHODS:
            raise ValueError(f"model.moe.qb_method={self.qb_method!r}: choose one of {', '.join(QB_METHODS)}")
        if self.precision not in ("bf16", "fp32"):
            raise ValueError(f"precision={self.precision!r} must be 'bf16' or 'fp32'")
        if self.param_dtype not in ("bf16", "fp32"):
            raise ValueError(f"param_dtype={self.param_dtype!r} must be 'bf16' or 'fp32'")
        if self.offload not in ("none", "cpu"):
            raise ValueError(f"optim.offload={self.offload!r} must be 'none' or 'cpu'")
        model = self.tp * self.cp * self.pp
        axes = "tp*cp*pp" if self.cp > 1 else "tp*pp"
        if self.world_size % model:
            raise ValueError(f"parallel.{axes} = {model} does not divide world_size={self.world_size}")
        dp = self.dp or self.world_size // model
        if dp * model != self.world_size:
            raise ValueError(f"parallel.{axes}*dp = {model}*{dp} must equal world_size={self.world_size}")
        if (self.world_size // self.pp) % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide world_size/pp = {self.world_size // self.pp}")
        sp = self.sequence_parallel and self.tp > 1
        if self.ep > 1 and self.tp > 1 and not sp:
            raise ValueError(f"parallel.ep={self.ep} with parallel.tp={self.tp} needs "
                             "parallel.sequence_parallel=true")
        if self.cp > 1:
            from parallel.context_parallel import check_context_parallel

            check_context_parallel(self.cp, self.tp, sp, self.seq_len,
                                   balance_split=self.cp_balance_split if self.cp_balance else 0)
        if sp and self.seq_len % self.tp:
            raise ValueError(f"data.seq_len={self.seq_len} must be a multiple of parallel.tp={self.tp} under "
                             "sequence parallelism")
        default = not self.global_batch_size
        gbs = self.global_batch_size or default_global_batch(self.seq_len, self.micro_batch_size, dp, self.pp,
                                                             self.pp_schedule)
        if gbs % (self.micro_batch_size * dp):
            raise ValueError(f"global_batch_size={gbs} must be a multiple of micro_batch_size x dp = "
                             f"{self.micro_batch_size} x {dp}")
        from parallel.pipeline.schedules import check_schedule

        check_schedule(self.pp_schedule, self.pp, self.vp, gbs // (self.micro_batch_size * dp) if self.pp > 1
                       else None)
        layout = tuple(self.pp_layout) if self.pp_layout is not None else None
        return replace(self, dp=dp, global_batch_size=gbs, sequence_parallel=sp, pp_layout=layout,
                       global_batch_default=default or self.global_batch_default)

    @property
    def edp(self) -> int:
        return self.world_size // (self.pp * self.ep)

    @property
    def dp_cp(self) -> int:
        """The dense gradient / ZeRO-1 / QB group: dp x cp (ParallelState.dp_cp_group)."""
        return self.dp * self.cp

    @property
    def local_tokens(self) -> float:
        """Tokens of one micro-batch on a rank outside TP regions' SP split: mbs x seq_len / cp."""
        return self.micro_batch_size * self.seq_len / self.cp

    @property
    def expert_dp(self) -> int:
        """The ZeRO-1 / gradient group of the routed experts: edp under EP (spans cp); without EP the
        trainer keeps them on the dense dp x cp group (every TP rank holds all experts)."""
        return self.edp if self.ep > 1 else self.dp_cp

    @property
    def micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


_VALID: Dict[tuple, Optional[str]] = {}


def check_model(cfg: ModelConfig, pc: PlanConfig) -> None:
    """The divisibility the layout needs (as parallel/grid.validate_layout) and a stage partition."""
    from parallel.grid import Layout, validate_layout

    key = (_key(cfg), pc.world_size, pc.tp, pc.cp, pc.dp, pc.pp, pc.ep)
    if key not in _VALID:  # (a search asks for the same layout once per micro-batch size)
        try:
            validate_layout(Layout(world_size=pc.world_size, tp=pc.tp, cp=pc.cp, dp=pc.dp, pp=pc.pp, ep=pc.ep), cfg)
            _VALID[key] = None
        except ValueError as e:
            _VALID[key] = str(e)
    if _VALID[key] is not None:
        raise ValueError(_VALID[key])
    if pc.cp > 1:
        from parallel.context_parallel import check_context_parallel

        check_context_parallel(pc.cp, pc.tp, pc.sequence_parallel, pc.seq_len, cfg,
                               balance_split=pc.cp_balance_split if pc.cp_balance else 0)
    if pc.ep > 1 and pc.moonep:
        from moonep.config import MoonEPConfig

        MoonEPConfig(max_replicas_per_rank=pc.max_replicas_per_rank).validate(cfg.moe.num_experts, pc.ep)
    if pc.pp > 1:
        _chunks(cfg, pc)
    if pc.vision_fraction > 0:
        vision_image(cfg, pc)


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


def _tp_partial(name: str, sequence_parallel: bool) -> bool:
    """Replicated params whose gradients parallelize.sync_partial_grads sums over TP (tp > 1)."""
    if name.startswith("vision."):      # each TP rank encodes its share of the images
        return True
    if _tp_sharded(name):
        return False
    if ".self_attn." in name:           # replicated inside a TP region, feeding sharded heads
        return True
    return sequence_parallel            # applied to sequence-sharded tokens


_INVENTORY: Dict[str, tuple] = {}
_BUFFERS: Dict[str, tuple] = {}
_KEYS: Dict[int, tuple] = {}


def _key(cfg: ModelConfig) -> str:
    """A cache key of a model config (its repr, memoised per object: the search asks thousands of times)."""
    hit = _KEYS.get(id(cfg))
    if hit is None or hit[0] is not cfg:
        hit = _KEYS[id(cfg)] = (cfg, repr(cfg))
    return hit[1]


def _where(name: str) -> int:
    if name.startswith("layers."):
        return int(name.split(".")[1])
    if name.startswith(("embed_tokens.", "vision.")):
        return -1
    return -2


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
        out.append((name, p.numel(), _where(name), _tp_sharded(name), ".mlp.experts." in name,
                    opt.get(name, "adamw")))
    params = {n for n, _ in model.named_parameters()}
    _BUFFERS[_key(cfg)] = tuple((n, t.numel(), _where(n), t.element_size())
                                for n, t in model.state_dict().items() if n not in params)
    return tuple(out)


def inventory(cfg: ModelConfig) -> tuple:
    """Every parameter of the single-process model, in ``named_parameters()`` order (the order the
    trainer's optimizer specs and ZeRO-1 ownership use): (name, numel, where, tp_sharded, expert,
    optimizer); where = decoder layer index, -1 embedding/vision (first stage), -2 output (last)."""
    key = _key(cfg)
    if key not in _INVENTORY:
        _INVENTORY[key] = _inventory(cfg)
    return _INVENTORY[key]


def buffer_inventory(cfg: ModelConfig) -> tuple:
    """The persistent buffers of the model's state_dict: (name, numel, where, element size)."""
    inventory(cfg)
    return _BUFFERS[_key(cfg)]


def stage_layers(num_layers: int, pp: int) -> List[range]:
    """An even split (the first num_layers % pp stages one layer more). Not what the trainer runs:
    see stage_chunks (parallel/pipeline/partition.py balances by cost at AttnRes block starts)."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def split_blocks(cfg: ModelConfig, pc: PlanConfig) -> bool:
    """parallel.pp_split_blocks as planned: the given value, else whether pp x vp model chunks
    (or the given pp_layout) need a stage boundary inside an AttnRes block."""
    if pc.pp_split_blocks is not None:
        return bool(pc.pp_split_blocks)
    bs = cfg.attn_res_block_size
    if pc.pp_layout is not None:
        starts = [sum(pc.pp_layout[:i]) for i in range(1, len(pc.pp_layout))]
        return any(s % bs for s in starts)
    block_starts = len([i for i in range(1, cfg.num_layers) if i % bs == 0])
    return pc.pp * pc.vp - 1 > block_starts


_PARTS: Dict[tuple, tuple] = {}


def _chunks(cfg: ModelConfig, pc: PlanConfig) -> tuple:
    """All pp x vp model chunks in virtual-stage order, as the trainer cuts them."""
    from parallel.pipeline.partition import partition_layers

    split = split_blocks(cfg, pc)
    key = (_key(cfg), pc.pp * pc.vp, pc.pp_layout, split)
    if key not in _PARTS:
        name = "parallel.pp" if pc.vp == 1 else f"parallel.pp * parallel.vp = {pc.pp} * {pc.vp}, chunks"
        _PARTS[key] = tuple(partition_layers(cfg, pc.pp * pc.vp, pc.pp_layout, split, name))
    return _PARTS[key]


def stage_chunks(cfg: ModelConfig, pc: PlanConfig, stage: int) -> List[range]:
    """The layer ranges pipeline rank ``stage`` holds: parallel/pipeline/partition.rank_chunks."""
    if pc.pp == 1:
        return [range(cfg.num_layers)]
    ch = _chunks(cfg, pc)
    return [ch[c * pc.pp + stage] for c in range(pc.vp)]


def _stage_layer_list(cfg: ModelConfig, pc: PlanConfig, stage: int) -> List[int]:
    return sorted(i for r in stage_chunks(cfg, pc, stage) for i in r)


_AGG: Dict[str, dict] = {}


def _aggregate(cfg: ModelConfig) -> dict:
    """Per place (layer index, -1, -2): {(tp_sharded, expert, optimizer): numel} and the numel of
    the replicated params whose gradients TP sums (cached per config): 'partial_attn' (inside the
    attention region: always when tp > 1), 'partial_sp' / 'partial_sp_expert' (under SP; experts only
    when they are not EP-sharded)."""
    key = _key(cfg)
    if key not in _AGG:
        agg: dict = {}
        for name, n, where, tp_sh, is_exp, opt in inventory(cfg):
            w = agg.setdefault(where, {"numel": {}, "partial_attn": 0, "partial_sp": 0, "partial_sp_expert": 0})
            k = (tp_sh, is_exp, opt)
            w["numel"][k] = w["numel"].get(k, 0) + n
            if _tp_partial(name, False):
                w["partial_attn"] += n
            elif _tp_partial(name, True):
                w["partial_sp_expert" if is_exp else "partial_sp"] += n
        _AGG[key] = agg
    return _AGG[key]


def _places(cfg: ModelConfig, layers, first: bool, last: bool) -> list:
    agg = _aggregate(cfg)
    out = [agg[i] for i in layers if i in agg]
    if first and -1 in agg:
        out.append(agg[-1])
    if last and -2 in agg:
        out.append(agg[-2])
    return out


def _on_stage(where: int, layers, first: bool, last: bool) -> bool:
    return where in layers if where >= 0 else (first if where == -1 else last)


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


def _owners(numels: List[int], world: int) -> List[int]:
    """parallel.data_parallel.assign_owners (greedy LPT, ties to the lower index / rank) with a heap."""
    import heapq

    heap = [(0, r) for r in range(world)]
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + numels[i], r))
    return owner


def _stage_index(stage, pp: int) -> int:
    if isinstance(stage, str):
        named = {"first": 0, "middle": pp // 2, "last": pp - 1}
        if stage not in named:
            raise ValueError(f"stage={stage!r}: give an index 0..{pp - 1} or 'first', 'middle', 'last'")
        return named[stage]
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
        raise ValueError(f"stage={stage!r} must be 0..{pp - 1} (parallel.pp={pp})")
    return stage


def per_rank_figures(cfg: ModelConfig, pc: PlanConfig, stage="first", rank_in_stage: int = 0) -> dict:
    """Exact per-rank parameter, gradient, optimizer-state and checkpoint bytes of one rank, counted
    parameter by parameter from the real module tree (meta device) and sharded as the trainer shards:
    TP dims of parallel/parallelize.py (tensor numel / tp), E/ep routed experts per EP rank
    (parallel/expert_parallel.py), the stage's layers of parallel/pipeline/partition.rank_chunks
    (+ embedding/vision on the first, output AttnRes/norm/lm_head on the last stage), ZeRO-1
    whole-parameter ownership of parallel/data_parallel.assign_owners over the rank's params in
    optimizer (named_parameters) order -- dense params over dp, expert shards over edp (a separate
    group); without EP every param is on the dp group -- and the checkpoint shards the trainer writes
    (one saver per distinct shard, plus the optimizer state of the params the rank owns).

    stage: the pipeline rank: an int, 'first' | 'middle' (pp // 2) | 'last', or a coordinates dict
        as parallel.grid.Layout.coords(rank) returns it ({"pp", "tp", "dp", "ep", "edp", ...};
        rank_in_stage is then ignored; under CP its "dp-cp" entry is the dense ZeRO-1 rank).
    rank_in_stage: the rank's index among the world_size / pp ranks of its stage (default 0: the
        saver of every shard it holds). With the default order tp-cp-ep-dp-pp: tp_rank = r % tp,
        dp_rank = r // tp (the rank in the dp x cp group: dense params are owned and saved over
        dp x cp), ep_rank = r % ep, edp_rank = r // ep.

    Returns (counts are elements, *_bytes are bytes; dtypes as the trainer keeps them):
      stage, layers           pipeline rank and its layer ranges [[start, stop], ...]
      tp_rank, dp_rank, ep_rank, edp_rank
      params                  parameter elements this rank holds (TP shards + its E/ep experts)
      dense_params, expert_params   of which dense / routed-expert (EP-sharded when ep > 1) elements
      param_bytes             params x param_dtype size (4 for fp32, 2 for bf16)
      buffer_bytes            persistent buffers of the state_dict (the routers' e_score_correction_bias)
      grad_bytes              one gradient per local param, param dtype (the model's .grad)
      owned_params            elements this rank owns under ZeRO-1 (dense over dp, expert shards over edp)
      owned_muon_params, owned_adamw_params
      optimizer_state_bytes   owned Muon momentum 4 B/elem + AdamW exp_avg + exp_avg_sq 8 B/elem
      main_param_bytes        fp32 main copies of owned params (0 with fp32 params: the param is the copy)
      checkpoint_model_bytes  model tensors (params + buffers) the rank writes: its dense shards when
                              dp_rank == 0, its expert shards when edp_rank == 0 (dp_rank without EP)
      checkpoint_optimizer_bytes  its owned optimizer state tensors (= optimizer_state_bytes; AdamW's
                              scalar 'step' travels as metadata)
      checkpoint_bytes        the sum: tensor bytes this rank writes per checkpoint (after the first step)
      checkpoint_meta_read_bytes  metadata bytes it reads to resume: :func:`checkpoint_meta_read_bytes`
    With ``optim.offload=cpu`` also: optimizer_state_device_bytes (Muon's 4 B/elem) and
    :func:`offload_figures` of the owned AdamW elements (host bytes, PCIe and host-memory bytes per step).
    """
    pc = pc.resolved()
    check_model(cfg, pc)
    per_stage = pc.world_size // pc.pp
    if isinstance(stage, dict):
        s = _stage_index(int(stage.get("pp", 0)), pc.pp)
        tp_rank = int(stage.get("tp", 0))
        dp_rank = int(stage.get("dp-cp", stage.get("dp", 0))) if pc.cp > 1 else int(stage.get("dp", 0))
        ep_rank, edp_rank = int(stage.get("ep", 0)), int(stage.get("edp", 0))
    else:
        s = _stage_index(stage, pc.pp)
        r = rank_in_stage
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < per_stage:
            raise ValueError(f"rank_in_stage={r!r} must be 0..{per_stage - 1} (world_size / pp)")
        tp_rank, dp_rank, ep_rank, edp_rank = r % pc.tp, r // pc.tp, r % pc.ep, r // pc.ep
    layers = set(_stage_layer_list(cfg, pc, s))
    first, last = s == 0, s == pc.pp - 1
    pbytes = 4 if pc.param_dtype == "fp32" else 2
    ep_on = pc.ep > 1
    dense, expert = [], []          # (local numel, optimizer) in named_parameters order
    for _, n, where, tp_sh, is_exp, opt in inventory(cfg):
        if not _on_stage(where, layers, first, last):
            continue
        if is_exp and ep_on:
            expert.append((n // pc.ep, opt))
        else:
            dense.append((n // pc.tp if tp_sh and pc.tp > 1 else n, opt))
    groups = [(dense, pc.dp_cp, dp_rank), (expert, pc.edp, edp_rank)] if ep_on else [(dense, pc.dp_cp, dp_rank)]
    owned = {"muon": 0, "adamw": 0}
    for items, world, rank in groups:
        for (n, opt), o in zip(items, _owners([n for n, _ in items], world)):
            if o == rank:
                owned["muon" if opt == "muon" else "adamw"] += n
    n_dense, n_expert = sum(n for n, _ in dense), sum(n for n, _ in expert)
    buffers = sum(n * es for _, n, where, es in buffer_inventory(cfg) if _on_stage(where, layers, first, last))
    ckpt_model = (n_dense * pbytes + buffers if dp_rank == 0 else 0) + (n_expert * pbytes if edp_rank == 0 else 0)
    state = 4 * owned["muon"] + 8 * owned["adamw"]
    return {"stage": s, "layers": [[c.start, c.stop] for c in stage_chunks(cfg, pc, s)],
            "tp_rank": tp_rank, "dp_rank": dp_rank, "ep_rank": ep_rank, "edp_rank": edp_rank,
            "params": n_dense + n_expert, "dense_params": n_dense, "expert_params": n_expert,
            "param_bytes": (n_dense + n_expert) * pbytes, "buffer_bytes": buffers,
            "grad_bytes": (n_dense + n_expert) * pbytes,
            "owned_params": owned["muon"] + owned["adamw"], "owned_muon_params": owned["muon"],
            "owned_adamw_params": owned["adamw"], "optimizer_state_bytes": state,
            "main_param_bytes": 0 if pc.param_dtype == "fp32" else 4 * (owned["muon"] + owned["adamw"]),
            "checkpoint_model_bytes": ckpt_model, "checkpoint_optimizer_bytes": state,
            "checkpoint_bytes": ckpt_model + state,
            "checkpoint_meta_read_bytes": checkpoint_meta_read_bytes(cfg, pc, layers, first, last),
            **({"optimizer_state_device_bytes": 4 * owned["muon"],
                **offload_figures(owned["adamw"])} if pc.offload == "cpu" else {})}


_SHAPES: Dict[str, dict] = {}


def checkpoint_meta_read_bytes(cfg: ModelConfig, pc: PlanConfig, layers, first: bool, last: bool) -> int:
    """Metadata bytes a rank of the stage (``layers``, first / last) reads to resume from a per-shard
    checkpoint (megak3.checkpoint.key_index.read_bytes): the manifest, index.json (every key of the model)
    and the index parts of the stage's model and optimizer keys; a key's chunks: E/ep pieces of a
    routed expert tensor (ep > 1), tp pieces of a TP-sharded one, else one. Independent of dp, so
    constant in the world size for fixed tp, pp and ep."""
    from ..checkpoint import key_index as shard_index

    key = _key(cfg)
    if key not in _SHAPES:
        import torch

        from ..model.k3 import K3Model

        with torch.device("meta"):
            model = K3Model(cfg)
        _SHAPES[key] = {n.replace(".inner.", "."): tuple(t.shape) for n, t in model.state_dict().items()}
    shapes = _SHAPES[key]
    pbytes = 4 if pc.param_dtype == "fp32" else 2
    keys, object_keys, read = [f"model/{n}" for n in shapes], [], {}
    for name, _, where, tp_sh, is_exp, opt in inventory(cfg):
        n = name.replace(".inner.", ".")
        states = shard_index.optimizer_state_names(opt)
        keys += [f"optim/{n}/{st}" for st in states]
        object_keys.append(f"optim_meta/{n}")
        if _on_stage(where, layers, first, last):
            chunks = pc.ep if is_exp and pc.ep > 1 else (pc.tp if tp_sh and pc.tp > 1 else 1)
            read[f"model/{n}"] = (shapes[n], pbytes, chunks)
            read.update({f"optim/{n}/{st}": (shapes[n], 4, chunks) for st in states})
    for name, _, where, es in buffer_inventory(cfg):
        if _on_stage(where, layers, first, last):
            n = name.replace(".inner.", ".")
            read[f"model/{n}"] = (shapes[n], es, 1)
    return shard_index.read_bytes(keys, read, pc.world_size, object_keys)["total"]


# ---- Quantile Balancing statistics -------------------------------------------------------------
def qb_method(cfg: ModelConfig, pc: PlanConfig) -> str:
    """'exact' or 'histogram': PlanConfig.qb_method, else model.moe.qb_method; 'auto' (and a
    missing value) resolves as the trainer does (megak3.model.balancing.resolve_qb_method):
    the histogram when one layer's gathered margins, global batch x seq_len x num_experts x 4 B,
    exceed 64 MiB, else exact margins. Any other value: ValueError naming the field."""
    m = pc.qb_method or getattr(cfg.moe, "qb_method", "auto")
    if m not in QB_METHODS:
        raise ValueError(f"model.moe.qb_method={m!r}: choose one of {', '.join(QB_METHODS)}")
    if m in ("exact", "histogram"):
        return m
    tokens = pc.global_batch_size * pc.seq_len
    try:
        from ..model.balancing import resolve_qb_method
    except ImportError:  # a trainer without 'auto'
        return "histogram" if tokens * cfg.moe.num_experts * 4 > QB_AUTO_EXACT_LIMIT else "exact"
    return resolve_qb_method("auto", tokens, cfg.moe.num_experts)


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


# ---- activations ------------------------------------------------------------------------------
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
        moved = t * H * (qk + v) * 4                                 # q out, o back (fp32); reversed in backward
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


# ---- vision tower ---------------------------------------------------------------------------------
def vision_image(cfg: ModelConfig, pc: PlanConfig) -> tuple:
    """(h, w) patches of the image a plan assumes: image_side / patch_size a side (square), or the
    position grid (pos_grid x pos_grid) when image_side is 0. Raises ValueError when images cannot
    be planned: the tower disabled, cp > 1 (K3Model.embed refuses images under CP), a side that is
    not a multiple of patch_size x merge, or an image with more LM tokens than a row holds (packing
    never splits an image across rows)."""
    v = cfg.vision
    if not v.enabled:
        raise ValueError(f"data.vision_fraction={pc.vision_fraction} needs model.vision.enabled=true")
    if pc.cp > 1:
        raise ValueError(f"data.vision_fraction={pc.vision_fraction} with parallel.cp={pc.cp}: images under context "
                         "parallelism are not supported (K3Model.embed refuses them); plan image-text data with cp=1")
    side = v.patch_size * v.merge
    if pc.image_side:
        if pc.image_side % side:
            raise ValueError(f"data.image_side={pc.image_side} must be a multiple of patch_size x merge = {side} "
                             "(the preprocessor snaps images to that grid)")
        h = w = pc.image_side // v.patch_size
    else:
        h = w = v.pos_grid
    tokens = (h // v.merge) * (w // v.merge)
    if tokens > pc.seq_len:
        raise ValueError(f"an image of {h} x {w} patches is {tokens} LM tokens, more than data.seq_len={pc.seq_len}; "
                         "use a smaller data.image_side")
    return h, w


def vision_block_flops_per_patch(cfg: ModelConfig, patches: int) -> float:
    """The blocks' share of :func:`vision_flops_per_patch` (what recomputation reruns):
    2 x (qkv, proj, fc1, fc2 weights) + 4 x qkv width x patches, per layer."""
    v = cfg.vision
    qkv = v.num_heads * v.head_dim
    return v.num_layers * (2.0 * (4 * v.hidden_size * qkv + 2 * v.hidden_size * v.intermediate_size)
                           + 4.0 * qkv * patches)


def vision_flops_per_patch(cfg: ModelConfig, patches: int) -> float:
    """Forward FLOPs of the tower per patch of an image of ``patches`` patches: 2 x its GEMM weights
    (patch embedding, qkv, proj, fc1, fc2; the merger once per merge^2 patches; no FLOPs for the
    position table) + QK^T and AV over the image's patches, 4 x layers x qkv width x patches.
    Equals torch's FLOP counter on the tower (tests/test_vision_parallel.py)."""
    v = cfg.vision
    D, qkv, m2 = v.hidden_size, v.num_heads * v.head_dim, v.merge ** 2
    gemm = (v.in_channels * v.patch_size ** 2 * D                    # patch embedding
            + v.num_layers * (4 * D * qkv + 2 * D * v.intermediate_size)  # qkv, proj, fc1, fc2
            + (m2 * D * v.projector_hidden + v.projector_hidden * cfg.hidden_size) / m2)  # merger: 1 per m^2
    return 2.0 * gemm + 4.0 * v.num_layers * qkv * patches


def vision_activation_bytes(cfg: ModelConfig, h: int, w: int, precision: str = "bf16",
                            param_dtype: str = "fp32", recompute: bool = False) -> dict:
    """Bytes the tower saves for backward for ONE image of h x w patches, as megak3/model/vision.py
    runs it (counted from its autograd graph; tests/test_plan_vision.py measures them). Per patch
    (N = h w, D width, Q = heads x head_dim, I MLP width, P projector width, m merge; r = residual
    stream bytes: 4 with fp32 params, since the fp32 pos_embed promotes it; l = bytes of Linear
    inputs and GELU in/out: 2 under bf16 autocast, else 4):
      patch embedding  C p^2 l             the patchified copy (Linear input)
      each block       2 x RMSNorm (4D fp32 input + rD normalised + 4 B rstd) + 2 x D l (qkv, fc1 inputs)
                       + Q l (proj input) + 2 I l (GELU input and output)
                       + attention: SDPA gets 4-D [1, H, N, K] q/k/v, so a fused kernel runs (CPU
                         flash; on CUDA flash / memory-efficient), which saves q, k, v (views of the
                         qkv output: 3Q l), the output (the proj input above: its [N, H, K] layout
                         makes the reshape a view) and the fp32 logsumexp (H x 4) -- linear in N.
                         (Before the tower passed 4-D inputs, the math path kept an fp32 [H, N, N]
                         softmax: 5.3 MB per patch of a 64 x 64-patch image at K3.)
      final norm       4D + rD + 4
      merger           (4D + rD + lD) per patch (its norm on the merged copy, fc1 input) + (4 + 2 P l) / m^2
    The merged tokens, the TP gather and the splice save nothing of size. ``recompute`` (the tower's
    blocks rerun in backward: megak3/model/vision.py under ``K3Model.recompute`` != 'none'): each
    block keeps only its input (r D per patch) instead of the terms above. Returns per_patch,
    per_block (one block, the whole image: the largest single module, also what one block's
    recomputation holds at once) and total."""
    v = cfg.vision
    N, D, Q, I = h * w, v.hidden_size, v.num_heads * v.head_dim, v.intermediate_size
    m2, P = v.merge ** 2, v.projector_hidden
    lin = 2 if precision == "bf16" or param_dtype == "bf16" else 4
    res = 4 if param_dtype == "fp32" else 2
    norm = 4 * D + res * D + 4
    block = 2 * (norm + D * lin) + Q * lin + 2 * I * lin + 3 * Q * lin + v.num_heads * 4
    per_patch = (v.in_channels * v.patch_size ** 2 * lin + v.num_layers * (res * D if recompute else block) + norm
                 + 4 * D + res * D + lin * D + (4 + 2 * P * lin) / m2)
    return {"per_patch": float(per_patch), "per_block": float(block * N), "total": float(per_patch * N)}


def vision_figures(cfg: ModelConfig, pc: PlanConfig) -> dict:
    """The vision tower's load, memory, FLOPs and traffic in a plan with pc.vision_fraction > 0
    ({} otherwise). The tower runs in the first pipeline stage's forward (K3Model.embed); with
    activation checkpointing its blocks are recomputed like the decoder layers (each keeps its input;
    training = 3 x forward + the blocks' forward again), without it they keep everything (3 x
    forward). Its saved tensors stay for every micro-batch in flight on stage 0. Under TP a
    rank encodes images r, r + tp, ... of its micro-batch and the merged tokens are all-gathered
    (parallel/tensor_parallel/image_split.py); DP ranks get their rows' images.

    images_per_micro_batch: vision_fraction x mbs x seq_len / tokens_per_image (a mean, may be < 1);
    images_per_rank: ceil(images_per_micro_batch / tp), whole images -- a micro-batch that holds an
    image holds all of it, and round robin gives the first TP ranks the extra one -- so the memory is
    that of the worst rank; activations_per_micro_batch: images_per_rank x vision_activation_bytes;
    train_flops_per_step: 3 x patches of the step x vision_flops_per_patch (spread over the stage's
    ranks in the step time: round robin balances by count); gather_bytes_per_micro_batch: what one
    rank sends in the token all-gather, (tp-1)/tp x vision tokens x text width x activation bytes."""
    if not pc.vision_fraction:
        return {}
    v = cfg.vision
    h, w = vision_image(cfg, pc)
    patches = h * w
    tokens_img = (h // v.merge) * (w // v.merge)
    vis_tokens_mb = pc.vision_fraction * pc.micro_batch_size * pc.seq_len
    images_mb = vis_tokens_mb / tokens_img
    images_rank = math.ceil(images_mb / pc.tp - 1e-9)
    act = vision_activation_bytes(cfg, h, w, pc.precision, pc.param_dtype, pc.activation_checkpointing)
    a = 2 if pc.precision == "bf16" else 4
    tokens_step = pc.global_batch_size * pc.seq_len
    fwd = vision_flops_per_patch(cfg, patches)
    train = 3.0 * fwd + (vision_block_flops_per_patch(cfg, patches) if pc.activation_checkpointing else 0.0)
    return {"fraction": pc.vision_fraction, "image_patches": [h, w], "image_side": h * v.patch_size,
            "patches_per_image": patches, "tokens_per_image": tokens_img,
            "vision_tokens_per_micro_batch": vis_tokens_mb, "images_per_micro_batch": images_mb,
            "images_per_rank": images_rank, "images_per_step": pc.vision_fraction * tokens_step / tokens_img,
            "vision_tokens_per_step": pc.vision_fraction * tokens_step,
            "flops_per_patch_forward": fwd,
            "train_flops_per_step": train * pc.vision_fraction * tokens_step * v.merge ** 2,
            "activation_bytes_per_image": act["total"],
            "activation_bytes_per_patch": act["total"] / patches, "block_bytes_per_image": act["per_block"],
            "activations_per_micro_batch": images_rank * act["total"],
            "gather_bytes_per_micro_batch": _ring(pc.tp) * vis_tokens_mb * cfg.hidden_size * a}


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


# ---- FLOPs ------------------------------------------------------------------------------------
_COUNTS: Dict[str, dict] = {}


def _counts(cfg: ModelConfig) -> dict:
    from ..model.param_count import count_parameters

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


# ---- communication and time ----------------------------------------------------------------------
def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


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


def trainer_overrides(pc: PlanConfig, split: bool = False) -> str:
    """The trainer's command-line overrides for this layout and batch."""
    out = [f"parallel.tp={pc.tp}", f"parallel.pp={pc.pp}", f"parallel.ep={pc.ep}"]
    if pc.cp > 1:
        out.append(f"parallel.cp={pc.cp}")
    if pc.tp > 1:
        out.append(f"parallel.sequence_parallel={str(pc.sequence_parallel).lower()}")
    if pc.pp > 1 and pc.pp_schedule != "1f1b":
        out.append(f"parallel.pp_schedule={pc.pp_schedule}")
    if pc.vp > 1:
        out.append(f"parallel.vp={pc.vp}")
    if split:
        out.append("parallel.pp_split_blocks=true")
    out += [f"train.micro_batch_size={pc.micro_batch_size}", f"train.global_batch_size={pc.global_batch_size}",
            f"data.seq_len={pc.seq_len}"]
    if not pc.activation_checkpointing:
        out.append("train.activation_checkpointing=false")
    if pc.offload == "cpu":
        out.append("optim.offload=cpu")
    if pc.cp > 1 and pc.cp_balance:
        out.append(f"parallel.cp_balance=true parallel.cp_balance_split={pc.cp_balance_split}")
    return " ".join(out)


def make_plan(cfg: ModelConfig, pc: PlanConfig, hw) -> dict:
    """Memory (worst stage), FLOPs, comm and step time (heaviest stage), fits -- see the module docstring."""
    pc = pc.resolved()
    check_model(cfg, pc)
    stages = [stage_memory(cfg, pc, s) for s in range(pc.pp)]
    worst = max(stages, key=lambda s: s["total"])
    m = pc.micro_batches
    bubble = bubble_factor(pc, m)
    comms = [comm_per_step(cfg, pc, s) for s in range(pc.pp)]
    times = [stage_time(cfg, pc, hw, s, comms[s], bubble) for s in range(pc.pp)]
    slow = max(range(pc.pp), key=lambda s: times[s]["step_s"])
    comm, t = comms[slow], dict(times[slow])
    fl = flops_per_token(cfg, pc.seq_len)
    tokens_step = pc.global_batch_size * pc.seq_len
    step = t["step_s"]
    vis = vision_figures(cfg, pc)
    model_flops = fl["train"] * tokens_step + (vis["train_flops_per_step"] if vis else 0.0)
    t.update(tokens_per_s=tokens_step / step, mfu=model_flops / pc.world_size / step / hw.peak_flops(pc.precision))
    usable = hw.memory_bytes * hw.usable_memory_fraction
    split = pc.pp > 1 and split_blocks(cfg, pc)
    out = {
        "layout": {"tp": pc.tp, "pp": pc.pp, "ep": pc.ep, "cp": pc.cp, "dp": pc.dp, "edp": pc.edp,
                   "world_size": pc.world_size,
                   "sequence_parallel": pc.sequence_parallel, "micro_batch_size": pc.micro_batch_size,
                   "seq_len": pc.seq_len, "global_batch_size": pc.global_batch_size,
                   "global_batch_default": pc.global_batch_default, "tokens_per_step": tokens_step,
                   "micro_batches": m, "activation_checkpointing": pc.activation_checkpointing,
                   "pp_schedule": pc.pp_schedule, "vp": pc.vp, "pp_split_blocks": split,
                   "stage_layers": [s["layers"] for s in stages],
                   "precision": pc.precision, "param_dtype": pc.param_dtype, "qb_method": qb_method(cfg, pc),
                   **({"offload": pc.offload} if pc.offload != "none" else {}),
                   **({"cp_balance": True, "cp_balance_split": pc.cp_balance_split} if pc.cp_balance else {})},
        "hardware": hw.name,
        "memory": worst, "stages": stages,
        "flops_per_token": fl,
        "comm_bytes_per_step": {k: comm[k] for k in ("tp", "tp_grad_sync", "ep", "ep_replicas_max", "cp", "dp", "pp",
                                                     "qb")},
        "cp_comm_bytes_per_step": {"kda": comm["cp_kda"], "mla": comm["cp_mla"]},
        "comm_stage": slow,
        "time": t, "stage_step_s": [x["step_s"] for x in times],
        "fits": worst["total"] <= usable, "usable_memory": usable,
        "trainer_overrides": trainer_overrides(pc, split),
    }
    if vis:  # only with data.vision_fraction > 0: text-only plans are exactly as before
        out["vision"] = {**vis, "images_per_s": vis["images_per_step"] / step,
                         "activations_stage0": stages[0]["vision_activations"],
                         "compute_s": times[0]["vision_compute_s"],
                         "gather_bytes_per_step": comms[0]["tp_vision"]}
    return out


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


_SEARCHES: Dict[tuple, list] = {}


def _weights_fit(cfg: ModelConfig, pc: PlanConfig, hw) -> bool:
    """False when some stage's params + grads + main copies + optimizer state alone (parts of every
    plan's total that do not depend on the micro-batch) exceed the usable memory: search() skips the
    layout without planning each micro-batch size. True when the layout is invalid (make_plan says why)."""
    try:
        pc = pc.resolved()
        check_model(cfg, pc)
    except ValueError:
        return True
    usable = hw.memory_bytes * hw.usable_memory_fraction
    for s in range(pc.pp):
        mem = _param_memory(cfg, pc, _stage_layer_list(cfg, pc, s), s == 0, s == pc.pp - 1)
        if mem["params"] + mem["grads"] + mem["main_params"] + mem["optimizer_state"] > usable:
            return False
    return True


CP_MIN_LOCAL_TOKENS = 4096
"""search(): context-parallel degrees tried leave every CP rank at least this many tokens of a row"""


def cp_degrees(seq_len: int, tp: int, world_size: int, min_local: int = CP_MIN_LOCAL_TOKENS) -> List[int]:
    """The cp search() tries with a given tp: 1, 2, 4, ... while seq_len / cp >= min_local, seq_len
    divides by cp x tp (SP) and tp x cp divides world_size. cp = 1 only for seq_len < 2 x min_local."""
    out, cp = [], 1
    while seq_len // cp >= min_local or cp == 1:
        if seq_len % (cp * tp) == 0 and world_size % (tp * cp) == 0:
            out.append(cp)
        elif cp == 1:
            out.append(1)
        cp *= 2
    return out


def search(cfg: ModelConfig, world_size: int, hw, top: int = 3, base: Optional[PlanConfig] = None) -> List[dict]:
    """The `top` fitting layouts by estimated tokens/s over tp (<= one node), cp (cp_degrees: powers of
    two leaving >= CP_MIN_LOCAL_TOKENS per rank), pp, ep and micro-batch size, each at the global
    batch of ``base`` (default_global_batch() when it gives none: the same rule as make_plan, so a
    plain plan of the winner reproduces its numbers)."""
    base = base or PlanConfig()
    key = (_key(cfg), world_size, repr(hw), top, repr(base))
    if key in _SEARCHES:
        return list(_SEARCHES[key])
    found = []
    for tp in [d for d in _divisors(world_size) if d <= hw.gpus_per_node]:
        for cp in cp_degrees(base.seq_len, tp, world_size):
            if world_size % (tp * cp):
                continue
            for pp in [d for d in _divisors(world_size // (tp * cp)) if d <= cfg.num_layers]:
                for ep in _divisors(world_size // pp):
                    if cfg.moe.num_experts % ep or (ep > 1 and ep < tp):
                        continue
                    if not _weights_fit(cfg, replace(base, tp=tp, cp=cp, pp=pp, ep=ep, dp=0, world_size=world_size,
                                                     micro_batch_size=1), hw):
                        continue
                    for mbs in (1, 2, 4):
                        pc = replace(base, tp=tp, cp=cp, pp=pp, ep=ep, dp=0, world_size=world_size,
                                     micro_batch_size=mbs)
                        try:
                            p = make_plan(cfg, pc, hw)
                        except ValueError:
                            continue
                        if p["fits"]:
                            found.append(p)
    found.sort(key=lambda p: -p["time"]["tokens_per_s"])
    _SEARCHES[key] = found[:top]
    return list(found[:top])


def min_gpus(cfg: ModelConfig, hw, base: Optional[PlanConfig] = None, max_world: int = 2 ** 17) -> Optional[dict]:
    """The smallest world size on which some layout fits (search()), with that layout.

    Tries 1, 2, 4, ... up to one node, then node x 2^k, up to ``max_world``; from the first power of
    two W that fits it bisects over multiples of the node size between W/2 and W (memory per rank
    falls as ranks are added, so the bisection finds the boundary; divisibility can make a count in
    between fail where a smaller one fits). Returns None when nothing up to max_world fits, else
    {"world_size", "power_of_two", "plan" (the best layout there), "tried": {world: fits}}.
    """
    base = base or PlanConfig()
    node = hw.gpus_per_node
    tried: Dict[int, bool] = {}
    best: Dict[int, dict] = {}

    def fits(w: int) -> bool:
        if w not in tried:
            plans = search(cfg, w, hw, top=1, base=base)
            tried[w] = bool(plans)
            if plans:
                best[w] = plans[0]
        return tried[w]

    w, prev = 1, 0
    while w <= max_world and not fits(w):
        prev, w = w, w * 2
    if w > max_world:
        return None
    pow2 = w
    lo, hi = prev, w
    if lo >= node:
        while hi - lo > node:
            mid = max(node, (lo + hi) // 2 // node * node)
            if mid <= lo or mid >= hi:
                break
            if fits(mid):
                hi = mid
            else:
                lo = mid
    return {"world_size": hi, "power_of_two": pow2, "plan": best[hi], "tried": dict(sorted(tried.items()))}
