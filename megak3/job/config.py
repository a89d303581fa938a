"""The training job's schema: one dataclass per Hydra group (conf/config.yaml).

Every field is typed with a one-line docstring. ``JobConfig.validate()`` runs every section's
checks and the cross-section ones (batch divisibility, the layout against the data and model in
:func:`check_layout`, sequence length vs the model's limit) before any work starts; each error
names the field and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from moonep.config import MoonEPConfig
from parallel.config import ParallelConfig, check_expert_tp

from ..config import ModelConfig
from ..data.config import DataConfig
from ..metrics.config import LoggingConfig
from ..optim.config import OptimConfig
from ..quant.config import QuantConfig


def check_layout(par, seq_len: int, model_cfg: Optional[ModelConfig] = None,
                 micro_batches: Optional[int] = None) -> None:
    """Raise ValueError naming the field and the fix when a parallel layout cannot run this data
    and model: expert parallelism with TP needs SP, CP's split of ``seq_len``
    (parallel.context_parallel.check_context_parallel), SP's split of ``seq_len`` over TP, and the
    pipeline schedule (its name and ``vp``; the ``micro_batches`` of one step when given and pp > 1).

    The one home of these checks: JobConfig.validate calls it, and so may any caller that holds a
    layout. ``par``: a parallel.config.ParallelConfig, or anything with its fields tp, cp, pp, vp,
    ep, sequence_parallel, pp_schedule, cp_balance, cp_balance_split (e.g. the planner's
    PlanConfig); ``model_cfg``, when given, adds the KDA conv halo check of CP.
    """
    from parallel.context_parallel import check_context_parallel
    from parallel.pipeline.schedules import check_schedule

    check_expert_tp(par.ep, par.tp, par.sequence_parallel)
    check_context_parallel(par.cp, par.tp, par.sequence_parallel, seq_len, model_cfg,
                           balance_split=par.cp_balance_split if par.cp_balance else 0)
    if par.sequence_parallel and par.tp > 1 and seq_len % par.tp:
        raise ValueError(f"data.seq_len={seq_len} must be a multiple of parallel.tp={par.tp} "
                         "with parallel.sequence_parallel=true")
    check_schedule(par.pp_schedule, par.pp, par.vp, micro_batches if par.pp > 1 else None)


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = 200
    """optimizer steps to run"""
    global_batch_size: int = 16
    """sequences per optimizer step (summed over micro-batches and data-parallel ranks)"""
    micro_batch_size: int = 8
    """sequences per forward/backward on each data-parallel rank; global / (micro x dp) micro-batches are accumulated"""
    seed: int = 1234
    """seed for weight init (a pure function of seed and parameter name) and any sampling"""
    precision: str = "fp32"
    """'fp32' or 'bf16' (bf16 autocast for matmuls; fp32 master weights)"""
    recompute: str = "none"
    """activation recomputation: 'none' (keep all), 'full' (rerun each decoder layer in backward) or 'selective' (keep GEMM outputs and attention cores, rerun the element-wise work; megak3/model/recompute.py)"""
    activation_checkpointing: bool = False
    """alias of recompute='full' (kept for old commands); use train.recompute"""
    device: str = "auto"
    """'auto' (cuda if available), 'cpu' or 'cuda'"""
    eval_interval: int = 100
    """steps between validation runs (0: only at start and end)"""
    eval_batches: int = 8
    """micro-batches per validation run (0: no validation at all)"""
    save_interval: int = 100
    """steps between checkpoints (0: only at the end)"""
    keep_last: int = 2
    """complete checkpoints kept on disk (older ones are pruned)"""
    async_save: bool = False
    """checkpoint in the background: copy the shards to host memory, keep training while they are written"""
    nonfinite: str = "skip"
    """a step whose global gradient norm (hence loss) is NaN/inf: 'skip' it (no update, counted) or 'stop'"""
    max_nonfinite_steps: int = 10
    """with nonfinite=skip: stop with an error once more than this many steps were skipped"""
    init_from_hf: Optional[str] = None
    """Hugging Face checkpoint directory (model.safetensors.index.json + shards, e.g. the released Kimi K3) whose weights replace the initialisation; each rank reads only its shards (train.resume, when it finds a checkpoint, wins)"""
    resume: str = "none"
    """'none', 'auto' (newest complete checkpoint in run_dir/checkpoints) or a checkpoint directory"""
    run_dir: Optional[str] = None
    """where metrics, checkpoints and the wandb run go; default: Hydra's output directory"""
    threads: int = 0
    """torch intra-op threads per rank (0: the cores this process may use / ranks on this node, at least 1)"""

    def validate(self) -> "TrainConfig":
        def need(ok, f, rule):
            if not ok:
                raise ValueError(f"train.{f}={getattr(self, f)!r} {rule}")

        need(self.max_steps > 0, "max_steps", "must be > 0")
        need(self.micro_batch_size > 0, "micro_batch_size", "must be > 0")
        need(self.global_batch_size > 0, "global_batch_size", "must be > 0")
        need(self.global_batch_size % self.micro_batch_size == 0, "global_batch_size",
             f"must be a multiple of train.micro_batch_size={self.micro_batch_size}")
        need(self.precision in ("fp32", "bf16"), "precision", "must be 'fp32' or 'bf16'")
        need(self.device in ("auto", "cpu", "cuda"), "device", "must be 'auto', 'cpu' or 'cuda'")
        for f in ("eval_interval", "eval_batches", "save_interval", "threads"):
            need(getattr(self, f) >= 0, f, "must be >= 0")
        need(self.keep_last >= 1, "keep_last", "must be >= 1")
        need(self.nonfinite in ("skip", "stop"), "nonfinite", "must be 'skip' or 'stop'")
        need(self.recompute in ("none", "full", "selective"), "recompute", "must be 'none', 'full' or 'selective'")
        if self.activation_checkpointing and self.recompute != "full":
            need(self.recompute == "none", "recompute",
                 "conflicts with train.activation_checkpointing=true (an alias of recompute=full); drop one")
        need(self.max_nonfinite_steps >= 0, "max_nonfinite_steps", "must be >= 0")
        need(self.init_from_hf is None or str(self.init_from_hf).strip() != "", "init_from_hf",
             "must be a directory path or null")  # the directory itself: compose.check_local / RankStep
        return self

    def recompute_mode(self) -> str:
        """train.recompute with the alias applied: 'full' when activation_checkpointing=true."""
        return "full" if self.activation_checkpointing else self.recompute


@dataclass
class JobConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """the architecture (conf/model/)"""
    data: DataConfig = field(default_factory=DataConfig)
    """dataset, tokenizer and packing (conf/data/)"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """optimizer and LR schedule (conf/optim/)"""
    train: TrainConfig = field(default_factory=TrainConfig)
    """the loop: steps, batches, precision, checkpoints (conf/train/)"""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """console, JSONL, wandb, telemetry (conf/logging/)"""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """parallel layout (conf/parallel/)"""
    quant: QuantConfig = field(default_factory=QuantConfig)
    """quantization-aware training / FP8 (conf/quant/)"""
    moonep: MoonEPConfig = field(default_factory=MoonEPConfig)
    """expert-parallel dispatch when parallel.ep > 1 (conf/moonep/)"""

    def validate(self, world_size: int = 1) -> "JobConfig":
        self.model.validate()
        self.data.validate()
        self.train.validate()
        self.optim.validate(self.train.max_steps)
        self.logging.validate()
        self.quant.validate()
        etp = self.parallel.etp  # the grid has it, the trainer not yet
        if isinstance(etp, int) and not isinstance(etp, bool) and etp > 1:
            raise ValueError(f"parallel.etp={etp}: expert tensor parallelism is not built yet; set parallel.etp=1")
        self.parallel.validate(world_size, self.model)
        par, t = self.parallel, self.train
        rows = t.micro_batch_size * par.resolved_dp(world_size)
        check_layout(par, self.data.seq_len, self.model,
                     micro_batches=t.global_batch_size // rows if t.global_batch_size % rows == 0 else None)
        self.moonep.validate(self.model.moe.num_experts, self.parallel.ep)
        if self.data.path in ("demo", "demo_vision") and self.data.vocab_size > self.model.vocab_size:
            raise ValueError(f"data.vocab_size={self.data.vocab_size} exceeds model.vocab_size={self.model.vocab_size}; "
                             "lower data.vocab_size or raise model.vocab_size")
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                             f"{self.model.max_seq_len}; lower data.seq_len")
        return self
