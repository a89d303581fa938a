"""Cache-affine routing of requests to engine replicas, guarded by load.

A replica can skip prefilling the part of a prompt its prefix cache holds. For K3's hybrid layers that is
not every cached token: a KDA layer's recurrent state can be restored only where the engine checkpointed it
(every ``checkpoint_interval`` tokens, megak3/inference/cache.py), so a prefix counts only up to its last
checkpointed boundary: ``hit = interval * (matching whole blocks)``. :class:`PrefixIndex` keeps, per replica,
the hash chain of every block-aligned prefix it has prefilled (block = the checkpoint interval; hash of block
k = hash(hash of block k-1, the block's tokens), as vLLM's prefix blocks), and :meth:`PrefixIndex.match`
returns the hit of a new prompt.

:class:`Router` sends a request (a GRPO group's shared prompt, or a multi-turn session's next turn, whose
prompt extends the session's previous context) to the replica with the longest hit, among the replicas whose
load after taking it stays within ``max_load_ratio`` x the mean load (the guard); if none qualifies, to the
least-loaded replica. A request's cost on replica r is its prefill there (prompt - hit) plus its decode
tokens; the load is the cost routed to a replica so far (:meth:`Router.done` subtracts a finished one's,
for in-flight load). ``policy='round_robin'`` and ``'least_loaded'`` are the baselines
(tools/bench_router.py prints all three on an agent trace).
"""
from __future__ import annotations

from typing import List, Sequence

POLICIES = ("affine", "round_robin", "least_loaded")


class PrefixIndex:
    """Block-aligned prefixes a replica holds (hash chain per block of ``block`` tokens)."""

    def __init__(self, block: int):
        if block < 1:
            raise ValueError(f"checkpoint_interval={block} must be >= 1")
        self.block = block
        self.blocks: set = set()

    def _chain(self, tokens: Sequence[int]):
        h = 0
        for k in range(len(tokens) // self.block):
            h = hash((h, tuple(tokens[k * self.block:(k + 1) * self.block])))
            yield h

    def match(self, tokens: Sequence[int]) -> int:
        """Prompt tokens this replica need not prefill: whole checkpointed blocks of the longest cached prefix."""
        n = 0
        for h in self._chain(tokens):
            if h not in self.blocks:
                break
            n += self.block
        return n

    def insert(self, tokens: Sequence[int]) -> None:
        self.blocks.update(self._chain(tokens))


class Router:
    """Routes requests over ``replicas`` engine replicas (module docstring)."""

    def __init__(self, replicas: int, checkpoint_interval: int, max_load_ratio: float = 1.25,
                 policy: str = "affine"):
        if replicas < 1:
            raise ValueError(f"replicas={replicas} must be >= 1")
        if max_load_ratio < 1:
            raise ValueError(f"max_load_ratio={max_load_ratio} must be >= 1")
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {', '.join(POLICIES)}")
        self.index = [PrefixIndex(checkpoint_interval) for _ in range(replicas)]
        self.load: List[float] = [0.0] * replicas
        self.ratio, self.policy = max_load_ratio, policy
        self._next = 0
        self.prefill_tokens = 0
        """prompt tokens prefilled over every routed request (prompt minus the chosen replica's hit)"""

    def route(self, prompt: Sequence[int], decode_tokens: int = 0, copies: int = 1) -> int:
        """The replica for a request of ``prompt`` (``copies`` samples of it, e.g. a GRPO group of K, each
        decoding ``decode_tokens``); records its cost and the prefix the replica now holds."""
        n = len(self.load)
        hits = [idx.match(prompt) for idx in self.index]
        cost = [len(prompt) - h + copies * decode_tokens for h in hits]
        if self.policy == "round_robin":
            r = self._next % n
            self._next += 1
        elif self.policy == "least_loaded":
            r = min(range(n), key=lambda i: (self.load[i], i))
        else:
            total = sum(self.load)
            ok = [i for i in range(n) if self.load[i] + cost[i] <= self.ratio * (total + cost[i]) / n]
            r = (max(ok, key=lambda i: (hits[i], -self.load[i], -i)) if ok
                 else min(range(n), key=lambda i: (self.load[i] + cost[i], i)))
        self.load[r] += cost[r]
        self.prefill_tokens += len(prompt) - hits[r]
        self.index[r].insert(prompt)
        return r

    def done(self, replica: int, cost: float) -> None:
        """A request of ``cost`` finished on ``replica`` (in-flight load accounting)."""
        self.load[replica] -= cost

    def balance(self) -> float:
        """max / mean load over the replicas (1.0: even)."""
        mean = sum(self.load) / len(self.load)
        return max(self.load) / mean if mean > 0 else 1.0
