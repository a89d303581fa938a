"""The RL loop: prompts -> N x K rollouts on the in-process engine -> rewards -> group advantages ->
a policy update through the production :class:`megak3.train.step.RankStep` -> weight refit into the engine.

One iteration (:meth:`RLRunner.iteration`):

1. New prompts (of ``rl.task``, or the mixture ``rl.tasks``: megak3/posttrain/tasks.py, each sample tagged with
   its task and effort) join the buffer as groups of K samples (each with response budget ``rl.max_tokens``)
   until it holds N groups: groups carried over from the last iteration (some sample unfinished) count towards N.
2. Generation (:class:`~megak3.posttrain.rollout.PartialRollouts`): paused samples first, then the new
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

Layouts: one process, data parallelism (each rank trains its contiguous slice of the update's samples; the
loss is normalised by the count over the data-parallel group, so gradients match one process), tensor
parallelism with or without sequence parallelism (the engine's model has the trainer's plan without sequence
parallelism, which decoding cannot use; the weight shards are the same, so the refit copies each rank's own
shards; token logprobs come from the vocabulary-parallel cross entropy; under sequence parallelism the rows are
padded to a multiple of tp) and expert parallelism without tp (every rank runs the same number of micro-batches
of the same shape, the largest over the data-parallel ranks, padded with masked rows, as MoonEP's dispatch needs).
Quantile-Balancing statistics count the samples' tokens, never padding. Pipeline and context parallelism, and
ep > 1 with tp > 1, raise an error naming the ``parallel.*`` field.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from parallel.parallelize import sync_partial_grads
from parallel.plan import canonical_name
from parallel.state import ParallelState

from ..data.packing import IGNORE_INDEX
from ..inference import Engine, SamplingParams
from ..model.k3 import build_model
from ..quant import apply_quantization
from ..job.config import JobConfig
from ..train.step import RankStep, all_reduce_sum
from .buffer import Rollout, RolloutBuffer
from .objective import LossConfig, group_advantages, policy_loss, staleness_weights, token_logprobs
from .mopd import distil_advantages, kl_report, load_teachers, new_tally, route
from .rewards import effort_override, exact_answer
from .rollout import PartialRollouts
from .tasks import load_reward, parse_tasks, prompt_stream, rewards_by_tag, score_with, tag


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
    """sampling temperature of the rollouts"""
    partial_fraction: float = 1.0
    """lambda: the update starts once ceil(lambda N K) samples are finished (1.0: synchronous rollouts)"""
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
    """MOPD: TAG=PATH,... teacher checkpoints (megak3 or Hugging Face) by sample tag, or one untagged PATH for
    every sample (megak3/posttrain/mopd.py); the advantage of every response token becomes
    clip(log pi_teacher - log pi_theta, -mopd_r_max, mopd_r_max) with the teacher of the sample's own tag
    (empty: the task reward and group advantages)"""
    mopd_r_max: float = 1.0
    """R_max of the MOPD per-token reward"""
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

    def validate(self) -> "RLConfig":
        def need(ok, f, rule):
            if not ok:
                raise ValueError(f"rl.{f}={getattr(self, f)!r} {rule}")

        for f in ("iterations", "prompts", "group_size", "max_tokens", "micro_batch_size"):
            need(getattr(self, f) >= 1, f, "must be >= 1")
        need(self.temperature >= 0, "temperature", "must be >= 0")
        need(0 < self.partial_fraction <= 1, "partial_fraction", "must lie in (0, 1]")
        need(self.effort_tau >= 0, "effort_tau", "must be >= 0")
        need(self.effort_tau == 0 or self.effort_budget > 0, "effort_budget", "must be > 0 with rl.effort_tau > 0")
        need(self.mopd_r_max > 0, "mopd_r_max", "must be > 0")
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
        return self


def check_layout(ps: ParallelState, job: JobConfig) -> None:
    for name, size in (("pp", ps.pp_size), ("cp", ps.cp_size)):
        if size > 1:
            raise ValueError(f"parallel.{name}={size}: the RL loop runs one process, data, tensor (with or without "
                             f"sequence parallelism) and expert parallelism; set parallel.{name}=1")
    if ps.ep_size > 1 and ps.tp_size > 1:
        raise ValueError(f"parallel.ep={ps.ep_size} with parallel.tp={ps.tp_size}: the RL loop's engine generates "
                         "without sequence parallelism, which expert parallelism under tp needs; set parallel.tp=1 "
                         "or parallel.ep=1")


def engine_parallel(job: JobConfig):
    """The trainer's ``parallel.*`` with sequence parallelism off: the engine decodes one token per
    sequence, which cannot be split over the TP ranks; the weights' shards are the same either way."""
    import dataclasses

    return dataclasses.replace(job.parallel, sequence_parallel=False)


def engine_model(job: JobConfig, ps: ParallelState, device, dtype) -> torch.nn.Module:
    """The engine's copy of the policy, laid out like the trainer's (same parallelize plan without
    sequence parallelism, so a refit is a local copy of this rank's shards), with the same quantisation."""
    from parallel.materialize import materialize
    from parallel.parallelize import parallelize

    m = build_model(job.model, device="meta")
    plan = parallelize(m, ps, engine_parallel(job), job.moonep)
    materialize(m, plan, job.train.seed, job.model.init_std, device)
    apply_quantization(m, job.quant)
    return m.to(dtype=dtype).eval()


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module, plan=None) -> int:
    """Copy every tensor of ``src``'s state into ``dst`` by canonical name (in memory, casting dtypes).
    Without ``plan`` both hold the same boxes (a refit: this rank's shards into this rank's shards). With
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


def response_batch(samples: List[Rollout], pad_id: int, multiple: int = 1, rows: int = 0,
                   length: int = 0) -> Dict[str, torch.Tensor]:
    """Rows ``prompt + response`` shifted for next-token scoring: ``input_ids``/``targets`` [B, T],
    ``mask`` (1 at positions whose target is a response token), ``behaviour`` logprobs there, and
    ``cu_seqlens`` (one segment per row, padding its own segment), ``real`` (True at the input positions
    that are tokens of a sample, not padding). B is at least ``rows`` (extra rows:
    padding, mask 0) and T at least ``length``, rounded up to a multiple of ``multiple`` (the
    sequence-parallel shard count)."""
    T = max([length] + [len(s.prompt_ids) + len(s.token_ids) - 1 for s in samples])
    T = -(-T // multiple) * multiple
    B = max(len(samples), rows)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    tgt = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros(B, T)
    beh = torch.zeros(B, T)
    real = torch.zeros(B, T, dtype=torch.bool)
    cu = [0]
    for b, s in enumerate(samples):
        full = list(s.prompt_ids) + list(s.token_ids)
        L, P = len(full) - 1, len(s.prompt_ids)
        ids[b, :L] = torch.tensor(full[:-1])
        tgt[b, :L] = torch.tensor(full[1:])
        mask[b, P - 1:L] = torch.tensor(s.mask, dtype=torch.float32) if s.mask else 1  # model tokens only
        real[b, :L] = True
        beh[b, P - 1:L] = torch.tensor(s.logprobs, dtype=torch.float32)
        cu += [b * T + L] if L < T else []
        cu.append((b + 1) * T)
    cu += [(b + 1) * T for b in range(len(samples), B)]
    return {"input_ids": ids, "targets": tgt, "mask": mask, "behaviour": beh, "real": real,
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}


class RLRunner:
    """One rank of an RL run (module docstring). ``init_from``: a megak3 checkpoint/run directory or a
    Hugging Face directory whose weights start the policy (None: the RankStep's initialisation)."""

    def __init__(self, job: JobConfig, rl: RLConfig, tokenizer, ps: Optional[ParallelState] = None,
                 device="cpu", init_from: Optional[str] = None, engine_options: Optional[dict] = None,
                 budgets: Optional[Callable[[], List[int]]] = None):
        self.job, self.rl, self.tokenizer = job, rl.validate(), tokenizer
        self.ps = ps = ps or ParallelState.single()
        check_layout(ps, job)
        self.rs = RankStep(job, ps, device, grad_accum=1)
        self.model = self.rs.model
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[rl.engine_dtype]
        # the engine samples from the same (fake-)quantised model, in the same layout
        self.engine = Engine(engine_model(job, ps, device, dtype), tokenizer, **(engine_options or {}))
        if init_from:
            src = Engine.from_pretrained(init_from, device=device).model  # whole tensors (any saved layout)
            copy_weights(src, self.model, self.rs.plan)  # each rank takes its tp / ep boxes
        self.ref_model = None
        if rl.loss.kl_coef > 0:
            self.ref_model = engine_model(job, ps, device, torch.float32)
            copy_weights(self.model, self.ref_model)
        self.task_specs = parse_tasks(rl.tasks, rl.task)
        self.reward_fn = (load_reward(rl.reward, tokenizer, next(prompt_stream(tokenizer, self.task_specs, rl.seed)))
                          if rl.reward else None)
        # MOPD: checked against the student (tokenizer, vocabulary, special ids) before any rollout
        found = load_teachers(rl.mopd_teachers, tokenizer, job.model.vocab_size, device) if rl.mopd_teachers else []
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
        self.sampler = PartialRollouts(self.engine, SamplingParams(max_tokens=rl.max_tokens,
                                                                   temperature=rl.temperature,
                                                                   ignore_eos=rl.ignore_eos), seed=rl.seed)
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
        """Copy the trainer's weights into the engine's model (in memory); returns the seconds it took."""
        t0 = time.perf_counter()
        copy_weights(self.model, self.engine.model)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------ one iteration
    def generate(self) -> dict:
        rl = self.rl
        for _ in range(rl.prompts - self.buffer.num_groups()):  # the carried-over groups count towards N
            p = next(self.prompts)
            self.prompts_used += 1
            self.buffer.add_prompt(p.ids, self.budgets() if self.budgets else rl.max_tokens, p.answer, p.task, p.effort)
        if self.state is not None:
            self.state.save_buffer()
        target = math.ceil(rl.partial_fraction * rl.prompts * rl.group_size)
        need = target - self.buffer.num_finished()
        t0 = time.perf_counter()
        if need > 0:
            self.sampler.run(self.buffer.unfinished(), self.version, stop_after=need)
        while not self.buffer.has_trainable() and self.buffer.unfinished():  # something to train on
            self.sampler.run(self.buffer.unfinished(), self.version, stop_after=1)
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

    def iteration(self) -> dict:
        rec = {"iteration": self.version, **self.generate()}
        groups = self.buffer.take_trainable()
        rec["groups"] = len(groups)
        if not groups:
            self.history.append(rec)
            return rec
        R = self.score(groups)
        rec["reward"] = float(R.mean())
        if len(self.task_specs) > 1:  # the mixture: the mean reward of each tag's samples
            rec.update(rewards_by_tag(groups, R))
        train_R = R
        if self.rl.shuffle_rewards:
            flat = R.flatten()[torch.randperm(R.numel(), generator=torch.Generator().manual_seed(
                self.rl.seed * 7919 + self.version))]
            train_R = flat.view_as(R)
        adv = group_advantages(train_R, self.rl.loss.advantage_scale)
        samples = [r for g in groups for r in g]
        sampled = [v for r in samples for v in r.versions if v >= 0]  # -1: context tokens
        rec["staleness"] = sum(self.version - v for v in sampled) / max(len(sampled), 1)
        t0 = time.perf_counter()
        rec.update(self.update(samples, adv.flatten().float()))
        rec["train_s"] = time.perf_counter() - t0
        rec["trained"] = len(samples)
        self.version += 1
        rec["refit_s"] = self.refit()
        rec["uids"] = [r.uid for r in samples]
        self.history.append(rec)
        if self.state is not None:
            self.state.after_update()
        return rec

    # ---------------------------------------------------------------------------------- update
    def _logp(self, model, mb) -> tuple:
        out = model(mb["input_ids"], cu_seqlens=mb["cu_seqlens"], return_logits=True)
        V = self.job.model.vocab_size
        if out.logits.shape[-1] == V:
            return token_logprobs(out.logits, mb["targets"]), out.moe_stats
        # tensor parallel: this rank's vocabulary columns; log p = -(vocab-parallel cross entropy)
        from parallel.tensor_parallel.vocab import vocab_parallel_cross_entropy

        Vl = out.logits.shape[-1]
        nll = vocab_parallel_cross_entropy(out.logits.reshape(-1, Vl).float(), mb["targets"].reshape(-1),
                                           self.ps.tp_group, reduction="none")
        return -nll.view(mb["targets"].shape), out.moe_stats

    def teacher_of(self, r: Rollout) -> int:
        """Index of the teacher of sample ``r``: its tag's (rl.mopd_teachers), else its task's, else 0."""
        t = tag(r.task, r.effort)
        return self.teacher_routes.get(t, self.teacher_routes.get(r.task, 0))

    def _local_tokens(self, real_BT: torch.Tensor) -> torch.Tensor:
        """Which of this rank's routed tokens (the MoE's flattened rows) are real tokens, not padding: the
        Quantile-Balancing statistics count the tokens of the samples only, whatever the padding."""
        if self.rs.plan.sequence_parallel:  # this rank routes its chunk of every row
            T = real_BT.shape[1] // self.ps.tp_size
            real_BT = real_BT[:, self.ps.tp_rank * T:(self.ps.tp_rank + 1) * T]
        return real_BT.reshape(-1)

    def update(self, samples: List[Rollout], adv_N: torch.Tensor) -> dict:
        """One optimizer step on ``samples`` (every rank passes the same list; each trains its slice)."""
        rl, ps, rs, model = self.rl, self.ps, self.rs, self.model
        M = rl.micro_batch_size
        cuts = [len(samples) * r // ps.dp_size for r in range(ps.dp_size + 1)]
        lo, hi = cuts[ps.dp_rank], cuts[ps.dp_rank + 1]
        mine, adv_mine = samples[lo:hi], adv_N[lo:hi]
        dev = rs.device
        shard = ps.tp_size if rs.plan.sequence_parallel else 1
        # micro-batch i: rows mine[i*M:(i+1)*M]; under expert parallelism every rank runs the same number
        # of micro-batches of the same [B, T] (MoonEP's dispatch needs equal routed rows on every EP rank):
        # the shape of micro-batch i is the largest over the data-parallel ranks, padded with masked rows
        shapes = [(0, 0)] * (-(-len(mine) // M))
        if ps.ep_size > 1:
            chunks = [[samples[a:b][i:i + M] for i in range(0, b - a, M)] for a, b in zip(cuts, cuts[1:])]
            shapes = [(M, max(len(s.prompt_ids) + len(s.token_ids) - 1 for c in chunks if i < len(c) for s in c[i]))
                      for i in range(max(len(c) for c in chunks))]
        mbs = []
        for i, (rows, length) in enumerate(shapes):
            part = mine[i * M:(i + 1) * M]
            mb = response_batch(part, self.tokenizer.pad_id, shard, rows, length)
            mb = {k: (v if k == "cu_seqlens" else v.to(dev)) for k, v in mb.items()}
            adv = torch.zeros(mb["mask"].shape[0])
            adv[:len(part)] = adv_mine[i * M:(i + 1) * M]
            mb["adv"] = adv.to(dev)
            mbs.append(mb)
        agg = rl.loss.aggregation
        count = torch.tensor([float(sum(float(mb["mask"].sum()) for mb in mbs) if agg == "token" else len(mine))],
                             dtype=torch.float64, device=dev)
        denom = float(all_reduce_sum(count, [ps.dp_group]).clamp_min(1.0))
        model.train()
        report = {"is_mean": 0.0, "is_capped": 0.0}
        mopd = new_tally(len(self.teachers))
        with torch.no_grad(), rs.autocast():
            for i, mb in enumerate(mbs):
                mb["logp_old"] = self._logp(model, mb)[0]
                if self.ref_model is not None:
                    mb["logp_ref"] = self._logp(self.ref_model, mb)[0]
                if self.teachers:  # MOPD: per-token rewards are the advantages, each row's from its own teacher
                    mb["adv"] = distil_advantages(self, mb, mine[i * M:(i + 1) * M], lambda part, T: response_batch(
                        part, self.tokenizer.pad_id, shard, 0, T), mopd)
        ntok = sum(float(mb["mask"].sum()) for mb in mbs)
        sums = torch.zeros(4, dtype=torch.float64, device=dev)  # loss, clipped tokens, kl, tokens
        biases = [m.gate.e_score_correction_bias for m in model.moe_layers()]
        for mb in mbs:
            w, rep = staleness_weights(mb["logp_old"], mb["behaviour"], mb["mask"], rl.loss.is_cap)
            n = float(mb["mask"].sum())
            report["is_mean"] += rep["is_mean"] * n / max(ntok, 1)
            report["is_capped"] += rep["is_capped"] * n / max(ntok, 1)
            with rs.autocast():
                logp, moe_stats = self._logp(model, mb)
            loss, st = policy_loss(logp, mb["logp_old"], mb["adv"], mb["mask"], rl.loss, denom, w,
                                   mb.get("logp_ref"))
            loss.backward()
            sums += torch.stack([loss.detach().double(), st["clip_frac_sum"], st["kl_sum"], st["tokens"]])
            keep = self._local_tokens(mb["real"])
            for acc, s, bias in zip(rs.balancers, moe_stats, biases):
                acc.add(s.scores_TE[keep], bias)
        sync_partial_grads(model, rs.plan, ps.tp_group)
        sums = all_reduce_sum(sums, [ps.dp_group])
        out = rs.apply(self.version, rl.iterations)
        tok = max(float(sums[3]), 1.0)
        if self.teachers:  # teacher row-forwards of this rank, KL to each teacher over the data-parallel group
            nt = len(self.teachers)
            st = all_reduce_sum(torch.cat([mopd["kl"], mopd["tokens"]]).to(dev), [ps.dp_group]).cpu()
            report["teacher_rows"] = mopd["rows"]
            report.update(kl_report(self.teacher_tags, st[:nt], st[nt:]))
        return {"loss": float(sums[0]), "grad_norm": float(out["grad_norm"]), "clip_frac": float(sums[1]) / tok,
                "kl": float(sums[2]) / tok, "response_tokens": int(sums[3]), **report}

    def fit(self, log=print) -> List[dict]:
        """Run iterations until ``rl.iterations`` updates are done (counting a restored run's)."""
        while self.version < self.rl.iterations:
            rec = self.iteration()
            if log:
                log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()
                         if k != "uids"))
        return self.history
