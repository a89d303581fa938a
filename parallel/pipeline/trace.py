"""Pipeline timeline helpers: one traced K3 step on gloo ranks and the measured bubble fraction
(tools/pipeline_trace.py draws it). Importable by module name, as run_distributed requires."""
from __future__ import annotations

import torch
import torch.distributed as dist


def traced_step(rank, world, m, schedule, layers, seqlen, steps, layout):
    from megak3.config import load_model_config
    from megak3.model.k3 import build_model
    from parallel.parity import PARITY_MODEL, global_batch, local_rows
    from parallel.pipeline import PipelineEngine, keep_stage, partition_layers

    torch.set_num_threads(1)
    cfg = load_model_config("k3_tiny", **{**PARITY_MODEL, "num_layers": layers})
    model = build_model(cfg, seed=1)
    chunks = partition_layers(cfg, world, layout=layout, allow_split_blocks=True)
    keep_stage(model, chunks[rank], rank == 0, rank == world - 1)
    eng = PipelineEngine(model, chunks[rank], dist.group.WORLD, schedule=schedule)
    ids, labels, _ = global_batch(0, m, seqlen, cfg.vocab_size)
    mbs = [dict(zip(("input_ids", "labels", "cu_seqlens"), local_rows(ids, labels, i, m))) for i in range(m)]
    n = int((labels != -100).sum())
    for _ in range(steps):  # the last step is the one reported (the first ones warm up)
        dist.barrier()
        eng.train_step(mbs, n)
        model.zero_grad(set_to_none=True)
    return {"trace": eng.trace, "layers": (chunks[rank].start, chunks[rank].stop)}


def bubble(traces):
    """(mean over stages, per-stage bubble, t0): 1 - time in F/B over the common step span."""
    t0 = min(t[2] for tr in traces for t in tr)
    t1 = max(t[3] for tr in traces for t in tr)
    span = t1 - t0
    fr = [1 - sum(e - s for op, _, s, e in tr if op in ("F", "B")) / span for tr in traces]
    return sum(fr) / len(fr), fr, t0
