"""Pipeline parallelism for K3: stage partitioning that respects Block AttnRes, the multi-tensor
stage payload, and the afab, 1f1b, interleaved_1f1b and zb_h1 schedules (see docs/PARALLEL.md).

    chunks = partition_layers(model_cfg, pp * vp)                       # virtual stages in order
    mine = [chunks[c * pp + pp_rank] for c in range(vp)]                # this rank's model chunks
    keep_stage(model, mine, first=pp_rank == 0, last=pp_rank == pp - 1)
    engine = PipelineEngine(model, mine, pp_group, schedule="interleaved_1f1b")
    loss_sum, stats = engine.train_step(micro_batches, step_tokens)    # grads left in .grad
"""
from .engine import AbsentLayer, PipelineEngine, keep_stage
from .partition import layer_costs, partition_layers, rank_chunks
from .schedules import SCHEDULES, Action, build_schedule, closed_form_bubble, simulate, theoretical_bubble

__all__ = ["AbsentLayer", "Action", "PipelineEngine", "SCHEDULES", "build_schedule", "closed_form_bubble",
           "keep_stage", "layer_costs", "partition_layers", "rank_chunks", "simulate", "theoretical_bubble"]
