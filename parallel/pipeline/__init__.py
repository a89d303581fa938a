"""Pipeline parallelism for K3: stage partitioning that respects Block AttnRes, the multi-tensor
stage payload, and the all-forward-all-backward and 1F1B schedules (see docs/PARALLEL.md).

    chunks = partition_layers(model_cfg, pp=2)                 # [range(0, 3), range(3, 9)]
    engine = PipelineEngine(model, chunks[pp_rank], pp_group, pp_rank, pp, schedule="1f1b")
    loss_sum, stats = engine.train_step(micro_batches, step_tokens)   # grads left in .grad
"""
from .engine import AbsentLayer, PipelineEngine, StageSchedule, keep_stage
from .partition import layer_costs, partition_layers

__all__ = ["AbsentLayer", "PipelineEngine", "keep_stage", "StageSchedule", "layer_costs", "partition_layers"]
