"""Multi-turn agentic RL: every sample is an episode of a megak3.envs task family, played by the engine.

:class:`AgentRunner` is :class:`~megak3.posttrain.rl.RLRunner` with ``rl.env`` set; only generation
differs (the update, RankStep, refit and staleness correction are the RL loop's).

A trajectory is one :class:`~megak3.posttrain.buffer.Rollout`. Its prompt is the chat template of the
task's first observation as a ``user`` message plus the open assistant header. Each turn the engine
continues the whole conversation so far (the prefix cache holds it) for at most ``rl.max_tokens``
tokens; those tokens are appended with their behaviour logprobs and policy version (mask 1); the text
goes to the environment as the turn (``EpisodeDriver.run``, one batched pool step per turn), and
unless the episode is over the observation is appended as context (mask 0, version -1)::

    [<|eos|> if the turn stopped at its budget] <|bos|> tool\\n OBS[:rl.obs_tokens] <|eos|> <|bos|> assistant\\n

The prefix cache serves the conversation so far from the KDA checkpoints the engine takes every
``CHECKPOINT_INTERVAL`` tokens. The engine keeps that cache across a refit, so after an update a turn (of a
resumed episode, or of a new one whose prompt shares a cached prefix, e.g. the family's instructions) may
continue from a prefix computed under older weights, as a paused single-turn sample keeps its caches; the learner
recomputes every logprob under its current weights and the per-token truncated importance weights
against the recorded behaviour logprobs correct for the difference.

The reward is the environment's when the episode ends (submit or turn limit). A trajectory whose next
turn would not fit in ``rl.episode_tokens`` ends there (``EpisodeDriver.end``, reward 0.0).

Partial rollouts: generation plays turns of every unfinished episode until ``ceil(lambda N K)``
episodes of the buffer are finished and some group has all K; the others stay paused between turns,
their sandboxes kept by the ``EpisodeDriver``, and are played first next iteration under the new
weights. A paused episode's sandbox digest (``EnvPool.digest``) is taken at the pause and checked at
the resume; a change raises ``RuntimeError``. Each iteration's record adds ``episodes_resumed`` (paused
episodes whose digests were checked), ``turns`` (rounds of one turn per unfinished episode) and
``prefix_hit_tokens`` (prompt tokens the engine's prefix cache served instead of prefilling).

Resumable after kill -9 (:meth:`AgentRunner.resumable`, megak3/posttrain/checkpoint.py): the RL checkpoint
also holds the driver's state (transcripts and results of the episodes in the buffer), each live sandbox's
last snapshot id (``EnvPool.checkpoint``; the snapshots are kept in ``RUN_DIR/env_store``), the paused
episodes' digests and the task and turn counters. A resumed run brings every sandbox back from its snapshot
(``EnvPool.fork`` into a pool on that store) and checks its digest against the one taken at the pause before
playing on. Episodes are checkpointed with the update, not journaled: whatever happened after the last
checkpoint (turns, finished episodes, an update) is played again from that checkpoint's state, with the same
episode uids and sampling seeds, so no episode is lost or trained twice.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Dict, List, Optional

from ..data.chat import generation_prompt
from ..envs.driver import EpisodeDriver, Transcript
from ..envs.env import StepResult
from ..envs.pool import EnvPool
from ..envs.tasks import make_task
from .buffer import Rollout
from .rl import RLRunner

CHECKPOINT_INTERVAL = 64
"""the engine's KDA checkpoint interval for agentic runs unless ``engine_options`` sets one"""


def tool_message(tokenizer, observation: str, cap: int) -> List[int]:
    """Context ids after a model turn: the observation as a ``tool`` message (its first ``cap``
    tokens) and the next open assistant header."""
    return ([tokenizer.bos_id] + tokenizer.encode("tool\n") + tokenizer.encode(observation)[:cap]
            + [tokenizer.eos_id] + generation_prompt(tokenizer, []))


class AgentRunner(RLRunner):
    """RL on ``rl.env`` episodes (module docstring). ``pool``: an :class:`EnvPool` to use (default: a new
    one with ``rl.env_workers`` workers, shut down by :meth:`close`)."""

    def __init__(self, job, rl, tokenizer, pool: Optional[EnvPool] = None, **kw):
        if not rl.env:
            raise ValueError("rl.env='' : AgentRunner needs a task family; set rl.env=ledger or rl.env=fixbug")
        # KDA checkpoints every 64 tokens (the engine's default: 512) so that a turn restores most of its
        # conversation from the prefix cache instead of prefilling it again
        kw["engine_options"] = {"checkpoint_interval": CHECKPOINT_INTERVAL, **(kw.get("engine_options") or {})}
        super().__init__(job, rl, tokenizer, **kw)
        self.own_pool = pool is None
        self.pool = pool or EnvPool(rl.env_workers)
        self.driver = EpisodeDriver(self.pool)
        self.episodes: Dict[str, Rollout] = {}
        """episode id -> its trajectory (a rollout of the buffer)"""
        self.paused: Dict[str, str] = {}
        """episode id -> sandbox digest when it was paused at the end of the last generation"""
        self.tasks_used = 0
        self._turn_uid = 0

    def resumable(self, run_dir, save_interval: int = 1, resume: str = "auto", keep_last: int = 2) -> bool:
        """:meth:`RLRunner.resumable` with the episodes (module docstring). Call it before the first iteration;
        a pool passed to the constructor must keep its snapshots in a store that outlives the run."""
        if self.driver.transcripts:
            raise ValueError("AgentRunner.resumable: call it before the first iteration")
        if self.own_pool:  # sandbox snapshots in the run directory, beside the checkpoints that name them
            self.pool.shutdown()
            self.pool = EnvPool(self.rl.env_workers, store_dir=str(Path(run_dir).resolve() / "env_store"))
            self.driver = EpisodeDriver(self.pool)
        restored = super().resumable(run_dir, save_interval, resume, keep_last)
        self.sampler.on_finish = None  # turns are not samples of the buffer; episodes live in the checkpoint
        return restored

    def extra_state(self) -> dict:
        live = {eid: r.uid for eid, r in self.episodes.items() if r.uid in self.buffer.rollouts}
        drv = self.driver.state_dict()
        return {"episodes": live, "paused": dict(self.paused), "tasks_used": self.tasks_used,
                "turn_uid": self._turn_uid, "sandboxes": drv["pool"],
                "transcripts": {e: t for e, t in drv["transcripts"].items() if e in live},
                "results": {e: t for e, t in drv["results"].items() if e in live}}

    def load_extra_state(self, state: dict) -> None:
        if not state:
            return
        sandboxes = state["sandboxes"]
        if sandboxes["store"] != self.pool.store_dir:  # compared, never followed
            raise ValueError(f"the checkpoint's sandboxes are in the snapshot store {sandboxes['store']}, this run's "
                             f"pool uses {self.pool.store_dir}; resume with a pool on the same store_dir")
        for eid, snap in sandboxes["episodes"].items():
            self.pool.fork(eid, eid, snap)
        drv = EpisodeDriver(self.pool)
        drv.transcripts = {e: [tuple(t) for t in ts] for e, ts in state["transcripts"].items()}
        drv.results = {e: StepResult(*r) for e, r in state["results"].items()}
        self.driver = drv
        self.episodes = {eid: self.buffer.rollouts[int(uid)] for eid, uid in state["episodes"].items()}
        self.paused = dict(state["paused"])
        self.tasks_used, self._turn_uid = int(state["tasks_used"]), int(state["turn_uid"])

    def close(self) -> None:
        if self.own_pool:
            self.pool.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------ episodes
    def _new_group(self) -> None:
        rl = self.rl
        spec = {"family": rl.env, "seed": rl.seed * 1_000_000 + self.tasks_used}
        if rl.max_turns:
            spec["max_turns"] = rl.max_turns
        self.tasks_used += 1
        group = self.buffer.add_prompt([], self.budgets() if self.budgets else rl.episode_tokens,
                                       make_task(spec).answer, task=rl.env)
        for r in group:
            eid = f"ep{r.uid}"
            obs = self.driver.start(eid, spec)
            r.prompt_ids = generation_prompt(self.tokenizer, [{"role": "user", "content": obs}])
            self.episodes[eid] = r

    def _policy(self, transcripts: Dict[str, Transcript]) -> Dict[str, str]:
        """One model turn of every episode in ``transcripts``, generated together by the engine."""
        turns = {}
        for eid in transcripts:
            r = self.episodes[eid]
            self._turn_uid += 1
            turns[eid] = Rollout(self._turn_uid, r.group, r.prompt_ids + r.token_ids,
                                 min(self.rl.max_tokens, r.remaining))
        self.sampler.run(list(turns.values()), self.version)
        out = {}
        for eid, t in turns.items():
            self.episodes[eid].extend(t.token_ids, t.logprobs, self.version)
            out[eid] = t.text
        return out

    def _after_turn(self, eid: str) -> None:
        """Append the observation of the turn just played, or end the episode."""
        r, tok = self.episodes[eid], self.tokenizer
        res = self.driver.results.get(eid)
        if res is None:
            ctx = ([] if r.token_ids[-1] == tok.eos_id else [tok.eos_id]) + tool_message(
                tok, self.driver.transcripts[eid][-1][1], self.rl.obs_tokens)
            if len(ctx) < r.remaining:                  # room for the context and one more model token
                r.add_context(ctx)
                return
            res = self.driver.end(eid, f"[trajectory budget {r.budget} tokens reached; episode over]")
        r.reward = float(res.reward)
        r.finish("env" if "ended" not in res.info else "length", self.driver.transcripts[eid][-2][1]
                 if len(self.driver.transcripts[eid]) >= 2 else "")
        self.pool.close(eid)

    # ------------------------------------------------------------------------------ one iteration
    def generate(self) -> dict:
        rl = self.rl
        for eid, digest in sorted(self.paused.items()):  # the environments must be as they were paused
            now = self.pool.digest(eid)
            if now != digest:
                raise RuntimeError(f"episode {eid}: its sandbox changed while paused (digest {digest[:12]} -> "
                                   f"{now[:12]}); the trajectory cannot continue")
        resumed, self.paused = len(self.paused), {}
        for _ in range(rl.prompts - self.buffer.num_groups()):
            self._new_group()
        target = math.ceil(rl.partial_fraction * rl.prompts * rl.group_size)
        t0, turns, hits0 = time.perf_counter(), 0, self.engine.cache.stats["hit_tokens"]
        while self.driver.unfinished() and (self.buffer.num_finished() < target or not self.buffer.has_trainable()):
            live = self.driver.unfinished()
            self.driver.run(self._policy, max_turns=1)
            for eid in live:
                self._after_turn(eid)
            turns += 1
        self.paused = {eid: self.pool.digest(eid) for eid in self.driver.unfinished()}
        return {"gen_s": time.perf_counter() - t0, "paused": len(self.paused), "episodes_resumed": resumed,
                "turns": turns, "prefix_hit_tokens": self.engine.cache.stats["hit_tokens"] - hits0}

    def iteration(self) -> dict:
        rec = super().iteration()
        for uid in rec.get("uids", []):                 # trained on: drop their transcripts
            self.episodes.pop(f"ep{uid}", None)
            self.driver.forget(f"ep{uid}")
        return rec
