"""Pipeline timelines: one traced step on gloo ranks (the K3 model, or a balanced synthetic stack),
the measured bubble fraction, and the theory to compare it with (tools/pipeline_trace.py draws it).
Importable by module name, as run_distributed requires.

The synthetic stack has the engine's model interface with layers that *sleep* a fixed time in
forward (t_F), backward (t_B) and weight-gradient work (t_W, deferred under zb_h1, part of B
otherwise) around a tiny linear map: stages are balanced to the microsecond and ranks sharing
cores do not slow each other, so the measured bubble isolates the schedule (and the p2p cost).
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from megak3.ops.weight_grad import active_store

BUSY = ("F", "B", "W")


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_f, t_b, t_w):
        time.sleep(t_f)
        ctx.t_b, ctx.t_w = t_b, t_w
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t_b)
        store, t_w = active_store(), ctx.t_w
        if store is not None:
            store.defer_call(lambda: time.sleep(t_w))
        else:
            time.sleep(t_w)
        return g, None, None, None


class _SyntheticLayer(nn.Module):
    def __init__(self, index, d, t_f, t_b, t_w):
        super().__init__()
        self.index = index
        self.proj = nn.Linear(d, d)
        self.t = (t_f, t_b, t_w)

    def forward(self, x):
        return x + self.proj(_Sleep.apply(x, *self.t))


class SyntheticStack(nn.Module):
    """``layers`` identical sleeping layers behind the K3 engine interface (one AttnRes block)."""

    def __init__(self, layers, t_f=0.02, t_b=0.02, t_w=0.02, d=16, vocab=64):
        super().__init__()
        self.config = SimpleNamespace(num_layers=layers, attn_res_block_size=layers + 1, hidden_size=d)
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_SyntheticLayer(i, d, t_f, t_b, t_w) for i in range(layers))
        self.has_mla, self.sequence_shard = False, None
        self.vision = self.output_attn_res = self.norm = self.lm_head = None

    def shard_inputs(self, ids, labels, cu_seqlens):  # K3Model's interface (no context parallelism here)
        from megak3.model.seqinfo import make_seq_info

        return ids, labels, make_seq_info(*ids.shape, cu_seqlens, ids.device)

    def embed(self, ids, images=None):
        return self.embed_tokens(ids)

    def run_layers(self, layers, partial, blocks, seq):
        for layer in layers:  # the AttnRes payload rule: layer 0 commits the embedding as block 0
            if layer.index % self.config.attn_res_block_size == 0:
                blocks = (*blocks, partial)
            partial = layer(partial)
        return partial, blocks, []

    def head(self, partial, blocks):
        return partial.float()

    @staticmethod
    def loss_fn(logits, labels):
        return logits.pow(2).mean(-1).sum(), int(labels.numel())


def traced_step(rank, world, m, schedule, layers, seqlen, steps, layout, vp=1, synthetic=None,
                measure_memory=False, model_overrides=None):
    """One rank of a traced run; returns its last step's trace, layer ranges, peak activation bytes
    (with measure_memory) and p2p bytes sent per micro-batch.

    synthetic: None for k3_tiny, else (t_F, t_B, t_W) seconds per layer of a SyntheticStack.
    model_overrides: k3_tiny fields on top of the parity widths (e.g. {"attn_res_block_size": 64})."""
    from megak3.config import load_model_config
    from megak3.model.k3 import build_model
    from parallel.testing import PARITY_MODEL, global_batch, local_rows
    from parallel.pipeline import PipelineEngine, keep_stage, rank_chunks

    torch.set_num_threads(1)
    torch.manual_seed(1)
    if synthetic is None:
        cfg = load_model_config("k3_tiny", **{**PARITY_MODEL, "num_layers": layers, **(model_overrides or {})})
        model = build_model(cfg, seed=1)
    else:
        model = SyntheticStack(layers, *synthetic)
        cfg = model.config
        n = world * vp
        if layout is None:  # balanced: the same number of layers in every model chunk
            if layers % n:
                raise ValueError(f"--layers {layers} must be a multiple of pp * vp = {n} for a balanced "
                                 "synthetic stack")
            layout = [layers // n] * n
    vocab = getattr(cfg, "vocab_size", 64)
    mine = rank_chunks(cfg, world, rank, vp, layout=layout, allow_split_blocks=True)
    keep_stage(model, mine, rank == 0, rank == world - 1)
    eng = PipelineEngine(model, mine, dist.group.WORLD, schedule=schedule, measure_memory=measure_memory)
    ids, labels, _ = global_batch(0, m, seqlen, vocab)
    mbs = [dict(zip(("input_ids", "labels", "cu_seqlens"), local_rows(ids, labels, i, m))) for i in range(m)]
    n = int((labels != -100).sum())
    for _ in range(steps):  # the last step is the one reported (the first ones warm up)
        dist.barrier()
        eng.train_step(mbs, n)
        model.zero_grad(set_to_none=True)
    return {"trace": eng.trace, "layers": [(c.start, c.stop) for c in mine], "peak_bytes": eng.peak_activation_bytes,
            "p2p_bytes": dict(eng.p2p_bytes_per_mb), "blocks_in": eng.blocks_in}


def bubble(traces):
    """(mean over stages, per-stage bubble, t0): 1 - time in F/B/W over the common step span.
    A trace entry is (op, chunk, micro-batch, start, end)."""
    t0 = min(t[-2] for tr in traces for t in tr)
    t1 = max(t[-1] for tr in traces for t in tr)
    span = t1 - t0
    fr = [1 - sum(t[-1] - t[-2] for t in tr if t[0] in BUSY) / span for tr in traces]
    return sum(fr) / len(fr), fr, t0


def mean_op_times(traces, per_rank: bool = False):
    """Mean duration of F, B and W over all ranks' traces (W = 0 where none ran); with per_rank,
    one such dict per rank (what an unbalanced pipeline's theory needs)."""
    def means(trs):
        out = {}
        for op in BUSY:
            d = [t[-1] - t[-2] for tr in trs for t in tr if t[0] == op]
            out[op] = sum(d) / len(d) if d else 0.0
        return out
    return [means([tr]) for tr in traces] if per_rank else means(traces)
