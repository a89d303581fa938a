"""Parallel layout configuration (``conf/parallel/``).

Degrees of the dense grid (tp x cp x dp x pp) and the expert grid (etp x ep x edp x pp) over one
world; the rank arithmetic lives in parallel/grid.py. ``validate`` checks the layout only (and,
given a model config, the divisibility it needs), before any process group exists; which layouts
a program can run is that program's decision (the trainer's, not this file's).

    cfg = ParallelConfig(tp=4, pp=2, ep=8)          # dp=0: derived from the world size
    cfg.validate(64, model_cfg)                     # raises ValueError naming parallel.<field>
    cfg.to_layout(64)                               # Layout(world_size=64, tp=4, dp=8, pp=2, ep=8, ...)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from parallel.grid import DEFAULT_ORDER, Layout, validate_layout

BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class ParallelConfig:
    """Parallel degrees (all 1 = a single process)."""

    tp: int = 1
    """tensor-parallel degree (heads, FFN widths and vocabulary are split tp ways)"""
    cp: int = 1
    """context-parallel degree (the sequence is split cp ways)"""
    dp: int = 0
    """data-parallel degree; 0 = derive: world_size / (tp * cp * pp)"""
    pp: int = 1
    """pipeline-parallel degree (stages)"""
    pp_schedule: str = "1f1b"
    """pipeline schedule: 'afab' (all forwards, then all backwards), '1f1b', 'interleaved_1f1b'
    (needs vp >= 2) or 'zb_h1' (zero bubble: weight gradients split off and delayed)"""
    vp: int = 1
    """model chunks per pipeline rank (virtual stages; interleaved_1f1b)"""
    pp_split_blocks: bool = False
    """allow a stage boundary inside an AttnRes block (needed when pp exceeds the block count)"""
    pp_layout: Optional[List[int]] = None
    """explicit decoder layers per stage (e.g. [3, 6]); None = balanced by the cost model"""
    ep: int = 1
    """expert-parallel degree (routed experts are split ep ways; must divide moe.num_experts)"""
    etp: int = 1
    """expert tensor-parallel degree (each routed expert's width is split etp ways)"""
    order: str = DEFAULT_ORDER
    """rank order of the axes, first = fastest-varying (Megatron-Core's default 'tp-cp-ep-dp-pp')"""
    cp_balance: bool = True
    """MLA under cp > 1 (default on): each rank's queries cut into ``cp_balance_split`` blocks that go to
    the ranks computing them so every rank's score work is even, K/V expanded one key block at a time
    (parallel/context_parallel.py ``balanced_attention``; FlexAttention with its log-sum-exp on CUDA,
    the chunked twin elsewhere); KDA keeps the contiguous segments. false = every rank attends its
    own contiguous segment (the last rank does most: 1.75x / 1.87x the average at cp 4 / 8); needed
    with pp_schedule=zb_h1"""
    cp_balance_split: int = 2
    """query blocks per CP rank under ``cp_balance`` (data.seq_len must divide by cp x this)"""
    sequence_parallel: bool = False
    """shard the token axis of activations across the TP group outside the TP matmuls"""
    backend: str = "auto"
    """process-group backend: 'auto' (nccl on CUDA, gloo on CPU), 'gloo' or 'nccl'"""
    timeout_s: float = 300.0
    """timeout of every collective and of the rendezvous, in seconds"""
    overlap_grad_reduce: bool = False
    """issue each ZeRO-1 gradient bucket's reduce-scatter during the last micro-batch's backward as
    soon as the bucket is complete (bitwise the same result); used without tp/pp/ep/cp only, ignored
    otherwise"""
    pp_batch_p2p: bool = False
    """pipeline sends/receives of one payload posted together with ``dist.batch_isend_irecv``"""
    overlap_param_gather: bool = False
    """issue each ZeRO-1 bucket's parameter all-gather at the end of the optimizer step without
    waiting; the next forward waits for each bucket just before the decoder layer (or embedding,
    head, ...) that uses it (bitwise the same result); used under every layout"""

    def resolved_dp(self, world_size: int) -> int:
        """dp, or world_size / (tp * cp * pp) when dp == 0."""
        if self.dp != 0:
            return self.dp
        model = self.tp * self.cp * self.pp
        if world_size % model:
            raise ValueError(f"parallel.tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {model} does not "
                             f"divide world_size={world_size}; change the degrees or the world size")
        return world_size // model

    def to_layout(self, world_size: int) -> Layout:
        """The grid of this config on `world_size` ranks (dp derived when 0); not yet validated."""
        for f in ("tp", "cp", "pp", "ep", "etp", "vp"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{f}={v!r} must be an integer >= 1")
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 0:
            raise ValueError(f"parallel.dp={self.dp!r} must be an integer >= 1, or 0 to derive it")
        return Layout(world_size=world_size, tp=self.tp, cp=self.cp, dp=self.resolved_dp(world_size),
                      pp=self.pp, ep=self.ep, etp=self.etp, order=self.order)

    def validate(self, world_size: int = 1, model_cfg=None) -> "ParallelConfig":
        """Raise ValueError naming `parallel.<field>` and the fix; return self.

        model_cfg: a megak3.config.ModelConfig; when given, the degrees must divide its head
        counts, widths, experts and vocabulary (see grid.validate_layout).

        The layout alone: the schedule's name and ``vp`` are checked here for direct users of
        ParallelConfig / init_parallel (parallel.state); the layout against the data, the model and
        the micro-batches of a step (CP's and SP's split of data.seq_len, expert TP, the schedule's
        micro-batch count) is megak3.job.config.check_layout, which JobConfig.validate calls.
        """
        if self.backend not in BACKENDS:
            raise ValueError(f"parallel.backend={self.backend!r}: choose one of {', '.join(BACKENDS)}")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"parallel.sequence_parallel={self.sequence_parallel!r} must be true or false")
        if isinstance(self.cp_balance_split, bool) or not isinstance(self.cp_balance_split, int) \
                or self.cp_balance_split < 1:
            raise ValueError(f"parallel.cp_balance_split={self.cp_balance_split!r} must be a positive integer "
                             "(query blocks per CP rank; 2 is the head-tail pairing)")
        for f in ("overlap_grad_reduce", "pp_batch_p2p", "overlap_param_gather", "cp_balance"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"parallel.{f}={getattr(self, f)!r} must be true or false")
        if self.cp_balance and self.cp > 1 and self.pp_schedule == "zb_h1":
            raise ValueError("parallel.cp_balance=true with parallel.pp_schedule=zb_h1 is not supported (MLA's "
                             "per-key-block K/V re-expansion in backward is untested with deferred weight "
                             "gradients); use another pp_schedule or parallel.cp_balance=false")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not self.timeout_s > 0:
            raise ValueError(f"parallel.timeout_s={self.timeout_s!r} must be a positive number of seconds")
        from parallel.pipeline.schedules import check_schedule

        check_schedule(self.pp_schedule, self.pp, self.vp)  # the micro-batch count: job.config.check_layout
        validate_layout(self.to_layout(world_size), model_cfg)
        if model_cfg is not None and self.pp > 1:
            from parallel.pipeline.partition import rank_chunks

            rank_chunks(model_cfg, self.pp, 0, self.vp, self.pp_layout, self.pp_split_blocks)
        return self


def check_expert_tp(ep: int, tp: int, sequence_parallel: bool) -> None:
    """Training with ep > 1 and tp > 1 needs sequence parallelism (as in Megatron-Core); the grid
    itself does not (megak3.job.config.check_layout calls this)."""
    if ep > 1 and tp > 1 and not sequence_parallel:
        raise ValueError(f"parallel.ep={ep} with parallel.tp={tp} needs parallel.sequence_parallel=true (without "
                         "it every TP rank would dispatch the same tokens to the experts)")
