"""Multi-turn episodes for a text policy, paused and resumed across rollout iterations.

``EpisodeDriver(pool)`` keeps each episode's transcript (``[(role, text)]``, role ``"env"`` or
``"model"``) beside its sandbox in an ``EnvPool``. ``run(policy, max_turns)`` plays at most
``max_turns`` turns of every unfinished episode, one batched ``policy({eid: transcript}) -> {eid:
text}`` call and one ``pool.step_batch`` per turn; what is unfinished after that is paused, its
sandbox left as it is, and goes on at the next ``run`` (a partial rollout). ``state_dict()`` is what
an RL checkpoint stores (the pool's checkpoint, transcripts, results; JSON);
``EpisodeDriver.from_state_dict`` brings the episodes back, sandboxes included, in a new pool.
An episode the pool fails to serve (``pool.StepBatchError``: lost with its worker, its restore
failed) ends with ``ENV_FAILED`` as its observation, reward 0.0 and ``info["error"] == "environment"``;
the others carry on.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

from megak3.envs.env import StepResult
from megak3.envs.pool import EnvPool, StepBatchError

Transcript = List[Tuple[str, str]]
ENV_FAILED = "[the environment failed; this episode is over]"


class EpisodeDriver:
    def __init__(self, pool: EnvPool):
        self.pool = pool
        self.transcripts: Dict[str, Transcript] = {}
        self.results: Dict[str, StepResult] = {}        # finished episodes' last step

    def start(self, eid: str, task) -> str:
        obs = self.pool.reset(eid, task)
        self.transcripts[eid] = [("env", obs)]
        return obs

    def unfinished(self) -> List[str]:
        return sorted(e for e in self.transcripts if e not in self.results)

    def run(self, policy: Callable[[Dict[str, Transcript]], Dict[str, str]], max_turns: int) -> Dict[str, StepResult]:
        """Play up to ``max_turns`` turns; return the episodes that finished in this call."""
        finished = {}
        for _ in range(max_turns):
            live = self.unfinished()
            if not live:
                break
            actions = policy({e: list(self.transcripts[e]) for e in live})
            missing = sorted(set(live) - set(actions))
            if missing:
                raise ValueError(f"policy returned no turn for episodes {missing}")
            try:
                results = self.pool.step_batch({e: actions[e] for e in live})
            except StepBatchError as e:
                results = {**e.results, **{eid: StepResult(ENV_FAILED, True, 0.0, {"error": "environment",
                                                                                 "detail": why})
                                           for eid, why in e.errors.items()}}
            for eid in live:
                r = results[eid]
                self.transcripts[eid] += [("model", actions[eid]), ("env", r.observation)]
                if r.done:
                    self.results[eid] = finished[eid] = r
        return finished

    def end(self, eid: str, observation: str) -> StepResult:
        """Finish an unfinished episode without a step (e.g. its trajectory ran out of budget): reward 0.0."""
        if eid not in self.transcripts or eid in self.results:
            raise ValueError(f"episode {eid!r} is not an unfinished episode of this driver")
        self.results[eid] = StepResult(observation, True, 0.0, {"ended": observation})
        return self.results[eid]

    def forget(self, eid: str) -> None:
        """Drop a finished episode's transcript and result, closing its sandbox (after it was trained on)."""
        self.pool.close(eid)
        self.transcripts.pop(eid, None)
        self.results.pop(eid, None)

    def state_dict(self) -> Dict:
        return {"pool": self.pool.checkpoint(),
                "transcripts": {e: [list(t) for t in ts] for e, ts in self.transcripts.items()},
                "results": {e: [r.observation, r.done, r.reward, r.info] for e, r in self.results.items()}}

    @classmethod
    def from_state_dict(cls, sd: Dict, num_workers: int = 2, **pool_kw) -> "EpisodeDriver":
        drv = cls(EnvPool.from_checkpoint(sd["pool"], num_workers=num_workers, **pool_kw))
        drv.transcripts = {e: [tuple(t) for t in ts] for e, ts in sd["transcripts"].items()}
        drv.results = {e: StepResult(*r) for e, r in sd["results"].items()}
        return drv
