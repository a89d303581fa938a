"""Partial rollouts on the in-process engine: generate until enough samples finish, pause the rest with their caches.

:class:`PartialRollouts` drives :class:`megak3.inference.Engine`'s own steps (``_begin``,
``_prefill_chunk``, ``_decode``, ``_emit``: the same prefill chunks, ragged decode batches and
sampling as ``Engine.generate``) with a scheduler that can stop in the middle. ``Engine.generate``
runs every request to the end and frees the caches of any it leaves; here a sequence that has not
finished when :meth:`run` returns keeps its engine state (MLA pages in the paged pool, the KDA
state and convolution tails, its sampling generator, its fixed ``max_new``), and the next
:meth:`run` continues it first, before any new sample is admitted. A resumed sample therefore
keeps its original response budget, and under unchanged weights continues exactly as if it had
never paused (tests/test_rl_engine.py). After a weight refit, a sequence paused in the middle of
its prompt re-embeds the prompt with the new embedding table; the cached past stays as computed.

Every generated token is appended to its :class:`~megak3.posttrain.buffer.Rollout` with the policy
version passed to :meth:`run` and the engine's logprob of it (the behaviour logprob).

What the engine should expose so this module needs none of its private methods: ``begin(seq)``,
``step(seqs) -> [(seq, token, logprob)]`` and ``release(seq)`` on long-lived sequence handles.
"""
from __future__ import annotations

from collections import deque
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
        """rollout uid -> (engine sequence, rollout) of every unfinished sample the engine holds"""

    def _new_seq(self, r: Rollout):
        sp = replace(self.params, max_tokens=r.remaining,
                     seed=None if self.params.temperature == 0 else (self.seed * 1_000_003 + r.uid) % 2 ** 63)
        return self.engine._requests([list(r.prompt_ids) + list(r.token_ids)], [sp], None)[0]

    def run(self, rollouts: List[Rollout], version: int, stop_after: Optional[int] = None,
            max_steps: Optional[int] = None) -> int:
        """Advance the unfinished ``rollouts`` (paused ones first) until ``stop_after`` of them finish
        in this call (None: all), or after ``max_steps`` scheduler iterations. Returns how many finished."""
        eng = self.engine
        for r in rollouts:
            if not r.finished and r.uid not in self.live:
                self.live[r.uid] = (self._new_seq(r), r)
        order = [self.live[r.uid][0] for r in rollouts if r.uid in self.live]
        owner = {id(s): self.live[r.uid][1] for r in rollouts if r.uid in self.live for s in [self.live[r.uid][0]]}
        begun = [s for s in order if s.state is not None]
        waiting = deque(s for s in order if s.state is None)
        prefilling = [s for s in begun if s.fed < len(s.prompt)]
        decoding = [s for s in begun if s.fed >= len(s.prompt)]
        for s in prefilling:  # the embedding table may have been refit since the pause
            s.x0 = eng.runner.embed(s.prompt, s.images)
        finished, steps = 0, 0

        def record(s, tok, lp):
            nonlocal finished
            r = owner[id(s)]
            r.extend([tok], [lp], version)
            if s.finish is not None:
                r.finish(s.finish, eng._completion(s).text)
                del self.live[r.uid]
                if self.on_finish is not None:
                    self.on_finish(r)
                finished += 1

        while (waiting or prefilling or decoding) and (stop_after is None or finished < stop_after) \
                and (max_steps is None or steps < max_steps):
            steps += 1
            for item in eng._step(waiting, prefilling, decoding):
                record(*item)
        return finished

    def release_all(self) -> None:
        """Free the engine state of every paused sample (their rollouts restart from their tokens)."""
        for s, _ in self.live.values():
            if s.rid in self.engine.cache.seqs:
                self.engine.cache.finish(s.rid)
        self.live.clear()
