"""The RL loop: prompts -> N x K rollouts on the in-process engine -> rewards -> group advantages ->
a policy update through the production :class:`megak3.train.step.RankStep` -> weight refit into the engine.

One iteration (:meth:`RLRunner.iteration`):

1. New prompts (of ``rl.task``, or the mixture ``rl.tasks``: megak3/posttrain/tasks.py, each sample tagged with
   its task and effort) join the buffer as groups of K samples (each with response budget ``rl.max_tokens``)
   until it holds N groups: groups carried over from the last iteration (some sample unfinished) count towards N.
2. Generation (:class:`~megak3.posttrain.rollout.PartialRollouts` on each engine replica, each GRPO group on
   the replica the cache-affine router picks, :class:`~megak3.posttrain.engines.ReplicaRollouts`): paused samples first, then the new
   ones, until ``ceil(lambda * N * K)`` samples of the buffer are finished and at least one group has all K
   finished; the rest pause with their caches and continue next iteration under the new weights
   (``rl.partial_fraction = 1``: synchronous).
3. Rewards of the finished samples: the exact answer (rewards.exact_answer) or the user's ``rl.reward``
   function (one batched call), then the effort override
   when ``rl.effort_tau > 0`` (budget b0: ``rl.effort_budget`` tokens). ``rl.shuffle_rewards`` permutes the
   rewards across the update's samples (the control run: the reward no longer says anything about the sample).
4. Groups whose K samples are all finished are trained on: advantages per group, the learner's logprobs
   of every response token at the start of the update (``logp_old``), per-token staleness weights against the
   behaviour logprobs the engine recorded, the clipped loss (objective.py), ``RankStep.apply`` (ZeRO-1 reduce,
   global-norm clip, Muon/AdamW, QB bias update). With ``rl.mopd_teachers`` the per-token advantages are
   MOPD's, each row's from the teacher of its tag (megak3/posttrain/mopd.py).
5. The policy version goes up by one and the engine's model is refit from the trainer's in memory.

With ``rl.rollout.lag=1`` the next batch (steps 1-2) is generated before the update on this one, by the
weights this update starts from (one-step off-policy); with ``rl.rollout.placement=separate`` the engines run
on ranks of their own and each rank does its roles' part of the iteration (megak3/posttrain/placement.py).

Layouts: the trainer runs at any layout pretraining supports (megak3/posttrain/update.py): data, tensor
with or without sequence parallelism, pipeline with every schedule (the policy loss is the last stage's head,
every micro-batch padded to one fixed [rl.micro_batch_size, longest sample] shape), context parallelism (each
CP rank scores its segment of every row) and expert parallelism with or without tp. The rollout engines have
their own layout and count (``rl.rollout.*``, megak3/posttrain/engines.py: tp x ep replicas colocated on the
trainer's ranks, or on ranks of their own); the refit reshards the trainer's boxes into every engine rank's
boxes in memory (megak3/posttrain/refit.py) and records ``refit_s`` and ``refit_bytes`` (bytes received by this
rank's engine).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from parallel.plan import canonical_name
from parallel.state import ParallelState

from ..inference import Engine, SamplingParams
from ..model.k3 import build_model
from ..quant import apply_quantization
from ..job.config import JobConfig
from ..train.step import RankStep
from .buffer import Rollout, RolloutBuffer
from .engines import ReplicaRollouts, RolloutConfig, release_weights, replica_groups, restore_weights
from .placement import check_run, share, sharing_group, world_of
from .mopd import load_teachers, route
from .objective import LossConfig, group_advantages, token_logprobs
from .rewards import effort_override, exact_answer
from .refit import ReshardPlan
from .rollout import PartialRollouts
from .tasks import load_reward, parse_tasks, prompt_stream, rewards_by_tag, score_with, tag
from .update import policy_update, response_batch  # noqa: F401  (response_batch: part of this module's API)


@dataclass
class RLConfig:
    """The RL loop (``rl.*``)."""

    iterations: int = 20
    """policy updates to run"""
    prompts: int = 8
    """N: new prompts per iteration"""
    group_size: int = 4
    """K: rollouts per prompt (the group of the group-relative advantage)"""
    max_tokens: int = 8
    """response budget of a sample (fixed when it is created; a resumed sample keeps what is left)"""
    temperature: float = 1.0
    """sampling temperature of the rollouts; the behaviour logprobs are those of softmax(logits / T) and
    the trainer's logprobs (ratio, staleness weights, KL reference, MOPD teachers) use the same T (0: greedy, untempered)"""
    partial_fraction: float = 1.0
    """lambda: the update starts once ceil(lambda N K) samples are finished (1.0: synchronous rollouts)"""
    update_groups: int = 0
    """> 0: the update starts once this many groups have all K samples finished, instead of the
    partial_fraction count (which includes the finished members of carried-over groups)"""
    max_staleness: int = 0
    """> 0: before an update, every unfinished group holding a token this many or more policy versions old
    is run to its end, so no trained token is more than max_staleness versions behind the policy it
    updates (0: no bound)"""
    micro_batch_size: int = 16
    """rollouts per forward/backward of the update"""
    task: str = "add"
    """the verifiable demo task family (megak3/data/demo_sft.py FAMILIES) when rl.tasks is empty"""
    tasks: str = ""
    """a prompt mixture NAME[@EFFORT][:WEIGHT],... (megak3/posttrain/tasks.py), e.g. add:0.5,reverse:0.5; every
    sample is tagged with its task and effort (empty: rl.task alone)"""
    reward: str = ""
    """module:function, a batched reward (prompts, completions, metadata) -> floats used instead of the exact
    answer (megak3/posttrain/tasks.py; empty: the exact answer)"""
    shuffle_rewards: bool = False
    """control: permute the rewards across the update's samples"""
    effort_tau: float = 0.0
    """effort control: reward -1 when a response exceeds effort_tau * effort_budget tokens (0: off)"""
    effort_budget: float = 0.0
    """b0 of every prompt, in response tokens (with effort_tau > 0)"""
    seed: int = 0
    """prompt order and sampling seeds"""
    mopd_teachers: str = ""
    """MOPD: TAG=PATH,... teacher checkpoints (megak3 or Hugging Face) or served teachers (TAG=http://HOST:PORT,
    a megak3 server: megak3/posttrain/teacher_client.py) by sample tag, or one untagged PATH for
    every sample (megak3/posttrain/mopd.py); the advantage of every response token becomes
    clip(log pi_teacher - log pi_theta, -mopd_r_max, mopd_r_max) with the teacher of the sample's own tag
    (empty: the task reward and group advantages)"""
    mopd_r_max: float = 1.0
    """R_max of the MOPD per-token reward"""
    mopd_timeout_s: float = 120.0
    """a served teacher's per-request timeout in seconds"""
    mopd_retries: int = 2
    """retries of a served teacher's request after a connection error, timeout or 5xx"""
    ignore_eos: bool = False
    """sample every response to its full budget (benchmarks: lengths set by the budgets alone)"""
    engine_dtype: str = "float32"
    """dtype of the engine's copy of the policy ('float32' or 'bfloat16')"""
    env: str = ""
    """agentic RL: a megak3.envs task family ('ledger', 'fixbug'); every sample is a multi-turn episode in a
    sandbox (megak3/posttrain/agentic.py) and rl.max_tokens the budget of one model turn (empty: rl.task)"""
    max_turns: int = 0
    """with rl.env: model turns per episode (0: the family's default)"""
    episode_tokens: int = 1024
    """with rl.env: budget of a whole trajectory after its prompt (model turns and tool messages)"""
    obs_tokens: int = 64
    """with rl.env: a tool observation keeps its first obs_tokens tokens"""
    env_workers: int = 2
    """with rl.env: environment worker processes (megak3.envs.EnvPool)"""
    loss: LossConfig = field(default_factory=LossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def validate(self) -> "RLConfig":
        def need(ok, f, rule):
            if not ok:
                raise ValueError(f"rl.{f}={getattr(self, f)!r} {rule}")

        for f in ("iterations", "prompts", "group_size", "max_tokens", "micro_batch_size"):
            need(getattr(self, f) >= 1, f, "must be >= 1")
        need(self.temperature >= 0, "temperature", "must be >= 0")
        need(0 < self.partial_fraction <= 1, "partial_fraction", "must lie in (0, 1]")
        need(0 <= self.update_groups <= self.prompts, "update_groups", "must lie in [0, rl.prompts]")
        need(self.max_staleness >= 0, "max_staleness", "must be >= 0 (0: no bound)")
        need(self.effort_tau >= 0, "effort_tau", "must be >= 0")
        need(self.effort_tau == 0 or self.effort_budget > 0, "effort_budget", "must be > 0 with rl.effort_tau > 0")
        need(self.mopd_r_max > 0, "mopd_r_max", "must be > 0")
        need(self.mopd_timeout_s > 0, "mopd_timeout_s", "must be > 0 (seconds)")
        need(self.mopd_retries >= 0, "mopd_retries", "must be >= 0")
        need(self.engine_dtype in ("float32", "bfloat16"), "engine_dtype", "must be 'float32' or 'bfloat16'")
        from ..data.demo_sft import FAMILIES

        need(self.task in FAMILIES, "task", f"must be one of {', '.join(FAMILIES)}")
        parse_tasks(self.tasks, self.task)
        mod, _, fn = self.reward.partition(":")
        need(not self.reward or (mod and fn), "reward", "must be module:function, e.g. rl.reward=my_rewards:score")
        from ..envs.tasks import FAMILIES as ENV_FAMILIES

        need(self.env in ("",) + tuple(ENV_FAMILIES), "env", f"must be '' or one of {', '.join(ENV_FAMILIES)}")
        need(self.max_turns >= 0, "max_turns", "must be >= 0 (0: the task family's default)")
        for f in ("episode_tokens", "obs_tokens", "env_workers"):
            need(getattr(self, f) >= 1, f, "must be >= 1")
        self.loss.validate()
        self.rollout.validate()
        return self


def policy_copy(job: JobConfig, ps: ParallelState, device, dtype, parallel=None) -> tuple:
    """(model, ParallelPlan): a copy of the policy at layout ``parallel`` (default: the trainer's) on the
    process groups ``ps``, with the same quantisation, in ``dtype``, in eval mode; its weights are the
    initialisation's until a refit or copy fills them."""
    from parallel.materialize import materialize
    from parallel.parallelize import parallelize

    m = build_model(job.model, device="meta")
    plan = parallelize(m, ps, parallel or job.parallel, job.moonep)
    materialize(m, plan, job.train.seed, job.model.init_std, device)
    apply_quantization(m, job.quant)
    return m.to(dtype=dtype).eval(), plan


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module, plan=None) -> int:
    """Copy every tensor of ``src``'s state into ``dst`` by canonical name (in memory, casting dtypes).
    Without ``plan`` both hold the same boxes (this rank's shards into this rank's shards). With
    ``dst``'s :class:`parallel.plan.ParallelPlan`, ``src`` holds whole tensors (a one-process model) and
    each of ``dst``'s tp / ep shards takes its box of them. Returns the number of tensors copied."""
    want = {canonical_name(k): v for k, v in dst.state_dict().items()}
    n = 0
    for k, v in src.state_dict().items():
        name = canonical_name(k)
        d = want.pop(name, None)
        sh = plan.tensors.get(name) if plan is not None and d is not None else None
        if sh is not None and tuple(v.shape) == tuple(sh.global_shape):
            v = v[tuple(slice(o, o + s) for o, s in zip(sh.offsets, sh.local_shape))]
        if d is None or d.shape != v.shape:
            raise ValueError(f"refit: tensor {name} {tuple(v.shape)} has no match in the "
                             f"{'engine' if plan is None else 'trainer'}'s model "
                             f"({None if d is None else tuple(d.shape)})")
        d.copy_(v)
        n += 1
    if want:
        raise ValueError(f"refit: the {'engine' if plan is None else 'trainer'}'s model has tensors the source "
                         f"lacks, e.g. {sorted(want)[:3]}")
    return n




class RLRunner:
    """One rank of an RL run (module docstring). ``ps``: the trainer's ParallelState (None: one process; with
    ``rl.rollout.placement=separate`` None on an engine rank: megak3.posttrain.placement.init_rl_parallel).
    ``init_from``: a megak3 checkpoint/run directory or a Hugging Face directory whose weights start the policy
    (None: the RankStep's initialisation). ``model``/``rs``/``ps`` are None on a rank that does not train,
    ``engine``/``sampler`` on one that does not generate."""

    def __init__(self, job: JobConfig, rl: RLConfig, tokenizer, ps: Optional[ParallelState] = None,
                 device="cpu", init_from: Optional[str] = None, engine_options: Optional[dict] = None,
                 budgets: Optional[Callable[[], List[int]]] = None):
        self.job, self.rl, self.tokenizer = job, rl.validate(), tokenizer
        check_run(rl, job.parallel)
        rank, world = world_of(ps, rl.rollout.placement)
        self.rollout = rl.rollout.resolve(job.parallel, world, job.model)
        T = self.rollout.trainer_ranks(world)  # this rank trains when it is one of the world's first T
        if rank < T:
            ps = ps or ParallelState.single()
            if ps.world_size != T:
                raise ValueError(f"rl.rollout.placement={self.rollout.placement}: the trainer's layout spans "
                                 f"{ps.world_size} ranks but the world's {world} leave it {T}; build it with "
                                 "megak3.posttrain.placement.init_rl_parallel")
        self.ps = ps if rank < T else None
        self.rs = self.model = None
        if self.ps is not None:
            # micro-batches per update vary (update.py pads them to a multiple of pp under interleaved_1f1b);
            # pp of them is a count every schedule accepts, and each step's own is checked when it runs
            self.rs = RankStep(job, ps, device, grad_accum=ps.pp_size)
            self.model = self.rs.model
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[rl.engine_dtype]
        # the engines sample from the same (fake-)quantised model, at their own layout (engines.py)
        self.replica, self.engine_ps = replica_groups(self.rollout, job.parallel, rank, world)
        self._share_group = sharing_group(T, job.parallel.timeout_s) if T < world else None
        self.engine, self.engine_plan = None, None
        if self.replica is not None:
            m, self.engine_plan = policy_copy(job, self.engine_ps, device, dtype, self.rollout.parallel(job.parallel))
            self.engine = Engine(m, tokenizer, **(engine_options or {}))
        if init_from and self.model is not None:
            src = Engine.from_pretrained(init_from, device=device).model  # whole tensors (any saved layout)
            copy_weights(src, self.model, self.rs.plan)  # each rank takes its tp / ep boxes
        self.ref_model = self.ref_pipe = None
        if rl.loss.kl_coef > 0 and self.ps is not None:  # the reference policy at the trainer's layout (pp included)
            self.ref_model, ref_plan = policy_copy(job, ps, device, torch.float32)
            copy_weights(self.model, self.ref_model)
            if ps.pp_size > 1:
                from parallel.pipeline import PipelineEngine

                self.ref_pipe = PipelineEngine(self.ref_model, ref_plan.stage_chunks, ps.pp_group,
                                               job.parallel.pp_schedule, seq_shard=self.rs.engine.seq_shard,
                                               timeout_s=job.parallel.timeout_s)
        self._reshard = None
        self.last_refit: dict = {}
        """the last refit's ``seconds``, ``bytes_in`` (landed in this rank's engine), ``bytes_remote``,
        ``bytes_out``, ``shard_bytes`` (refit.py)"""
        self.task_specs = parse_tasks(rl.tasks, rl.task)
        self.reward_fn = (load_reward(rl.reward, tokenizer, next(prompt_stream(tokenizer, self.task_specs, rl.seed)))
                          if rl.reward else None)
        # MOPD: checked against the student (tokenizer, vocabulary, special ids) before any rollout
        found = (load_teachers(rl.mopd_teachers, tokenizer, job.model.vocab_size, device, rl.temperature,
                               rl.mopd_timeout_s, rl.mopd_retries) if rl.mopd_teachers and self.ps is not None else [])
        self.teachers = [t.model for t in found]
        self.teacher_tags = [t.tag for t in found]
        self.teacher_routes = route([rl.env] if rl.env else [t.tag for t in self.task_specs], found,
                                    rl.mopd_teachers) if found else {}
        """sample tag -> index of its teacher in ``teachers``"""
        self.budgets = budgets
        """callable -> K response budgets of a new group (default: rl.max_tokens each)"""
        self.version = 0
        self.refit()
        self.buffer = RolloutBuffer(rl.group_size)
        inner = None if self.engine is None else PartialRollouts(
            self.engine, SamplingParams(max_tokens=rl.max_tokens, temperature=rl.temperature,
                                        ignore_eos=rl.ignore_eos), seed=rl.seed)
        E, samplers = self.rollout.size, world - self.rollout.engine_offset(world)  # ranks that generate
        self.sampler = None if rank < self.rollout.engine_offset(world) else ReplicaRollouts(
            inner, self.replica, self.rollout.replicas, leader=self.engine_ps is not None and self.engine_ps.rank == 0,
            sync=not (self.rollout.replicas == 1 and E == samplers),
            checkpoint_interval=(engine_options or {}).get("checkpoint_interval", 512),
            group=self.engine_ps.host_group if T < world and self.engine_ps is not None else None)
        """generation on this rank (None on a trainer rank of the separate placement)"""
        self._trainers, self._pending = T, None
        """the batch generated ahead (rl.rollout.lag=1) or being trained, (record, groups)"""
        self.prompts = prompt_stream(tokenizer, self.task_specs, rl.seed)
        self.prompts_used = 0
        self.state = None
        """a :class:`~megak3.posttrain.checkpoint.RLCheckpoint` when the run is resumable (:meth:`resumable`)"""
        self._rng = random.Random(rl.seed)
        self.history: List[dict] = []

    def resumable(self, run_dir, save_interval: int = 1, resume: str = "auto", keep_last: int = 2) -> bool:
        """Checkpoint the run under ``run_dir`` from now on (megak3/posttrain/checkpoint.py: every
        ``save_interval`` versions and at the last; the journal of finished samples always) and restore
        what ``resume`` names (``train.resume``: auto, none or a checkpoint). True when a state was restored."""
        from .checkpoint import RLCheckpoint

        self.state = RLCheckpoint(self, run_dir, save_interval, keep_last)
        if self.sampler is not None:  # a rank that generates (not a trainer rank of the separate placement)
            self.sampler.on_finish = self.state.journal
        return self.state.restore(resume)

    def extra_state(self) -> dict:
        """More RL state for the checkpoint (plain data); a subclass adds its own."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        """Restore what :meth:`extra_state` returned."""

    def skip_prompts(self, n: int) -> None:
        """Continue the prompt stream after its first ``n`` prompts (a restored run)."""
        self.prompts = prompt_stream(self.tokenizer, self.task_specs, self.rl.seed)
        for _ in range(n):
            next(self.prompts)
        self.prompts_used = n

    def refit(self) -> float:
        """Reshard the trainer's weights into every engine rank's (in memory, refit.py; every rank calls
        it); returns the seconds it took, ``last_refit`` has the bytes."""
        t0 = time.perf_counter()
        if self._reshard is None:  # planned once from both layouts' boxes
            self._reshard = ReshardPlan(self.model, self.rs and self.rs.plan, self.engine and self.engine.model,
                                        self.engine_plan, self.replica, self.job.parallel.timeout_s)
        if self.engine is not None:
            restore_weights(self.engine.model)  # released during the update (rl.rollout.release)
        self.last_refit = self._reshard.run()
        return time.perf_counter() - t0

    def release_engine(self) -> int:
        """Free this rank's engine weights until the next :meth:`refit` (colocated time-sharing);
        returns the bytes freed."""
        if self.engine is None or not self.rollout.release:
            return 0
        return release_weights(self.engine.model)

    # ------------------------------------------------------------------------------ one iteration
    def generate(self) -> dict:
        rl = self.rl
        for _ in range(rl.prompts - self.buffer.num_groups()):  # the carried-over groups count towards N
            p = next(self.prompts)
            self.prompts_used += 1
            self.buffer.add_prompt(p.ids, self.budgets() if self.budgets else rl.max_tokens, p.answer, p.task, p.effort)
        if self.state is not None:
            self.state.save_buffer()
        buf = self.buffer
        t0 = time.perf_counter()
        if rl.update_groups > 0:
            while buf.unfinished() and buf.num_trainable() < rl.update_groups:
                self.sampler.run(buf.unfinished(), self.version, stop_after=1)
        else:
            need = math.ceil(rl.partial_fraction * rl.prompts * rl.group_size) - buf.num_finished()
            if need > 0:
                self.sampler.run(buf.unfinished(), self.version, stop_after=need)
        while not buf.has_trainable() and buf.unfinished():  # something to train on
            self.sampler.run(buf.unfinished(), self.version, stop_after=1)
        trains_at = self.version + self.rollout.lag  # the version whose update takes this batch
        while rl.max_staleness > 0 and buf.unfinished() and buf.stale_unfinished(trains_at, rl.max_staleness):
            self.sampler.run(buf.unfinished(), self.version, stop_after=1)
        return {"gen_s": time.perf_counter() - t0, "paused": len(self.buffer.unfinished())}

    def score(self, groups: List[List[Rollout]]) -> torch.Tensor:
        rl = self.rl
        if self.reward_fn is not None:  # rl.reward: one batched call over the samples still unscored
            score_with(self.reward_fn, rl.reward, self.tokenizer, [r for g in groups for r in g if r.reward is None])
        R = torch.tensor([[exact_answer(r.text, r.answer) if r.reward is None else r.reward for r in g]
                          for g in groups], dtype=torch.float64)
        if rl.effort_tau > 0:
            lens = torch.tensor([[len(r.token_ids) for r in g] for g in groups], dtype=torch.float64)
            R = effort_override(R, lens, torch.full_like(R, rl.effort_budget), rl.effort_tau)
        for g, row in zip(groups, R.tolist()):
            for r, v in zip(g, row):
                r.reward = v
        return R

    def collect(self) -> Optional[tuple]:
        """Generate a batch (:meth:`generate`) and take its trainable groups: (record, groups); None on a
        rank that does not generate (a trainer rank of the separate placement)."""
        if self.sampler is None:
            return None
        rec = self.generate()
        return rec, self.buffer.take_trainable()

    def _share(self, produced) -> tuple:
        """The batch on every rank: as it is when colocated, sent to the trainer ranks when separate."""
        return produced if self._share_group is None else share(produced, self._trainers, self._share_group)

    def iteration(self) -> dict:
        """One update on a batch (its groups' rewards, advantages, update, refit), every rank's part of it for
        its roles; with ``rl.rollout.lag=1`` the next batch is generated first (placement.py)."""
        if self._pending is None:
            self._pending = self._share(self.collect())
        gen, groups = self._pending
        ahead = self.rollout.lag > 0 and self.version + 1 < self.rl.iterations
        nxt = self.collect() if ahead else None  # by this version's weights, before its update
        rec = {"iteration": self.version, **gen}
        rec["groups"] = len(groups)
        if groups:
            samples = [r for g in groups for r in g]
            sampled = [v for r in samples for v in r.versions if v >= 0]  # -1: context tokens
            rec["staleness"] = sum(self.version - v for v in sampled) / max(len(sampled), 1)
            if self.model is not None:
                rec.update(self.learn(groups))
            rec["trained"] = len(samples)
            rec["uids"] = [r.uid for r in samples]
        if ahead:
            nxt = self._share(nxt)
        self._pending = nxt
        if groups:
            self.version += 1
            rec["refit_s"] = self.refit()
            rec["refit_bytes"] = self.last_refit["bytes_in"]
        self.history.append(rec)
        if groups and self.state is not None:
            self.state.after_update()
        return rec

    def learn(self, groups: List[List[Rollout]]) -> dict:
        """Rewards, group advantages and one update on ``groups`` (a trainer rank): the update's record."""
        R = self.score(groups)
        rec = {"reward": float(R.mean())}
        if len(self.task_specs) > 1:  # the mixture: the mean reward of each tag's samples
            rec.update(rewards_by_tag(groups, R))
        train_R = R
        if self.rl.shuffle_rewards:
            flat = R.flatten()[torch.randperm(R.numel(), generator=torch.Generator().manual_seed(
                self.rl.seed * 7919 + self.version))]
            train_R = flat.view_as(R)
        adv = group_advantages(train_R, self.rl.loss.advantage_scale)
        t0 = time.perf_counter()
        rec.update(self.update([r for g in groups for r in g], adv.flatten().float()))
        rec["train_s"] = time.perf_counter() - t0
        return rec

    # ---------------------------------------------------------------------------------- update
    def _logp(self, model, mb) -> tuple:
        out = model(mb["input_ids"], cu_seqlens=mb["cu_seqlens"], return_logits=True)
        return self._logits_logp(out.logits, mb["targets"]), out.moe_stats

    def _logits_logp(self, logits, targets) -> torch.Tensor:
        """Token logprobs of ``targets`` [B, T] from ``logits`` [B, T, V] (or this tp rank's V/tp columns)."""
        V = self.job.model.vocab_size
        if self.rl.temperature > 0:   # the distribution the engine sampled from (its behaviour logprobs)
            logits = logits.float() / self.rl.temperature
        if logits.shape[-1] == V:
            return token_logprobs(logits, targets)
        # tensor parallel: this rank's vocabulary columns; log p = -(vocab-parallel cross entropy)
        from parallel.tensor_parallel.vocab import vocab_parallel_cross_entropy

        Vl = logits.shape[-1]
        nll = vocab_parallel_cross_entropy(logits.reshape(-1, Vl).float(), targets.reshape(-1),
                                           self.ps.tp_group, reduction="none")
        return -nll.view(targets.shape)

    def teacher_of(self, r: Rollout) -> int:
        """Index of the teacher of sample ``r``: its tag's (rl.mopd_teachers), else its task's, else 0."""
        t = tag(r.task, r.effort)
        return self.teacher_routes.get(t, self.teacher_routes.get(r.task, 0))

    def update(self, samples: List[Rollout], adv_N: torch.Tensor) -> dict:
        """One optimizer step on ``samples`` (every rank passes the same list; each trains its slice) at the
        trainer's layout (megak3/posttrain/update.py). Frees the engine's weights first (rl.rollout.release):
        :meth:`refit` re-creates them."""
        self.release_engine()
        return policy_update(self, samples, adv_N)

    def fit(self, log=print) -> List[dict]:
        """Run iterations until ``rl.iterations`` updates are done (counting a restored run's)."""
        while self.version < self.rl.iterations:
            rec = self.iteration()
            if log:
                log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                         if k != "uids"))
        return self.history
