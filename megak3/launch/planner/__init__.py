"""Analytic per-rank memory, FLOPs per token, communication per step and step time of a layout.

    plan = make_plan(model_cfg, PlanConfig(tp=8, pp=16, ep=64, world_size=2048), hw=load_hardware("h200"))
    plan["memory"]["total"], plan["time"]["step_s"], plan["fits"]
    search(model_cfg, 2048, hw)          # the fitting layouts, fastest first (tools/plan.py --search)
    min_gpus(model_cfg, hw)              # the smallest world size where some layout fits (--min-gpus)
    per_rank_figures(model_cfg, pc, "middle")   # exact params / grads / optimizer / checkpoint bytes

Modules, by role (each docstring says what it counts and how):
  config       PlanConfig (what to plan; PlanConfig.from_job reads a JobConfig) and the global batch
               a plan assumes
  inventory    parameters and buffers of the real module tree, TP shards from parallel/sharding.py,
               the trainer's pipeline stages, the layout check
  activations  saved bytes per decoder layer and head (calibrated coefficients), context parallelism
  vision       the vision tower's images, activations, FLOPs and TP gather
  memory       memory per rank of a stage: params, grads, optimizer state, QB statistics, MoonEP
               replica buffers, optimizer offload
  per_rank     exact per-rank figures (what tools/simulate_scale.py checks against the trainer)
  flops        FLOPs per token, per decoder layer
  comm         communication per step and the step time of a stage
  search       make_plan, search, min_gpus
"""
from __future__ import annotations

from .activations import (ACT_COEF, _bytes, cp_layer_figures, head_activations, layer_activations,
                          module_features)
from .comm import bubble_factor, comm_per_step, stage_time
from .config import DEFAULT_STEP_TOKENS, QB_METHODS, GiB, PlanConfig, default_global_batch
from .flops import flops_per_token, layer_flops_per_token
from .inventory import (_stage_layer_list, buffer_inventory, check_model, inventory, split_blocks, stage_chunks,
                        stage_layers)
from .memory import (OFFLOAD_HOST_BYTES_PER_ELEM, OFFLOAD_HOST_UPDATE_BYTES_PER_ELEM, OFFLOAD_PCIE_BYTES_PER_ELEM,
                     moonep_replica_figures, offload_figures, qb_figures, qb_method, stage_memory)
from .per_rank import _owners, checkpoint_meta_read_bytes, per_rank_figures
from .search import CP_MIN_LOCAL_TOKENS, cp_degrees, make_plan, min_gpus, search, trainer_overrides
from .vision import (vision_activation_bytes, vision_block_flops_per_patch, vision_figures, vision_flops_per_patch,
                     vision_image)

__all__ = [
    "ACT_COEF", "CP_MIN_LOCAL_TOKENS", "DEFAULT_STEP_TOKENS", "GiB", "OFFLOAD_HOST_BYTES_PER_ELEM",
    "OFFLOAD_HOST_UPDATE_BYTES_PER_ELEM", "OFFLOAD_PCIE_BYTES_PER_ELEM", "PlanConfig",
    "QB_METHODS", "_bytes", "_owners", "_stage_layer_list", "bubble_factor", "buffer_inventory", "check_model",
    "checkpoint_meta_read_bytes", "comm_per_step", "cp_degrees", "cp_layer_figures", "default_global_batch",
    "flops_per_token", "head_activations", "inventory", "layer_activations", "layer_flops_per_token", "make_plan",
    "min_gpus", "module_features", "moonep_replica_figures", "offload_figures", "per_rank_figures", "qb_figures",
    "qb_method", "search", "split_blocks", "stage_chunks", "stage_layers", "stage_memory", "stage_time",
    "trainer_overrides", "vision_activation_bytes", "vision_block_flops_per_patch", "vision_figures",
    "vision_flops_per_patch", "vision_image",
]
