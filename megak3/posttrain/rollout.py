"""Partial rollouts on the in-process engine: generate until enough samples finish, pause the rest with their caches.

:class:`PartialRollouts` drives :class:`megak3.inference.Engine` through its public sequence API
(``begin`` / ``step`` / ``pause`` / ``resume`` / ``release``, docs/INTERFACES.md): the same prefill
chunks, ragged decode batches, preemption and sampling as ``Engine.generate``, with a loop that can
stop in the middle. A sample that has not finished when :meth:`run` returns is paused with its
engine state (MLA pages in the paged pool, the KDA state and convolution tails, its sampling
generator, its fixed response budget), and the next :meth:`run` resumes it first (its handle is
older than any new sample's). A resumed sample therefore keeps its original response budget, and
under unchanged weights continues exactly as if it had never paused (tests/test_rl_engine.py).
After a weight refit, a sequence paused in the middle of its prompt re-embeds the rest of the prompt
with the new embedding table; the cached past stays as computed, unless the engine preempted the
paused sequence for pages meanwhile: then its past is recomputed under the new weights.

Every generated token is appended to its :class:`~megak3.posttrain.buffer.Rollout` with the policy
version passed to :meth:`run` and the engine's logprob of it (the behaviour logprob: that of the
distribution sampled, temperature applied). Samples are tracked by the rollout object itself, so
rollouts of several buffers (whose uids may coincide) can share one sampler and one engine.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from megak3.inference import SamplingParams

from .buffer import Rollout


class PartialRollouts:
    def __init__(self, engine, params: SamplingParams, seed: int = 0):
        self.engine = engine
        self.params = params
        self.seed = seed
        self.on_finish = None
        """called with each rollout the moment it finishes (the resumable run's journal)"""
        self.live: Dict[int, Tuple[object, Rollout]] = {}
        """id(rollout) -> (engine sequence handle, rollout) of every unfinished sample the engine holds"""

    def _begin(self, r: Rollout):
        sp = replace(self.params, max_tokens=r.remaining,
                     seed=None if self.params.temperature == 0 else (self.seed * 1_000_003 + r.uid) % 2 ** 63)
        return self.engine.begin(list(r.prompt_ids) + list(r.token_ids), sp)

    def run(self, rollouts: List[Rollout], version: int, stop_after: Optional[int] = None,
            max_steps: Optional[int] = None) -> int:
        """Advance the unfinished ``rollouts`` (paused ones first) until ``stop_after`` of them finish
        in this call (None: all), or after ``max_steps`` scheduler iterations. Returns how many finished."""
        eng = self.engine
        for r in rollouts:
            if not r.finished and id(r) not in self.live:
                self.live[id(r)] = (self._begin(r), r)
        owner = {}
        for r in rollouts:
            if id(r) in self.live:
                h, _ = self.live[id(r)]
                owner[h.id] = r
                if h.paused:
                    eng.resume(h)
        handles = [self.live[id(r)][0] for r in owner.values()]
        finished, steps = 0, 0
        try:
            while any(not h.finished for h in handles) and (stop_after is None or finished < stop_after) \
                    and (max_steps is None or steps < max_steps):
                steps += 1
                for h, tok, lp in eng.step(handles):
                    r = owner[h.id]
                    r.extend([tok], [lp], version)
                    if h.finished:
                        r.finish(h.finish_reason, eng.completion(h).text)
                        del self.live[id(r)]
                        if self.on_finish is not None:
                            self.on_finish(r)
                        finished += 1
        finally:
            for h in handles:
                if not h.finished:
                    eng.pause(h)   # keeps its pages until the next run (or a preemption)
        return finished

    def release_all(self) -> None:
        """Free the engine state of every paused sample (their rollouts restart from their tokens)."""
        for h, _ in self.live.values():
            self.engine.release(h)
        self.live.clear()
