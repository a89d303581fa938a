"""Cache-affine routing of requests over engine replicas, guarded by load (no tensors, no I/O).

A multi-turn agent session or a GRPO group that returns to the replica holding its prefix restores
that prefix from the cache instead of prefilling it again (K3's cache-aware affinity scheduling). The
router keeps, per replica, its own model of what that replica's cache holds: the prefixes it sent
there, named like the engine names them (a hash chained over token blocks, seeded by the request's
image salt, megak3/inference/cache.py) but at **KDA checkpoint granularity**: a hybrid KDA/MLA model
can restore a prefix only up to its deepest checkpointed boundary (``checkpoint_interval`` tokens
apart; the last prompt token is always computed), so a match counts whole intervals and nothing in
between. Each replica's model is an LRU of boundaries bounded by ``capacity_tokens`` (what the
replica's pool holds), evicted leaf-first like the engine's cache; it is a model, not a query of the
engine: a replica that evicted earlier than modelled costs a cold prefill, never a wrong result.

Policy (``Router.route``): among the replicas whose work after taking the request stays within
``balance`` x the mean plus ``slack_tokens``, both the work routed so far and the outstanding work
(the slack lets a young or idle system follow prefixes), take the one with the longest reusable prefix; when none of those has any, the one with the least
outstanding work. The bound on routed work moves a session off a replica that its sticky sessions would
otherwise overload (one cold prefill, then it sticks to its new replica). ``policy="round_robin"`` and
``"least_loaded"`` are the baselines ``tools/bench_router.py`` compares against. Work is counted in
tokens: the prefill a request still needs on that replica plus its decode budget; ``done`` takes it
back and records what the replica now caches (prompt and generated tokens).

    r = Router(4, checkpoint_interval=512, capacity_tokens=200_000)   # balance=1.1
    k = r.route(prompt_ids, max_new=256)        # replica index
    ...                                         # replica k generates
    r.done(r.last_ticket, prompt_ids + output_ids)   # frees its load, records its cache

A replica marked down (``set_up(k, False)``: its worker died) is skipped and its model emptied.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from .types import InferenceError

POLICIES = ("affinity", "round_robin", "least_loaded")


def boundary_hashes(ids: Sequence[int], interval: int, salt: bytes = b"") -> List[bytes]:
    """The engine's chained block hash (cache.chain_hashes: blake2b-128 over the previous hash and
    the block's ids as little-endian uint32) with blocks of ``interval`` tokens."""
    out, prev = [], hashlib.blake2b(salt, digest_size=16).digest()
    for i in range(len(ids) // interval):
        blk = ids[i * interval:(i + 1) * interval]
        prev = hashlib.blake2b(prev + struct.pack(f"<{interval}I", *blk), digest_size=16).digest()
        out.append(prev)
    return out


class PrefixModel:
    """One replica's cached prefixes at checkpoint granularity: boundary hash -> parent, in LRU order."""

    def __init__(self, interval: int, capacity_tokens: int):
        self.interval, self.capacity = interval, capacity_tokens
        self.lru: "OrderedDict[bytes, Optional[bytes]]" = OrderedDict()
        self.children: Dict[bytes, int] = {}

    def match(self, hashes: Sequence[bytes]) -> int:
        """Reusable tokens: whole intervals of the longest chain prefix present."""
        n = 0
        for h in hashes:
            if h not in self.lru:
                break
            n += 1
        return n * self.interval

    def insert(self, hashes: Sequence[bytes]) -> None:
        parent = None
        for h in hashes:
            if h in self.lru:
                self.lru.move_to_end(h)
            else:
                self.lru[h] = parent
                if parent is not None:
                    self.children[parent] = self.children.get(parent, 0) + 1
            parent = h
        # touch the chain from its end to its root so that the root is the most recently used
        for h in reversed(hashes):
            self.lru.move_to_end(h)
        self._evict()

    def _evict(self) -> None:
        while len(self.lru) * self.interval > self.capacity:
            victim = next((h for h in self.lru if not self.children.get(h)), None)   # oldest leaf
            if victim is None:
                victim = next(iter(self.lru))
            parent = self.lru.pop(victim)
            self.children.pop(victim, None)
            if parent is not None and parent in self.children:
                self.children[parent] -= 1

    @property
    def tokens(self) -> int:
        return len(self.lru) * self.interval


@dataclass
class RouterStats:
    routed: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0           # tokens the chosen replica's model says it restores
    fallbacks: int = 0               # requests sent elsewhere than their best prefix because of load
    per_replica_work: List[int] = field(default_factory=list)
    per_replica_reused: List[int] = field(default_factory=list)   # reused_tokens by replica


class Router:
    """Route requests over ``num_replicas`` engine replicas (the module docstring)."""

    def __init__(self, num_replicas: int, *, checkpoint_interval: int = 512, capacity_tokens: int = 1 << 20,
                 policy: str = "affinity", balance: float = 1.1, slack_tokens: int = 8192):
        for name, v, lo in (("num_replicas", num_replicas, 1), ("checkpoint_interval", checkpoint_interval, 1),
                            ("capacity_tokens", capacity_tokens, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise InferenceError(f"router.{name}={v!r} must be an integer >= {lo}")
        if policy not in POLICIES:
            raise InferenceError(f"router.policy={policy!r} must be one of {', '.join(POLICIES)}")
        if not isinstance(balance, (int, float)) or balance < 1:
            raise InferenceError(f"router.balance={balance!r} must be a number >= 1")
        self.n, self.interval, self.policy, self.balance = num_replicas, checkpoint_interval, policy, float(balance)
        self.slack = slack_tokens
        self.models = [PrefixModel(checkpoint_interval, capacity_tokens) for _ in range(num_replicas)]
        self.load = [0] * num_replicas                 # outstanding work (tokens) per replica
        self.pending: Dict[int, List[int]] = {}        # ticket -> [replica, work]
        self._rr = 0
        self._ticket = 0
        self.stats = RouterStats(per_replica_work=[0] * num_replicas, per_replica_reused=[0] * num_replicas)
        self.down: set = set()                         # replicas not to route to (set_up)

    def _hashes(self, ids: Sequence[int], salt: bytes) -> List[bytes]:
        # the last prompt token is always computed: a prompt of n tokens can restore at most n - 1
        return boundary_hashes(ids[:max(len(ids) - 1, 0)], self.interval, salt)

    def route(self, ids: Sequence[int], *, max_new: int = 0, salt: bytes = b"", replica: Optional[int] = None) -> int:
        """The replica for a request of prompt ``ids`` (image ``salt``) and ``max_new`` decode tokens
        (``replica``: that one if it is up, counted like a routed request: the later copies of a group
        whose first copy went there). Returns the replica index; ``self.last_ticket`` names this
        request for :meth:`done`."""
        up = [j for j in range(self.n) if j not in self.down]
        if not up:
            raise RuntimeError(f"no engine replica is up (all {self.n} are down)")
        hashes = self._hashes(ids, salt)
        reuse = [m.match(hashes) if k not in self.down else 0 for k, m in enumerate(self.models)]
        work = [len(ids) - reuse[k] + max_new for k in range(self.n)]
        if replica is not None and replica not in self.down:
            k = replica
        elif self.policy == "round_robin":
            while self._rr % self.n in self.down:
                self._rr += 1
            k = self._rr % self.n
            self._rr += 1
        elif self.policy == "least_loaded":
            k = min(up, key=lambda j: (self.load[j], j))
        else:
            cum = self.stats.per_replica_work
            total = sum(cum[j] for j in up)
            load = sum(self.load[j] for j in up)
            n = len(up)
            allowed = [j for j in up
                       if cum[j] + work[j] <= self.balance * (total + work[j]) / n + self.slack
                       and self.load[j] + work[j] <= self.balance * (load + work[j]) / n + self.slack]
            pool = allowed or up
            k = max(pool, key=lambda j: (reuse[j], -self.load[j] - work[j], -cum[j], -j))
            if reuse[k] == 0:               # no prefix anywhere it may go: the least outstanding work
                k = min(pool, key=lambda j: (self.load[j] + work[j], cum[j], j))
            if max(reuse) > reuse[k]:
                self.stats.fallbacks += 1
        self.load[k] += work[k]
        self.models[k].insert(hashes)              # the replica will cache this prompt
        self._ticket += 1
        self.pending[self._ticket] = [k, work[k]]
        self.last_ticket = self._ticket
        st = self.stats
        st.routed += 1
        st.prompt_tokens += len(ids)
        st.reused_tokens += reuse[k]
        st.per_replica_reused[k] += reuse[k]
        st.per_replica_work[k] += work[k]
        return k

    def done(self, ticket: int, ids: Sequence[int] = (), salt: bytes = b"") -> None:
        """Request ``ticket`` finished: its work leaves its replica's load, and the replica's model
        records ``ids`` (prompt + generated tokens: the engine checkpoints during decode too)."""
        k, work = self.pending.pop(ticket)
        self.load[k] -= work
        if ids:
            self.cached(k, ids, salt)

    def cached(self, replica: int, ids: Sequence[int], salt: bytes = b"") -> None:
        """Record that ``replica`` now caches ``ids`` (e.g. the other outputs of an n > 1 request)."""
        if replica not in self.down:
            self.models[replica].insert(self._hashes(ids, salt))

    def state_dict(self) -> dict:
        """What the router knows, as plain data (a resumable RL run): each replica's cache model, its
        outstanding work and the stats. Not kept: the tickets in flight and the round-robin cursor."""
        return {"load": list(self.load), "stats": asdict(self.stats),
                "models": [[[h.hex(), None if p is None else p.hex()] for h, p in m.lru.items()] for m in self.models],
                "children": [[[h.hex(), int(n)] for h, n in m.children.items()] for m in self.models]}

    def load_state_dict(self, state: dict) -> bool:
        """Restore :meth:`state_dict`; False (and nothing changed) when it was saved for another replica count."""
        if len(state["models"]) != self.n:
            return False
        self.load = [int(x) for x in state["load"]]
        self.stats = RouterStats(**state["stats"])
        for m, lru, children in zip(self.models, state["models"], state["children"]):
            m.lru.clear()
            m.lru.update((bytes.fromhex(h), None if p is None else bytes.fromhex(p)) for h, p in lru)
            m.children = {bytes.fromhex(h): int(n) for h, n in children}
        return True

    def set_up(self, replica: int, up: bool) -> None:
        """Mark ``replica`` up or down: a down replica is never routed to, and its cache model is
        emptied (a restarted engine starts cold)."""
        if up:
            self.down.discard(replica)
        else:
            self.down.add(replica)
            self.models[replica] = PrefixModel(self.interval, self.models[replica].capacity)
