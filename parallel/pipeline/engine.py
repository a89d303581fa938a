"""The pipeline executor: K3 model chunks per rank, multi-tensor AttnRes payloads, any schedule.

Chunks. Rank r of p runs ``vp`` model chunks; chunk c is virtual stage ``v = c * p + r`` of
``V = p * vp`` (schedules.py). Virtual stage 0 also runs the embedding (and vision), V - 1 the
output AttnRes, norm, lm_head and loss.

Payload. Between virtual stages the depth state is ``(partial, *blocks)``: the current AttnRes
block's partial sum and every committed block sum. A stage starting at layer s receives
``ceil(s / block_size)`` blocks plus the partial, all ``[B, T/sp, D]``; the shapes follow from the
partition and the micro-batch shape, so no shape handshake precedes a transfer. Packed-sequence
metadata (``cu_seqlens``) is not sent: every stage reads its micro-batch from the (identical) data
stream and derives the per-document structure itself, which keeps the payload fixed-shape.

Execution. Every rank builds the whole schedule (all ranks' action lists, schedules.py) and runs its
own list in order: F, B (with ``zb_h1`` only the input gradients: megak3/ops/weight_grad.py defers
the GEMM weight gradients) and W. Point-to-point follows NCCL's rules, not gloo's: on NCCL a send
blocks its stream until the peer has posted the matching receive, the i-th send from a to b meets
b's i-th receive from a (tags are ignored), and a group (``batch_isend_irecv``) completes only when
all its operations are matched. Every message of the step gets one global order that all ranks
compute alike: the end time of its producing action in the unit-cost simulation of the schedule
(``schedules.simulate``; ties broken by the message's kind, virtual stage and micro-batch). Rank r
posts at each action boundary k (before its action k) one launch with the sends of action k - 1
and the receives of every message whose simulated end falls in [end of its action k - 1, end of
its action k), in that global order. As on Megatron-Core each step's sends and receives thus go out
together, and because every rank's sequence of launches follows one global order, the least
unmatched message always has both ends posted: no deadlock even if every rank's point-to-point
shared one stream (parallel/nccl_semantics.py checks exactly this on CPU). A rank waits only for
the receives its next action needs; sends are waited on when the step ends. With ``batch_p2p`` a
launch is one ``dist.batch_isend_irecv`` (one NCCL group); without it each tensor is its own
``isend``/``irecv``, in the same order. Every message also has a unique tag (gloo matches by tag).
A receive that does not complete within ``timeout_s`` raises an error naming the stage, the
message and the peer (a failed or hung neighbour never leaves this rank blocked forever).

Loss: virtual stage V - 1 backpropagates ``loss_sum / step_tokens`` per micro-batch (step_tokens =
the global labelled-token count of the step), so gradients accumulate across micro-batches and
ranks exactly as in one process. Each rank records (op, chunk, micro-batch, start, end) in
``trace``; ``peak_activation_bytes`` (with ``measure_memory=True``) is the most autograd-saved
activation memory (plus deferred W inputs) this rank held during the last step, and
``p2p_bytes_per_mb`` the bytes it sent per micro-batch, forward and backward.
"""
from __future__ import annotations

import bisect
import time
from datetime import timedelta
from typing import Dict, List, Sequence, Union

import torch
import torch.distributed as dist

from megak3.ops.weight_grad import WeightGradStore

from .schedules import SCHEDULES, Action, build_schedule, check_schedule, simulate, splits_weight_grad

__all__ = ["AbsentLayer", "PipelineEngine", "SCHEDULES", "keep_stage", "message_plan", "tag_name"]

_MAX_PAYLOAD = 1000  # tensors in one transfer (tag space per message)
_UNIT = {"F": 1.0, "B": 1.0, "W": 1.0}  # op costs of the simulation that orders the messages


def tag_name(tag: int, V: int) -> str:
    """The message a pipeline tag belongs to, e.g. ``F->v1 mb2 [0]`` (activations for virtual stage 1,
    tensor 0) or ``B->v0 mb1 [2]`` (output gradients for virtual stage 0); for error reports."""
    msg, j = divmod(tag, _MAX_PAYLOAD)
    rest, is_b = divmod(msg, 2)
    mb, v = divmod(rest, V)
    return f"{'B' if is_b else 'F'}->v{v} mb{mb} [{j}]"


def message_plan(schedule: List[List[Action]], p: int, vp: int, rank: int, split_w: bool) -> List[List[tuple]]:
    """What ``rank`` posts at each action boundary: ``plan[k]`` (before its action k; k = len(list)
    after the last) lists ``(key, outgoing)`` in the global message order (module docstring); key =
    (kind, receiving virtual stage, micro-batch). Messages between chunks of one rank (p == 1) are
    not listed: they stay local."""
    timeline, _ = simulate(schedule, p, vp, _UNIT, split_w)
    V = p * vp
    msgs, made_at = [], {}
    for q, tl in enumerate(timeline):
        for k, (a, _start, end) in enumerate(tl):
            v = a.chunk * p + q
            if a.kind == "F" and v < V - 1:
                key = ("F", v + 1, a.mb)
            elif a.kind == "B" and v > 0:
                key = ("B", v - 1, a.mb)
            else:
                continue
            if key[1] % p != q:
                msgs.append(((end, *key), key, q, key[1] % p))
                if q == rank:
                    made_at[key] = k + 1
    ends = [end for _, _, end in timeline[rank]]
    plan: List[List[tuple]] = [[] for _ in range(len(ends) + 1)]
    for order, key, src, dst in sorted(msgs):
        if src == rank:
            plan[made_at[key]].append((key, True))
        elif dst == rank:  # after my last action that ends no later than the message's producer
            plan[bisect.bisect_right(ends, order[0])].append((key, False))
    return plan


class AbsentLayer(torch.nn.Module):
    """Placeholder for a decoder layer another stage owns (keeps the owned layers' names/indices)."""

    is_moe = False


def keep_stage(model, layers, first: bool, last: bool) -> None:
    """Drop every module this rank does not run, in place: other ranks' decoder layers become
    :class:`AbsentLayer` (parameter names keep their single-process form, ``layers.{i}.``, so
    checkpoints merge across pp), the embedding/vision leave all but the first stage and the output
    AttnRes/norm/lm_head all but the last. ``layers``: a range or a list of ranges (model chunks)."""
    keep = set()
    for chunk in ([layers] if isinstance(layers, range) else layers):
        keep.update(chunk)
    for i in range(len(model.layers)):
        if i not in keep:
            model.layers[i] = AbsentLayer()
    if not first:
        model.embed_tokens = None
        model.vision = None
    if not last:
        model.output_attn_res = model.norm = model.lm_head = None


class _ActivationMeter:
    """Bytes of tensors autograd saved for backward and still holds (parameters excluded), counted
    once per storage, via saved-tensor hooks: a tensor is released when its graph node frees it."""

    def __init__(self, params, extra=lambda: 0):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs: Dict[int, int] = {}
        self.live = self.peak = 0
        self.extra = extra
        """bytes held outside autograd's saved tensors (deferred W inputs), sampled with them"""

    def pack(self, t):
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return t
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.params:
            return t
        if ptr not in self.refs:
            self.live += st.nbytes()
            self.refs[ptr] = 0
            self.sample()
        self.refs[ptr] += 1
        return _Held(self, t, ptr, st.nbytes())

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def release(self, ptr, nbytes):
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= nbytes

    def sample(self):
        self.peak = max(self.peak, self.live + self.extra())


class _Held:
    __slots__ = ("meter", "t", "ptr", "nbytes")

    def __init__(self, meter, t, ptr, nbytes):
        self.meter, self.t, self.ptr, self.nbytes = meter, t, ptr, nbytes

    def __del__(self):
        self.meter.release(self.ptr, self.nbytes)


class PipelineEngine:
    """Runs this rank's model chunks (plus the embedding on virtual stage 0 and the head + loss on
    the last) for one optimizer step's micro-batches under a pipeline schedule.

    model: the full single-process K3Model (same seed on every rank; only this rank's modules run,
        and only their parameters receive gradients: ``keep_stage`` drops the others).
    chunks: this rank's layer range, or its ``vp`` ranges in chunk order (chunk c = virtual stage
        c * p + r of parallel.pipeline.partition_layers(cfg, p * vp)).
    group: the pipeline process group (None with one stage); rank r = rank in it.
    schedule: one of schedules.SCHEDULES; the engine checks it against the rank count and ``vp``
        when built (a guard for direct users of the engine: a training job's schedule was checked
        with its micro-batch count by megak3.job.config.check_layout before any rank started, and
        each step's by build_schedule).
    seq_shard: the factor by which the token axis is sharded between stages (tp under SP, times cp).
    timeout_s: how long a receive may wait before the step fails with a clear error.
    batch_p2p: post each payload's sends / receives with ``dist.batch_isend_irecv`` (parallel.pp_batch_p2p).
    """

    def __init__(self, model, chunks: Union[range, Sequence[range]], group=None, schedule: str = "1f1b",
                 seq_shard: int = 1, timeout_s: float = 300.0, measure_memory: bool = False,
                 batch_p2p: bool = False):
        chunks = [chunks] if isinstance(chunks, range) else list(chunks)
        self.p = 1 if group is None else dist.get_world_size(group)
        self.r = 0 if group is None else dist.get_rank(group)
        self.vp = len(chunks)
        check_schedule(schedule, self.p, self.vp)
        self.model, self.group, self.schedule = model, group, schedule
        self.chunks = chunks
        self.V = self.p * self.vp
        L, bs = model.config.num_layers, model.config.attn_res_block_size
        self.modules = []
        for c, rng in enumerate(chunks):
            mods = [model.layers[i] for i in rng]
            if any(isinstance(mod, AbsentLayer) for mod in mods) or len(rng) == 0:
                raise ValueError(f"model chunk {c} (layers {rng.start}..{rng.stop - 1}) is empty or includes a "
                                 "layer dropped by keep_stage")
            self.modules.append(mods)
        if any(a.stop > b.start for a, b in zip(chunks, chunks[1:])):
            raise ValueError(f"model chunks {chunks} must be in increasing layer order")
        if self.r == 0 and chunks[0].start != 0 or self.r == self.p - 1 and chunks[-1].stop != L:
            got = [(c.start, c.stop - 1) for c in chunks]
            raise ValueError(f"pipeline rank {self.r} of {self.p} got layers {got}; virtual stage 0 must start at "
                             f"layer 0 and the last end at layer {L - 1}")
        self.blocks_in = [(c.start + bs - 1) // bs for c in chunks]
        """committed AttnRes blocks entering each of this rank's chunks"""
        self.blocks_out = [(c.stop + bs - 1) // bs for c in chunks]
        self.seq_shard = seq_shard
        self.timeout = timedelta(seconds=float(timeout_s))
        self.measure_memory = measure_memory
        self.batch_p2p = bool(batch_p2p)
        self.trace: List[tuple] = []
        self.max_inflight = 0
        """most (chunk, micro-batch) activation sets this rank held at once (last train_step)"""
        self.peak_activation_bytes = 0
        self.p2p_bytes_per_mb = {"F": 0, "B": 0}
        self.store = WeightGradStore()
        self._head = None
        self._plans: Dict[tuple, List[List[tuple]]] = {}

    # ---- topology --------------------------------------------------------------------------------
    def _v(self, chunk: int) -> int:
        return chunk * self.p + self.r

    def _rank_of(self, v: int) -> int:
        return v % self.p

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _tag(self, key, j: int) -> int:
        kind, v, i = key
        return ((i * self.V + v) * 2 + (kind == "B")) * _MAX_PAYLOAD + j

    # ---- communication ---------------------------------------------------------------------------
    def _plan_messages(self, schedule: List[List[Action]], split_w: bool) -> None:
        key = (tuple(map(tuple, schedule)), split_w)  # a step's plan is reused by every later step
        if key not in self._plans:
            self._plans[key] = message_plan(schedule, self.p, self.vp, self.r, split_w)
        self._posts = self._plans[key]
        self._posted: Dict[tuple, tuple] = {}
        self._outbox: Dict[tuple, list] = {}
        self._local: Dict[tuple, list] = {}
        self._sends: List[tuple] = []

    def _shapes(self, key):
        kind, v, i = key
        c = v // self.p
        B, T = self._mbs[i]["input_ids"].shape
        n = self.blocks_in[c] if kind == "F" else self.blocks_out[c]
        return [(B, T // self.seq_shard, self.model.config.hidden_size)] * (1 + n)

    def _emit(self, key, tensors) -> None:
        """Hold an action's outgoing payload until its boundary is posted (or keep it local)."""
        tensors = [t.detach().contiguous() for t in tensors]
        if len(tensors) > _MAX_PAYLOAD:
            raise ValueError(f"a pipeline payload of {len(tensors)} tensors exceeds {_MAX_PAYLOAD}")
        self.p2p_bytes_per_mb[key[0]] += sum(t.numel() * t.element_size() for t in tensors)
        if self._rank_of(key[1]) == self.r:  # neighbouring chunks on one rank (p == 1)
            self._local[key] = tensors
        else:
            self._outbox[key] = tensors

    def _peer(self, key, outgoing: bool) -> int:
        if outgoing:
            return self._rank_of(key[1])
        return self._rank_of(key[1] + (-1 if key[0] == "F" else 1))

    def _post(self, k: int) -> None:
        """Post boundary k's sends and receives as one launch (module docstring)."""
        msgs = []
        for key, outgoing in self._posts[k]:
            tensors = (self._outbox.pop(key) if outgoing else
                       [torch.empty(s, dtype=self.dtype, device=self.device) for s in self._shapes(key)])
            msgs.append((key, outgoing, tensors, self._global(self._peer(key, outgoing))))
        if not msgs:
            return
        t0 = time.perf_counter()
        ops = [(dist.isend if out else dist.irecv, t, peer, self._tag(key, j))
               for key, out, tensors, peer in msgs for j, t in enumerate(tensors)]
        if self.batch_p2p:
            works = dist.batch_isend_irecv([dist.P2POp(op, t, peer, self.group, tag) for op, t, peer, tag in ops])
            # one work per operation (gloo), or one coalesced work for the whole group (NCCL)
            per_op = [[w] for w in works] if len(works) == len(ops) else [list(works)] * len(ops)
        else:
            per_op = [[op(t, peer, group=self.group, tag=tag)] for op, t, peer, tag in ops]
        t1 = time.perf_counter()
        n = 0
        for key, outgoing, tensors, _ in msgs:
            mine = list({id(w): w for ws in per_op[n:n + len(tensors)] for w in ws}.values())
            n += len(tensors)
            if outgoing:
                self._sends.extend((w, tensors) for w in mine)
                self.trace.append(("send_" + key[0], key[1] // self.p, key[2], t0, t1))
            else:
                self._posted[key] = (tensors, mine)
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def _take(self, key) -> List[torch.Tensor]:
        """The payload ``key`` for the action about to run: waits for its receive (posted earlier)."""
        if key in self._local:
            return self._local.pop(key)
        if key not in self._posted:
            raise RuntimeError(f"pipeline rank {self.r}: message {key} was never posted (a bug in the "
                               "message plan)")
        src = self._peer(key, False)
        bufs, works = self._posted.pop(key)
        t0 = time.perf_counter()
        for w in works:
            self._wait(w, self._timeout_msg(key, src))
        self.trace.append(("recv_" + key[0], key[1] // self.p, key[2], t0, time.perf_counter()))
        return bufs

    def _wait(self, work, context: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except Exception as e:  # noqa: BLE001 - backend-specific timeout/abort errors
            raise RuntimeError(f"{context} ({type(e).__name__}: {e})") from e
        if ok is False:
            raise RuntimeError(context)

    def _timeout_msg(self, key, src) -> str:
        what = "activations" if key[0] == "F" else "output gradients"
        return (f"pipeline rank {self.r} (virtual stage {key[1]}) got no {what} for micro-batch {key[2]} from "
                f"pipeline rank {src} within {self.timeout.total_seconds():.0f} s: that rank failed or hangs "
                "(see its error); raise parallel.timeout_s only if the stage is just slow")

    def _finish_sends(self) -> None:
        for w, _ in self._sends:
            self._wait(w, f"pipeline rank {self.r}: a send to a neighbouring stage did not complete within "
                          f"{self.timeout.total_seconds():.0f} s: that rank failed or hangs (see its error)")
        self._sends = []

    # ---- compute ---------------------------------------------------------------------------------
    def _forward(self, c: int, i: int, inputs):
        model, mb, v = self.model, self._mbs[i], self._v(c)
        t0 = time.perf_counter()
        if i not in self._seq:  # per-document structure (under CP: this rank's segment), shared by its chunks
            self._seq[i] = model.shard_inputs(mb["input_ids"], mb["labels"], mb.get("cu_seqlens"))
        ids, labels, seq = self._seq[i]
        if v == 0:
            x = model.embed(ids, mb.get("images"))
            if model.sequence_shard is not None:
                x = model.sequence_shard(x)
            partial, blocks = x, ()
        else:
            partial, blocks = inputs[0], tuple(inputs[1:])
        partial, blocks, stats = model.run_layers(self.modules[c], partial, blocks, seq)
        if v == self.V - 1:
            logits = model.head(partial, blocks)
            out = (model.loss_fn(logits, labels)[0] if self._head is None else self._head(i, logits),)
        else:
            out = (partial, *blocks)
        self.trace.append(("F", c, i, t0, time.perf_counter()))
        return out, stats

    def _backward(self, c: int, i: int, inputs, outputs, grads):
        t0 = time.perf_counter()
        self.store.key = (c, i)
        if self._v(c) == self.V - 1:
            (outputs[0] / self.step_tokens.to(outputs[0].dtype)).backward()
        else:
            pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
        in_grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        self.trace.append(("B", c, i, t0, time.perf_counter()))
        return in_grads

    # ---- the executor ------------------------------------------------------------------------------
    def _run(self, micro_batches, schedule: List[List[Action]], train: bool):
        param = next(self.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self._mbs = micro_batches
        self._seq: Dict[int, tuple] = {}
        self.trace = []
        self.p2p_bytes_per_mb = {"F": 0, "B": 0}
        self._plan_messages(schedule, train and splits_weight_grad(self.schedule))
        saved = {}
        stats_all: List[list] = [[] for _ in micro_batches]
        loss_sum = torch.zeros(2, dtype=torch.float64, device=self.device)
        inflight = 0
        meter = (_ActivationMeter(self.model.parameters(), lambda: self.store.bytes_held)
                 if self.measure_memory else None)
        self._post(0)
        for k, a in enumerate(schedule[self.r]):
            c, i, v = a.chunk, a.mb, self._v(a.chunk)
            if a.kind == "F":
                inputs = [] if v == 0 else self._take(("F", v, i))
                if train:
                    inputs = [b.requires_grad_(True) for b in inputs]
                if meter is not None:
                    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                        out, st = self._forward(c, i, inputs)
                else:
                    out, st = self._forward(c, i, inputs)
                stats_all[i].extend(st)
                if v == self.V - 1:
                    loss_sum[0] += out[0].detach().double()
                    loss_sum[1] += (self._seq[i][1] != -100).sum()  # this rank's labels (no host read)
                else:
                    self._emit(("F", v + 1, i), out)
                if train:
                    saved[(c, i)] = (inputs, out)
                    inflight = max(inflight, len(saved))
            elif a.kind == "B":
                inputs, out = saved.pop((c, i))
                grads = None if v == self.V - 1 else self._take(("B", v, i))
                g_in = self._backward(c, i, inputs, out, grads)
                del out, grads
                if v > 0:
                    self._emit(("B", v - 1, i), g_in)
            else:
                t0 = time.perf_counter()
                self.store.flush((c, i))
                self.trace.append(("W", c, i, t0, time.perf_counter()))
            if meter is not None:
                meter.sample()
            self._post(k + 1)
        self._finish_sends()
        m = max(len(micro_batches), 1)
        self.p2p_bytes_per_mb = {k: n // m for k, n in self.p2p_bytes_per_mb.items()}
        self.max_inflight = inflight
        self._seq = {}
        if meter is not None:
            self.peak_activation_bytes = meter.peak
        if self.group is not None and self.p > 1:  # every stage reports the step's loss
            dist.all_reduce(loss_sum, group=self.group)
        return loss_sum, stats_all

    # ---- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, micro_batches: Sequence[dict], head=None):
        """(loss_sum, labelled tokens) over ``micro_batches``, identical on every stage. ``head``: as
        in :meth:`train_step`."""
        fwd = [[Action("F", c, i) for i in range(len(micro_batches)) for c in range(self.vp)]] * self.p
        self._head = head
        loss_sum, _ = self._run(micro_batches, fwd, train=False)
        return float(loss_sum[0]), int(loss_sum[1])

    # ---- one step --------------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[dict], step_tokens, head=None):
        """Forward + backward of every micro-batch; gradients accumulate in ``.grad``.

        ``head``: None (the model's ``loss_fn`` of the logits and labels), or ``head(i, logits)`` -> the
        0-dim loss of micro-batch ``i`` from the last stage's logits (``[B, T/cp, V or V/tp]``), which
        the last stage backpropagates divided by ``step_tokens`` (RL: its policy loss, megak3/posttrain).

        Returns (loss_sum of the step, identical on every stage; MoE stats of this rank's layers,
        one list per micro-batch in layer order). ``step_tokens``: the step's labelled tokens over
        the data-parallel group, a number or a device scalar tensor (no host sync)."""
        m = len(micro_batches)
        schedule = build_schedule(self.schedule, self.p, m, self.vp)
        self._head = head
        self.step_tokens = torch.as_tensor(step_tokens, device=next(self.model.parameters()).device).clamp_min(1)
        if splits_weight_grad(self.schedule):
            with self.store.capture():
                loss_sum, stats = self._run(micro_batches, schedule, train=True)
            self.store.flush_all()  # nothing is left normally; a guard against a schedule bug
        else:
            loss_sum, stats = self._run(micro_batches, schedule, train=True)
        return loss_sum[0], stats
