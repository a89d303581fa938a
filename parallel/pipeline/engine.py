"""The pipeline executor: one stage of K3 per rank, multi-tensor AttnRes payloads, AFAB and 1F1B.

Payload. Between stages the depth state is ``(partial, *blocks)``: the current AttnRes block's
partial sum and every committed block sum. A stage starting at layer s receives
``ceil(s / block_size)`` blocks plus the partial, all ``[B, T/sp, D]``; the shapes follow from
the partition and the micro-batch shape, so no shape handshake precedes a transfer. All tensors
of one transfer go in one ``batch_isend_irecv``. Packed-sequence metadata (``cu_seqlens``) is not
sent: every stage reads its micro-batch from the (identical) data stream and builds the per-document
masks itself, which costs nothing and keeps the p2p payload fixed-shape.

Schedules (``schedule=``):
  ``afab``  all forwards, then all backwards (the reference; holds m micro-batches of activations)
  ``1f1b``  warm-up of (p - 1 - stage) forwards, then one-forward-one-backward, then cool-down:
            the first stage holds at most p micro-batches of activations. Communication pairs are
            the combined send-forward/receive-backward operations of Megatron-Core's
            non-interleaved schedule, so no rank waits on a transfer its peer posts later.

Loss: the last stage backpropagates ``loss_sum / step_tokens`` per micro-batch (step_tokens = the
global labelled-token count of the step), so gradients accumulate across micro-batches and ranks
exactly as in one process. Each rank records (op, micro-batch, start, end) in ``trace``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megak3.model.mla import attention_mask
from megak3.model.seqinfo import make_seq_info

SCHEDULES = ("afab", "1f1b")


class AbsentLayer(torch.nn.Module):
    """Placeholder for a decoder layer another stage owns (keeps the owned layers' names/indices)."""

    is_moe = False


def keep_stage(model, layers: range, first: bool, last: bool) -> None:
    """Drop every module this stage does not run, in place: other stages' decoder layers become
    :class:`AbsentLayer` (parameter names keep their single-process form, ``layers.{i}.``, so
    checkpoints merge across pp), the embedding/vision leave non-first stages and the output
    AttnRes/norm/lm_head leave non-last stages."""
    for i in range(len(model.layers)):
        if i not in layers:
            model.layers[i] = AbsentLayer()
    if not first:
        model.embed_tokens = None
        model.vision = None
    if not last:
        model.output_attn_res = model.norm = model.lm_head = None


@dataclass
class StageSchedule:
    """Which stage this rank runs and with whom it talks."""

    stage: int
    num_stages: int
    prev_rank: Optional[int]
    """global rank of the previous stage (None on the first)"""
    next_rank: Optional[int]


class PipelineEngine:
    """Runs ``layers`` of ``model`` (plus the embedding on the first stage and the head + loss on
    the last) for one optimizer step's micro-batches under a pipeline schedule.

    model: the full single-process K3Model (same seed on every rank; only this stage's modules run,
        and only their parameters receive gradients: drop the others to save memory).
    layers: this stage's layer range (parallel.pipeline.partition_layers).
    group: the pipeline process group (None with one stage); stage = rank in it.
    seq_shard: the factor by which the token axis is sharded between stages (tp under SP).
    """

    def __init__(self, model, layers: range, group=None, schedule: str = "1f1b", seq_shard: int = 1):
        if schedule not in SCHEDULES:
            raise ValueError(f"parallel.pp_schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
        self.model = model
        self.layers = layers
        self.modules = [model.layers[i] for i in layers]
        if any(isinstance(mod, AbsentLayer) for mod in self.modules):
            raise ValueError(f"layers {layers.start}..{layers.stop - 1} include a layer dropped by keep_stage")
        self.group = group
        p = 1 if group is None else dist.get_world_size(group)
        s = 0 if group is None else dist.get_rank(group)
        peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        self.sched = StageSchedule(s, p, peer(s - 1) if s > 0 else None, peer(s + 1) if s < p - 1 else None)
        self.first, self.last = s == 0, s == p - 1
        if self.first and layers.start != 0 or self.last and layers.stop != model.config.num_layers:
            raise ValueError(f"stage {s} of {p} got layers {layers.start}..{layers.stop - 1}; the first stage must "
                             f"start at layer 0 and the last end at layer {model.config.num_layers - 1}")
        bs = model.config.attn_res_block_size
        self.blocks_in = (layers.start + bs - 1) // bs
        """committed AttnRes blocks entering this stage"""
        self.blocks_out = (layers.stop + bs - 1) // bs
        self.schedule = schedule
        self.seq_shard = seq_shard
        self.trace: List[tuple] = []
        self.max_inflight = 0
        """most micro-batches whose activations this stage held at once (last train_step)"""

    # ---- communication -------------------------------------------------------------------------
    def _shapes(self, mb, n_blocks):
        B, T = mb["input_ids"].shape
        return [(B, T // self.seq_shard, self.model.config.hidden_size)] * (1 + n_blocks)

    def _p2p(self, mb_idx: int, send=None, send_to=None, recv_shapes=None, recv_from=None, tag="p2p"):
        ops, bufs = [], []
        if send is not None:
            ops += [dist.P2POp(dist.isend, t.detach().contiguous(), send_to, self.group) for t in send]
        if recv_shapes is not None:
            bufs = [torch.empty(s, dtype=self.dtype, device=self.device) for s in recv_shapes]
            ops += [dist.P2POp(dist.irecv, b, recv_from, self.group) for b in bufs]
        if not ops:
            return bufs
        t0 = time.perf_counter()
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        self.trace.append((tag, mb_idx, t0, time.perf_counter()))
        return bufs

    # ---- compute -------------------------------------------------------------------------------
    def _forward(self, i: int, mb, inputs):
        model = self.model
        t0 = time.perf_counter()
        ids = mb["input_ids"]
        B, T = ids.shape
        seq = make_seq_info(B, T, mb.get("cu_seqlens"), ids.device)
        mask = attention_mask(seq, ids.device) if model.has_mla else None
        if self.first:
            x = model.embed(ids, mb.get("images"))
            if model.sequence_shard is not None:
                x = model.sequence_shard(x)
            partial, blocks = x, ()
        else:
            partial, blocks = inputs[0], tuple(inputs[1:])
        partial, blocks, stats = model.run_layers(self.modules, partial, blocks, seq, mask)
        if self.last:
            loss_sum, n = model.loss_fn(model.head(partial, blocks), mb["labels"])
            out = (loss_sum,)
        else:
            out = (partial, *blocks)
        self.trace.append(("F", i, t0, time.perf_counter()))
        return out, stats

    def _backward(self, i: int, inputs, outputs, grads):
        t0 = time.perf_counter()
        if self.last:
            (outputs[0] / self.step_tokens).backward()
        else:
            torch.autograd.backward(list(outputs), grad_tensors=list(grads))
        in_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        self.trace.append(("B", i, t0, time.perf_counter()))
        return in_grads

    # ---- evaluation ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, micro_batches: Sequence[dict]):
        """(loss_sum, labelled tokens) over ``micro_batches``, identical on every stage."""
        param = next(self.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i, mb in enumerate(micro_batches):
            inputs = [] if self.first else self._p2p(i, recv_shapes=self._shapes(mb, self.blocks_in),
                                                     recv_from=self.sched.prev_rank, tag="recv_F")
            out, _ = self._forward(i, mb, inputs)
            if self.last:
                loss_sum[0] += out[0].double()
                loss_sum[1] += int((mb["labels"] != -100).sum())
            else:
                self._p2p(i, send=out, send_to=self.sched.next_rank, tag="send_F")
        if self.group is not None and self.sched.num_stages > 1:
            dist.all_reduce(loss_sum, group=self.group)
        return float(loss_sum[0]), int(loss_sum[1])

    # ---- one step ------------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[dict], step_tokens: int):
        """Forward + backward of every micro-batch; gradients accumulate in ``.grad``.

        Returns (loss_sum of the step, identical on every stage; MoE stats of this stage's layers,
        one list per micro-batch)."""
        m = len(micro_batches)
        if m < 1:
            raise ValueError("train_step needs at least one micro-batch")
        p, s = self.sched.num_stages, self.sched.stage
        self.step_tokens = max(int(step_tokens), 1)
        param = next(self.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.trace = []
        saved = {}          # micro-batch -> (inputs, outputs)
        stats_all: List = [None] * m
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        inflight = [0]

        def recv_fwd(i):
            if self.first:
                return []
            bufs = self._p2p(i, recv_shapes=self._shapes(micro_batches[i], self.blocks_in),
                             recv_from=self.sched.prev_rank, tag="recv_F")
            return [b.requires_grad_(True) for b in bufs]

        def fwd(i, inputs):
            nonlocal loss_sum
            out, st = self._forward(i, micro_batches[i], inputs)
            stats_all[i] = st
            saved[i] = (inputs, out)
            inflight[0] = max(inflight[0], len(saved))
            if self.last:
                loss_sum = loss_sum + out[0].detach().double()
            return out

        def bwd(i, grads):
            inputs, out = saved.pop(i)
            return self._backward(i, inputs, out, grads)

        if self.schedule == "afab":
            for i in range(m):
                out = fwd(i, recv_fwd(i))
                if not self.last:
                    self._p2p(i, send=out, send_to=self.sched.next_rank, tag="send_F")
            for i in range(m):
                grads = None
                if not self.last:
                    grads = self._p2p(i, recv_shapes=self._shapes(micro_batches[i], self.blocks_out),
                                      recv_from=self.sched.next_rank, tag="recv_B")
                g_in = bwd(i, grads)
                if not self.first:
                    self._p2p(i, send=g_in, send_to=self.sched.prev_rank, tag="send_B")
        else:
            warm = min(p - 1 - s, m)
            for i in range(warm):
                out = fwd(i, recv_fwd(i))
                if not self.last:
                    self._p2p(i, send=out, send_to=self.sched.next_rank, tag="send_F")
            inputs = recv_fwd(warm) if warm < m else None
            for k in range(m - warm):
                i_f, i_b = warm + k, k
                out = fwd(i_f, inputs)
                grads = None
                if not self.last:  # send this forward, receive the oldest backward, one batch
                    grads = self._p2p(i_f, send=out, send_to=self.sched.next_rank,
                                      recv_shapes=self._shapes(micro_batches[i_b], self.blocks_out),
                                      recv_from=self.sched.next_rank, tag="send_F+recv_B")
                g_in = bwd(i_b, grads)
                more = k < m - warm - 1
                if self.first:
                    inputs = []
                elif more:        # send this backward, receive the next forward, one batch
                    bufs = self._p2p(i_b, send=g_in, send_to=self.sched.prev_rank,
                                     recv_shapes=self._shapes(micro_batches[i_f + 1], self.blocks_in),
                                     recv_from=self.sched.prev_rank, tag="send_B+recv_F")
                    inputs = [b.requires_grad_(True) for b in bufs]
                else:
                    self._p2p(i_b, send=g_in, send_to=self.sched.prev_rank, tag="send_B")
            for i_b in range(m - warm, m):
                grads = None
                if not self.last:
                    grads = self._p2p(i_b, recv_shapes=self._shapes(micro_batches[i_b], self.blocks_out),
                                      recv_from=self.sched.next_rank, tag="recv_B")
                g_in = bwd(i_b, grads)
                if not self.first:
                    self._p2p(i_b, send=g_in, send_to=self.sched.prev_rank, tag="send_B")
        self.max_inflight = inflight[0]
        if self.group is not None and p > 1:  # every stage reports the step's loss
            dist.all_reduce(loss_sum, group=self.group)
        return float(loss_sum), stats_all
