"""The rollout buffer: every token with the policy version that sampled it and its behaviour logprob.

A :class:`Rollout` is one of the K samples of a prompt (its ``group``). Generation appends tokens in
pieces (``extend``), each piece under the weights of one policy version, so a sample that was paused
and resumed after an update carries tokens of two (or more) versions, and says so token by token.
Its response budget is fixed when it is created (``budget``) and a resumed sample only gets what is
left of it (``remaining``), never a fresh budget.

Partial rollouts: an iteration generates until ``lambda * N * K`` samples are finished; unfinished
samples stay in the buffer and are resumed first next iteration (``unfinished()``, oldest first).
A group is trainable once all K of its samples are finished (group-relative advantages need every
reward); ``take_trainable()`` removes and returns those groups. ``state_dict()`` is plain JSON-able
data (checkpointed with the policy): resuming from it keeps every finished, untrained sample.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Union


@dataclass
class Rollout:
    uid: int
    group: int
    prompt_ids: List[int]
    budget: int
    """response tokens this sample may ever have (fixed at creation; resuming does not renew it)"""
    answer: Optional[str] = None
    """the verifiable answer of the prompt (rewards.exact_answer), when there is one"""
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    """behaviour logprob of each token under the policy that sampled it"""
    versions: List[int] = field(default_factory=list)
    """policy version that sampled each token (-1: context appended by :meth:`add_context`)"""
    mask: List[int] = field(default_factory=list)
    """1 where a token is the model's own (trained on), 0 for context (:meth:`add_context`); empty: all 1"""
    finished: bool = False
    finish_reason: str = ""
    text: str = ""
    reward: Optional[float] = None
    task: str = ""
    """the task (domain) of its prompt (megak3/posttrain/tasks.py)"""
    effort: str = ""
    """the effort label of its prompt ('' : none)"""

    @property
    def remaining(self) -> int:
        return self.budget - len(self.token_ids)

    def extend(self, tokens: List[int], logprobs: List[float], version: int) -> None:
        if len(tokens) != len(logprobs):
            raise ValueError(f"{len(tokens)} tokens but {len(logprobs)} logprobs")
        if len(tokens) > self.remaining:
            raise ValueError(f"rollout {self.uid}: {len(tokens)} new tokens exceed the remaining budget "
                             f"{self.remaining} of {self.budget}")
        self.token_ids += list(tokens)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(version)] * len(tokens)
        if self.mask:
            self.mask += [1] * len(tokens)

    def add_context(self, tokens: List[int]) -> None:
        """Append tokens the model did not sample (a multi-turn trajectory's tool messages and role
        headers): mask 0, logprob 0.0, version -1; they use the budget like the model's tokens."""
        if len(tokens) > self.remaining:
            raise ValueError(f"rollout {self.uid}: {len(tokens)} context tokens exceed the remaining budget "
                             f"{self.remaining} of {self.budget}")
        if not self.mask:
            self.mask = [1] * len(self.token_ids)
        self.token_ids += list(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)
        self.mask += [0] * len(tokens)

    def finish(self, reason: str, text: str = "") -> None:
        self.finished, self.finish_reason, self.text = True, reason, text


def batch_state(batch) -> Optional[dict]:
    """A generated batch ``(record, groups of Rollouts)`` as plain JSON-able data (None stays None):
    what a resumable run keeps of the batch generated ahead (``rl.rollout.lag=1``) and what the separate
    placement sends to the trainer ranks."""
    if batch is None:
        return None
    rec, groups = batch
    return {"record": dict(rec), "groups": [[asdict(r) for r in g] for g in groups]}


def load_batch(state: Optional[dict]) -> Optional[tuple]:
    """The ``(record, groups)`` of :func:`batch_state` (plain data in, Rollouts out)."""
    if state is None:
        return None
    return dict(state["record"]), [[Rollout(**d) for d in g] for g in state["groups"]]


class RolloutBuffer:
    def __init__(self, group_size: int):
        if group_size < 1:
            raise ValueError(f"rl.group_size={group_size} must be >= 1")
        self.K = group_size
        self.rollouts: Dict[int, Rollout] = {}
        self._next_uid = 0
        self._next_group = 0

    def add_prompt(self, prompt_ids: List[int], budget: Union[int, Sequence[int]],
                   answer: Optional[str] = None, task: str = "", effort: str = "") -> List[Rollout]:
        """K new samples of one prompt (one group) with response budget ``budget`` (or one per sample),
        tagged with the prompt's ``task`` and ``effort``."""
        g = self._next_group
        self._next_group += 1
        budgets = [int(budget)] * self.K if isinstance(budget, int) else [int(b) for b in budget]
        if len(budgets) != self.K:
            raise ValueError(f"{len(budgets)} budgets for a group of {self.K}")
        out = []
        for b in budgets:
            r = Rollout(self._next_uid, g, list(prompt_ids), b, answer, task=task, effort=effort)
            self.rollouts[r.uid] = r
            self._next_uid += 1
            out.append(r)
        return out

    def unfinished(self) -> List[Rollout]:
        """Samples still generating, oldest first (they are resumed before new prompts start)."""
        return [r for r in self.rollouts.values() if not r.finished]

    def num_groups(self) -> int:
        """Groups in the buffer (each has at least one sample not yet trained on)."""
        return len({r.group for r in self.rollouts.values()})

    def num_finished(self) -> int:
        return sum(r.finished for r in self.rollouts.values())

    def num_trainable(self) -> int:
        """Groups whose K samples are all finished."""
        done: Dict[int, int] = {}
        for r in self.rollouts.values():
            done[r.group] = done.get(r.group, 0) + r.finished
        return sum(n == self.K for n in done.values())

    def stale_unfinished(self, version: int, bound: int) -> bool:
        """Whether some unfinished sample's group holds a token ``bound`` or more policy versions older than
        ``version`` (the group trains together, so its oldest token decides)."""
        oldest: Dict[int, int] = {}
        for r in self.rollouts.values():
            sampled = [v for v in r.versions if v >= 0]          # -1: context tokens the model did not sample
            if sampled:
                oldest[r.group] = min(oldest.get(r.group, version), min(sampled))
        return any(version - oldest.get(r.group, version) >= bound for r in self.unfinished())

    def has_trainable(self) -> bool:
        """True when some group has all K samples finished."""
        done: Dict[int, int] = {}
        for r in self.rollouts.values():
            done[r.group] = done.get(r.group, 0) + r.finished
        return any(n == self.K for n in done.values())

    def take_trainable(self) -> List[List[Rollout]]:
        """Remove and return every group whose K samples are all finished, in group order."""
        groups: Dict[int, List[Rollout]] = {}
        for r in self.rollouts.values():
            groups.setdefault(r.group, []).append(r)
        done = [g for g in sorted(groups) if len(groups[g]) == self.K and all(r.finished for r in groups[g])]
        for g in done:
            for r in groups[g]:
                del self.rollouts[r.uid]
        return [groups[g] for g in done]

    def state_dict(self) -> dict:
        return {"group_size": self.K, "next_uid": self._next_uid, "next_group": self._next_group,
                "rollouts": [asdict(r) for r in self.rollouts.values()]}

    def load_state_dict(self, state: dict) -> None:
        if state["group_size"] != self.K:
            raise ValueError(f"rollout buffer was saved with rl.group_size={state['group_size']}, this run has "
                             f"{self.K}; resume with the same rl.group_size")
        self._next_uid, self._next_group = int(state["next_uid"]), int(state["next_group"])
        self.rollouts = {int(d["uid"]): Rollout(**d) for d in state["rollouts"]}
