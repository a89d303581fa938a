"""What a plan is asked about: :class:`PlanConfig` (layout degrees, batch shape, precision,
checkpointing, images, offload), the global batch a plan assumes, and the helpers the planner's
modules share.

Job config: a PlanConfig field that mirrors a job config field names its dotted key once
(``mirror("parallel.tp")``); its default is the job config's except where the planner plans a
production run by default (bf16, activation checkpointing, SP, micro-batch 1, seq 4096, the default
global batch). ``PlanConfig.from_job(job, world_size)`` reads those keys from a JobConfig;
tools/plan.py parses its ``key=value`` arguments through the same keys.

Batch: a plan, a search and min_gpus all assume the same global batch when none is given,
default_global_batch(): ~4 Mi tokens per step (1024 x 4096), rounded up to whole micro-batch rounds.
Stages: the trainer's partition (parallel/pipeline/partition.rank_chunks: cost-balanced, cuts at
AttnRes block starts unless parallel.pp_split_blocks, which the plan turns on when pp x vp needs it).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Dict, Iterable, Optional

from megak3.job.config import JobConfig, check_layout
from megak3.model.balancing import QB_METHODS

from ...config import ModelConfig


GiB = 2 ** 30


DEFAULT_STEP_TOKENS = 1024 * 4096
"""tokens per optimizer step a plan assumes when train.global_batch_size is not given (4 Mi)"""



def default_global_batch(seq_len: int, micro_batch_size: int, dp: int, pp: int = 1,
                         pp_schedule: str = "1f1b") -> int:
    """The global batch (sequences) every plan and search assumes when none is given: the smallest
    multiple of micro_batch_size x dp (x pp under interleaved_1f1b, which needs whole rounds) that
    holds at least DEFAULT_STEP_TOKENS tokens (1024 sequences of 4096 tokens)."""
    unit = micro_batch_size * dp * (pp if pp_schedule == "interleaved_1f1b" else 1)
    want = max(1, -(-DEFAULT_STEP_TOKENS // seq_len))
    return -(-want // unit) * unit


_FROM_JOB = object()


def job_default(key: str):
    """The default of the job config's field ``key`` (dotted, e.g. 'parallel.tp'), read from the
    JobConfig dataclasses (megak3/job/config.py and its sections' configs)."""
    cls, *path, leaf = [JobConfig] + key.split(".")
    for name in path:
        cls = {f.name: f for f in fields(cls)}[name].default_factory
    f = {f.name: f for f in fields(cls)}[leaf]
    return f.default if f.default is not MISSING else f.default_factory()


def job_value(job: JobConfig, key: str):
    """The value of the job config's field ``key`` (dotted) in ``job``."""
    v = job
    for name in key.split("."):
        v = getattr(v, name)
    return v


def mirror(key: str, default=_FROM_JOB, read=None):
    """A PlanConfig field that mirrors the job config's field ``key``: its default is the job
    config's unless the planner gives its own (a production plan, not the job config's small demo
    run); ``read(job)``, when given, is how :meth:`PlanConfig.from_job` reads it (else the field)."""
    meta = {"job": key, "read": read}
    if default is _FROM_JOB:
        default = job_default(key)
    return field(default=default, metadata=meta)


def arg(key: str, default):
    """A planner-only field (no job config field) that tools/plan.py sets as ``key=value``."""
    return field(default=default, metadata={"arg": key})


@dataclass
class PlanConfig:
    """What to plan: layout degrees, batch shape, precision, checkpointing, hardware.

    A field that mirrors a job config field names it once (``mirror("parallel.tp")``, the field's
    metadata["job"]): :meth:`from_job` reads it from a JobConfig, tools/plan.py parses ``key=value``
    by that field's type in the job config. Planner-only knobs carry metadata["arg"] (their
    ``key=value`` name) or nothing (set by the planner itself)."""

    tp: int = mirror("parallel.tp")
    pp: int = mirror("parallel.pp")
    ep: int = mirror("parallel.ep")
    dp: int = mirror("parallel.dp")
    """0: world_size / (tp * cp * pp)"""
    cp: int = mirror("parallel.cp")
    """parallel.cp: context-parallel degree (each sequence split into cp contiguous segments)"""
    cp_balance: bool = mirror("parallel.cp_balance")
    """parallel.cp_balance: MLA's balanced schedule (query blocks moved, K/V expanded per key block)"""
    cp_balance_split: int = mirror("parallel.cp_balance_split")
    """parallel.cp_balance_split: query blocks per CP rank under cp_balance"""
    world_size: int = arg("world_size", 1)
    sequence_parallel: bool = mirror("parallel.sequence_parallel", True)
    """SP under tp > 1 (the trainer's EP x TP layouts require it); planner default true"""
    micro_batch_size: int = mirror("train.micro_batch_size", 1)
    """planner default 1"""
    seq_len: int = mirror("data.seq_len", 4096)
    """planner default 4096"""
    global_batch_size: int = mirror("train.global_batch_size", 0)
    """sequences per step; 0 (the planner's default): default_global_batch() (~4 Mi tokens, whatever the layout)"""
    precision: str = mirror("train.precision", "bf16")
    """activation dtype: 'bf16' (autocast, the planner's default) or 'fp32'"""
    param_dtype: str = arg("param_dtype", "fp32")
    """'fp32' (the trainer: fp32 params = main copies) or 'bf16' (bf16 params + fp32 owned main copies)"""
    activation_checkpointing: bool = mirror("train.activation_checkpointing", True,
                                            read=lambda job: job.train.recompute_mode() == "full")
    """full recompute of each decoder layer (from a job: train.recompute_mode() == 'full'); planner default true"""
    pp_schedule: str = mirror("parallel.pp_schedule")
    """parallel.pp_schedule: afab, 1f1b, interleaved_1f1b or zb_h1 (parallel/pipeline/schedules.py)"""
    vp: int = mirror("parallel.vp")
    """parallel.vp: model chunks per pipeline rank (interleaved_1f1b)"""
    pp_split_blocks: Optional[bool] = mirror("parallel.pp_split_blocks", None)
    """parallel.pp_split_blocks; None (the planner's default): only when pp x vp exceeds the AttnRes block starts"""
    pp_layout: Optional[tuple] = mirror("parallel.pp_layout", read=lambda job: _tuple(job.parallel.pp_layout))
    """parallel.pp_layout: explicit layers per model chunk; None: balanced as the trainer does"""
    moonep: bool = mirror("moonep.enabled")
    """moonep.enabled (used when ep > 1): MoonEP with replica slots; False: the baseline dispatcher
    (home experts only: no replica buffers or traffic)"""
    max_replicas_per_rank: int = mirror("moonep.max_replicas_per_rank")
    """moonep.max_replicas_per_rank: replica slots M per EP rank; 0 = num_experts / ep"""
    qb_method: str = mirror("model.moe.qb_method", "")
    """'' (the planner's default) = model.moe.qb_method of the model config; 'auto' | 'exact' | 'histogram'
    (anything else: ValueError)"""
    qb_bins: int = mirror("model.moe.qb_bins", 0)
    """0 (the planner's default) = model.moe.qb_bins of the model config (4096 when the config has none)"""
    bucket_bytes: int = 40 * 2 ** 20
    dp_overlap: float = 0.8
    """fraction of the ZeRO-1 reduce-scatter / all-gather hidden behind compute"""
    global_batch_default: bool = False
    """set by resolved(): the global batch came from default_global_batch()"""
    vision_fraction: float = arg("data.vision_fraction", 0.0)
    """share of every sequence's tokens that are <|media|> vision tokens (0: text
    only, the plan is exactly the text plan); the tower's activations, FLOPs and TP gather follow from it"""
    image_side: int = arg("data.image_side", 0)
    """side in pixels of the (square) images assumed; 0 = the position grid's
    pos_grid x patch_size (896 px, 64 x 64 patches, 1024 LM tokens at K3)"""
    offload: str = mirror("optim.offload")
    """optim.offload: 'none' or 'cpu' (the AdamW state and update in host memory, megak3/optim/offload.py)"""

    @classmethod
    def job_keys(cls) -> Dict[str, str]:
        """{job config key: PlanConfig field} of the fields that mirror the job config."""
        return {f.metadata["job"]: f.name for f in fields(cls) if "job" in f.metadata}

    @classmethod
    def arg_keys(cls) -> Dict[str, str]:
        """{key=value name: PlanConfig field} of the planner-only fields tools/plan.py sets."""
        return {f.metadata["arg"]: f.name for f in fields(cls) if "arg" in f.metadata}

    @classmethod
    def from_job(cls, job: JobConfig, world_size: int = 1, keys: Optional[Iterable[str]] = None,
                 **planner_only) -> "PlanConfig":
        """The plan of ``job`` on ``world_size`` ranks: every mirrored field read from the job config
        (only those named in ``keys``, job config keys, when given; the others keep the planner's
        defaults), ``planner_only`` (e.g. param_dtype, vision_fraction) set as given."""
        keys = None if keys is None else set(keys)
        kw = {}
        for f in fields(cls):
            key = f.metadata.get("job")
            if key is not None and (keys is None or key in keys):
                read = f.metadata["read"]
                kw[f.name] = read(job) if read is not None else job_value(job, key)
        return cls(world_size=world_size, **kw, **planner_only)

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
        b = self.qb_bins
        if isinstance(b, bool) or not isinstance(b, int) or b < 0 or b == 1:
            raise ValueError(f"model.moe.qb_bins={b!r} must be >= 2 (0 = the model config's)")
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
        default = not self.global_batch_size
        gbs = self.global_batch_size or default_global_batch(self.seq_len, self.micro_batch_size, dp, self.pp,
                                                             self.pp_schedule)
        rows = self.micro_batch_size * dp
        # the job config's layout checks (their one home: megak3.job.config.check_layout)
        check_layout(replace(self, sequence_parallel=sp), self.seq_len,
                     micro_batches=gbs // rows if gbs % rows == 0 else None)
        if gbs % rows:
            raise ValueError(f"global_batch_size={gbs} must be a multiple of micro_batch_size x dp = "
                             f"{self.micro_batch_size} x {dp}")
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


_KEYS: Dict[int, tuple] = {}


def _key(cfg: ModelConfig) -> str:
    """A cache key of a model config (its repr, memoised per object: the search asks thousands of times)."""
    hit = _KEYS.get(id(cfg))
    if hit is None or hit[0] is not cfg:
        hit = _KEYS[id(cfg)] = (cfg, repr(cfg))
    return hit[1]


def _tuple(x):
    return tuple(x) if x is not None else None


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0
