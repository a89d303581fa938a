"""The KDA-aware prefix cache manager: page allocation, prefix-hash blocks, KDA checkpoints, LRU, host tier.

Bookkeeping only (vLLM v1's split: scheduler / cache manager / model runner): no model tensor is
touched here. The runner (megak3/inference/runner.py) owns the page pool and executes the copy
actions this manager returns, in order: ``("save", page, host_slot)`` writes a device page to the host
tier, ``("load", host_slot, page)`` reads it back.

Layout. One pool of fixed-size physical pages. An MLA page holds ``page_size`` consecutive tokens'
compressed latents for every MLA layer; a KDA checkpoint (the recurrent state and conv tails of every
KDA layer after a boundary) occupies ``checkpoint_pages`` pages. Logical prefix blocks are named by a
hash chained over the token ids (``h_i = H(h_{i-1}, ids of block i)``, seeded by the request's image
content) and map to physical pages only while cached, so sharing and eviction never move data.

A cached block (an *entry*) may carry the KDA checkpoint taken at its end. A checkpoint covers all
KDA layers of one boundary, so it is valid or absent as a whole; it is evicted, written back to the
host tier and prefetched together with its block. A lookup restores the deepest checkpointed
boundary at or below the matched prefix (MLA blocks + KDA state) and the caller prefills the rest.
Entries referenced by a running sequence are pinned (refcount > 0); the others sit in an LRU and are
evicted leaf-first (a chain is touched from its end to its root). Checkpoints dominate the memory
(a KDA state outweighs hundreds of tokens of MLA latents), so a sequence's checkpoint that its own
deeper checkpoint supersedes becomes *interior* and is dropped (alone, its block stays) before any
block is evicted, unless a lookup has restored it (a branch point). What stays is what multi-turn
traffic restores: the deepest state of every chain and the states branches were taken from.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .types import InferenceError

CHECKPOINT_MODES = ("all", "last", "none")
"""``all``: a checkpoint at every ``checkpoint_interval`` boundary a sequence reaches (prefill and
decode); ``last``: only at the last boundary before each prompt's end (vLLM's hybrid "align" mode);
``none``: no prefix reuse"""


@dataclass
class CacheConfig:
    page_size: int = 16
    """tokens per prefix block / MLA page"""
    num_pages: int = 4096
    """device pool size in pages (the cache memory budget; MLA blocks and KDA checkpoints share it)"""
    checkpoint_interval: int = 512
    """tokens between KDA checkpoint boundaries (a multiple of page_size)"""
    checkpoint_mode: str = "all"
    host_pages: int = 0
    """capacity of the host-memory tier in pages; 0 = no host tier (evicted blocks are dropped)"""

    def validate(self) -> "CacheConfig":
        def bad(name, must):
            raise InferenceError(f"cache.{name}={getattr(self, name)!r} must {must}")

        for name in ("page_size", "num_pages", "checkpoint_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(name, "be an integer >= 1")
        if self.checkpoint_interval % self.page_size:
            bad("checkpoint_interval", f"be a multiple of cache.page_size={self.page_size}")
        if self.checkpoint_mode not in CHECKPOINT_MODES:
            bad("checkpoint_mode", f"be one of {', '.join(CHECKPOINT_MODES)}")
        if not isinstance(self.host_pages, int) or self.host_pages < 0:
            bad("host_pages", "be an integer >= 0")
        return self


def image_salt(images) -> bytes:
    """The prefix-cache salt of a prompt with ``images``: blake2b-128 over their fp32 bytes (b"" without
    images). The engine salts its block hashes with it and the router (replicas.py) routes by it."""
    if not images:
        return b""
    h = hashlib.blake2b(digest_size=16)
    for im in images:
        h.update(im.detach().float().cpu().numpy().tobytes())
    return h.digest()


def chain_hashes(ids, page_size: int, salt: bytes = b"") -> List[bytes]:
    """Hash of every full block of ``ids``, each chained over its predecessors (and ``salt``)."""
    out, prev = [], hashlib.blake2b(salt, digest_size=16).digest()
    for i in range(len(ids) // page_size):
        blk = ids[i * page_size:(i + 1) * page_size]
        prev = hashlib.blake2b(prev + b"".join(int(t).to_bytes(4, "little") for t in blk),
                               digest_size=16).digest()
        out.append(prev)
    return out


@dataclass
class _Entry:
    page: Optional[int]                 # device page, None while on the host tier
    ckpt: Optional[List[int]] = None    # device pages of the checkpoint at this block's end
    refs: int = 0
    host: Optional[int] = None          # host slot of the block (host tier only)
    host_ckpt: Optional[List[int]] = None


@dataclass
class SeqPages:
    """One running sequence's view: its page table and the entries it pins."""
    salt: bytes
    table: List[int] = field(default_factory=list)
    hashes: List[bytes] = field(default_factory=list)   # hashes of its full blocks computed so far
    pinned: List[bytes] = field(default_factory=list)   # entries it references
    private: List[int] = field(default_factory=list)    # pages it owns (not in the prefix cache)
    reserve: int = 0                                    # pages still promised to it
    prompt_len: int = 0
    last_ckpt: Optional[bytes] = None                   # the checkpoint it wrote last (None: restored)


@dataclass
class Hit:
    tokens: int
    """prompt tokens restored (a multiple of page_size; 0 = cold)"""
    ckpt_pages: Optional[List[int]]
    """pages of the KDA checkpoint to restore (None when tokens == 0)"""
    actions: List[Tuple]
    """copies to run before reading the pages (host-tier write-backs and prefetches)"""


class CacheManager:
    def __init__(self, cfg: CacheConfig, checkpoint_pages: int):
        self.cfg = cfg.validate()
        self.ckpt_pages = checkpoint_pages
        self.free: List[int] = list(range(cfg.num_pages - 1, -1, -1))
        self.entries: Dict[bytes, _Entry] = {}
        self.lru: "OrderedDict[bytes, None]" = OrderedDict()   # evictable device entries, oldest first
        # superseded checkpoints: a sequence wrote a deeper one on the same chain and nobody has
        # restored this one (a restore makes it a branch point); they are evicted before any block
        self.interior: "OrderedDict[bytes, None]" = OrderedDict()
        self.host_free: List[int] = list(range(cfg.host_pages - 1, -1, -1))
        self.host_lru: "OrderedDict[bytes, None]" = OrderedDict()
        self.reserved = 0
        self.seqs: Dict[int, SeqPages] = {}
        self.stats = {"lookups": 0, "hit_tokens": 0, "hits": 0, "evicted": 0, "written_back": 0,
                      "prefetched": 0, "checkpoints": 0, "evicted_checkpoints": 0, "peak_pages": 0}

    # ------------------------------------------------------------------------------ capacity
    @property
    def reuse(self) -> bool:
        return self.cfg.checkpoint_mode != "none"

    def _evictable_pages(self) -> int:
        n = sum(1 + len(self.entries[h].ckpt or ()) for h in self.lru)
        return n + sum(len(self.entries[h].ckpt) for h in self.interior if h not in self.lru)

    def available(self) -> int:
        """Pages that can still be promised: free + evictable - reserved."""
        return len(self.free) + self._evictable_pages() - self.reserved

    def used_pages(self) -> int:
        return self.cfg.num_pages - len(self.free)

    def _alloc(self, n: int, actions: list) -> List[int]:
        while len(self.free) < n:
            if self.interior:
                h = next(iter(self.interior))
                del self.interior[h]
                e = self.entries[h]
                self.free.extend(e.ckpt)
                e.ckpt = None
                self.stats["evicted_checkpoints"] += 1
                continue
            if not self.lru:
                raise InferenceError(f"cache.num_pages={self.cfg.num_pages} is too small for the running "
                                     "sequences; raise it or run fewer at once")
            self._evict(next(iter(self.lru)), actions)
        pages = [self.free.pop() for _ in range(n)]
        self.stats["peak_pages"] = max(self.stats["peak_pages"], self.used_pages())
        return pages

    def _evict(self, h: bytes, actions: list) -> None:
        e = self.entries[h]
        del self.lru[h]
        self.interior.pop(h, None)
        self.stats["evicted"] += 1
        pages = [e.page] + list(e.ckpt or ())
        need = len(pages)
        if self.cfg.host_pages >= need:
            while len(self.host_free) < need and self.host_lru:
                self._drop_host(next(iter(self.host_lru)))
            if len(self.host_free) >= need:
                slots = [self.host_free.pop() for _ in pages]
                for p, s in zip(pages, slots):
                    actions.append(("save", p, s))
                e.host, e.host_ckpt = slots[0], (slots[1:] if e.ckpt else None)
                e.page, e.ckpt = None, None
                self.host_lru[h] = None
                self.free.extend(pages)
                self.stats["written_back"] += 1
                return
        del self.entries[h]
        self.free.extend(pages)

    def _drop_host(self, h: bytes) -> None:
        e = self.entries.pop(h)
        del self.host_lru[h]
        self.host_free.extend([e.host] + list(e.host_ckpt or ()))

    def _prefetch(self, h: bytes, actions: list) -> None:
        e = self.entries[h]
        slots = [e.host] + list(e.host_ckpt or ())
        pages = self._alloc(len(slots), actions)
        for s, p in zip(slots, pages):
            actions.append(("load", s, p))
        self.host_free.extend(slots)
        e.page, e.ckpt = pages[0], (pages[1:] if e.host_ckpt else None)
        e.host = e.host_ckpt = None
        self.stats["prefetched"] += 1

    # --------------------------------------------------------------------------- sequences
    def begin(self, sid: int, prompt: List[int], max_new: int, salt: bytes = b"", lookup: bool = True,
              headroom: int = 0) -> Optional[Hit]:
        """Admit sequence ``sid``: find the deepest restorable boundary of ``prompt`` (unless not
        ``lookup``), pin its blocks, reserve pages for prompt + ``max_new`` tokens, leaving ``headroom``
        more pages promisable. A hit whose pinned pages (its blocks, their KDA checkpoints, host-tier
        prefetches) would not leave room falls back to cold; returns None (nothing held) when the
        sequence does not fit cold either: the caller waits or preempts."""
        ps, n = self.cfg.page_size, len(prompt)
        seq = SeqPages(salt, prompt_len=n)
        total = -(-(n + max_new) // ps)
        actions: list = []
        hit_blocks, ckpt = 0, None
        if self.reuse and lookup:
            self.stats["lookups"] += 1
            hashes = chain_hashes(prompt[:n - 1], ps, salt)   # the last prompt token is always computed
            depth = 0
            while depth < len(hashes) and hashes[depth] in self.entries:
                depth += 1
            for j in range(depth, 0, -1):
                e = self.entries[hashes[j - 1]]
                if e.ckpt is not None or e.host_ckpt is not None:
                    hit_blocks = j
                    break
            for h in hashes[:hit_blocks]:   # pin first so prefetching cannot evict them
                e = self.entries[h]
                (self.lru if e.page is not None else self.host_lru).pop(h, None)
                e.refs += 1
            seq.hashes = hashes[:hit_blocks]
            seq.pinned = list(seq.hashes)
            interior = hit_blocks and hashes[hit_blocks - 1] in self.interior
            if interior:   # restored: a branch point, keep it (counted as held from now on)
                self.interior.pop(hashes[hit_blocks - 1])
            # pinned entries no longer count as evictable; entries on the host tier come back with
            # their checkpoints: the hit stands only when that and the rest of the sequence fit next
            # to the reservations of the running sequences (else: cold, as a cold engine would run)
            host_need = sum(1 + len(self.entries[h].host_ckpt or ()) for h in seq.hashes
                            if self.entries[h].page is None)
            if hit_blocks and host_need + total - hit_blocks + headroom > self.available():
                if interior:
                    self.interior[hashes[hit_blocks - 1]] = None
                self._release(seq)
                seq = SeqPages(salt, prompt_len=n)
                hit_blocks = 0
            for h in seq.hashes:
                if self.entries[h].page is None:
                    self._prefetch(h, actions)
            seq.table = [self.entries[h].page for h in seq.hashes]
            if hit_blocks:
                ckpt = list(self.entries[hashes[hit_blocks - 1]].ckpt)
                self.stats["hits"] += 1
                self.stats["hit_tokens"] += hit_blocks * ps
        need = total - hit_blocks
        if need + headroom > self.available():
            self._release(seq)
            return None
        seq.reserve = need
        self.reserved += need
        self.seqs[sid] = seq
        return Hit(hit_blocks * ps, ckpt, actions)

    def can_begin(self, prompt_len: int, max_new: int) -> bool:
        """Whether a cold sequence of this size fits next to the running ones now."""
        return -(-(prompt_len + max_new) // self.cfg.page_size) <= self.available()

    def shortfall(self, sid: int, length: int) -> int:
        """Pages ``grow(sid, length)`` would lack now (0: it can grow; else preempt someone first)."""
        seq = self.seqs[sid]
        need = -(-length // self.cfg.page_size) - len(seq.table) - seq.reserve
        return max(0, need - self.available()) if need > 0 else 0

    def fits_alone(self, prompt_len: int, max_new: int) -> bool:
        return -(-(prompt_len + max_new) // self.cfg.page_size) <= self.cfg.num_pages

    def grow(self, sid: int, length: int) -> List[Tuple]:
        """Give ``sid`` pages for ``length`` tokens; returns copy actions (write-backs) to run first."""
        seq, actions = self.seqs[sid], []
        need = -(-length // self.cfg.page_size) - len(seq.table)
        if need > 0:
            take = min(need, seq.reserve)
            seq.reserve -= take
            self.reserved -= take
            pages = self._alloc(need, actions)
            seq.table.extend(pages)
            seq.private.extend(pages)
        return actions

    def commit(self, sid: int, ids: List[int], length: int) -> None:
        """Register ``sid``'s full blocks below ``length`` (their hashes chain over ``ids``)."""
        if not self.reuse:
            return
        seq, ps = self.seqs[sid], self.cfg.page_size
        while (len(seq.hashes) + 1) * ps <= length:
            i = len(seq.hashes)
            prev = seq.hashes[-1] if seq.hashes else hashlib.blake2b(seq.salt, digest_size=16).digest()
            blk = ids[i * ps:(i + 1) * ps]
            h = hashlib.blake2b(prev + b"".join(int(t).to_bytes(4, "little") for t in blk),
                                digest_size=16).digest()
            seq.hashes.append(h)
            if h in self.entries:
                continue   # the same prefix block is already cached: this copy stays private
            page = seq.table[i]
            seq.private.remove(page)
            self.entries[h] = _Entry(page, refs=1)
            seq.pinned.append(h)

    def wants_checkpoint(self, sid: int, length: int, final_len: int = 0) -> bool:
        """Whether the KDA state after ``length`` tokens of ``sid`` should be checkpointed now: only with
        room for it beside the pages ``sid`` still needs to reach ``final_len`` tokens (its own
        checkpoints never crowd out its decoding)."""
        mode, iv = self.cfg.checkpoint_mode, self.cfg.checkpoint_interval
        if mode == "none" or length == 0 or length % iv:
            return False
        seq = self.seqs[sid]
        if mode == "last" and length != (seq.prompt_len - 1) // iv * iv:
            return False
        j = length // self.cfg.page_size
        if len(seq.hashes) < j:
            return False
        e = self.entries.get(seq.hashes[j - 1])
        future = max(0, -(-final_len // self.cfg.page_size) - len(seq.table) - seq.reserve)
        return e is not None and e.page is not None and e.ckpt is None and \
            self.available() >= self.ckpt_pages + future

    def drop_checkpoints(self, sid: int) -> int:
        """Free the checkpoints only ``sid`` pins (it holds its state itself; they served future hits):
        the last resort of a sequence alone in a pool it cannot otherwise grow in. Returns pages freed."""
        freed = 0
        for h in self.seqs[sid].pinned:
            e = self.entries.get(h)
            if e is not None and e.ckpt is not None and e.refs == 1:
                self.free.extend(e.ckpt)
                freed += len(e.ckpt)
                e.ckpt = None
                self.interior.pop(h, None)
                self.stats["evicted_checkpoints"] += 1
        return freed

    def checkpoint_pages(self, sid: int, length: int) -> Tuple[List[int], List[Tuple]]:
        """Allocate and attach the checkpoint pages of boundary ``length`` (after wants_checkpoint)."""
        seq, actions = self.seqs[sid], []
        h = seq.hashes[length // self.cfg.page_size - 1]
        e = self.entries[h]
        e.ckpt = self._alloc(self.ckpt_pages, actions)
        self.stats["checkpoints"] += 1
        prev = seq.last_ckpt
        if prev is not None and prev in self.entries and self.entries[prev].ckpt is not None:
            self.interior[prev] = None   # superseded by this deeper one
        seq.last_ckpt = h
        return e.ckpt, actions

    def prefix_boundaries(self, sid: int, start: int, end: int) -> List[int]:
        """Checkpoint boundaries in (start, end] (chunk ends for prefill)."""
        iv = self.cfg.checkpoint_interval
        if self.cfg.checkpoint_mode == "none":
            return []
        return list(range((start // iv + 1) * iv, end + 1, iv))

    def finish(self, sid: int) -> None:
        """Unpin ``sid``'s entries (they stay cached, evictable) and free its private pages."""
        self._release(self.seqs.pop(sid))

    def _release(self, seq: SeqPages) -> None:
        self.reserved -= seq.reserve
        seq.reserve = 0
        for h in reversed(seq.pinned):   # leaf first into the LRU: the root is evicted last
            e = self.entries.get(h)
            if e is None:
                continue
            e.refs -= 1
            if e.refs == 0:
                (self.lru if e.page is not None else self.host_lru)[h] = None
        self.free.extend(seq.private)
        seq.private, seq.pinned = [], []

    def cache_bytes(self, page_bytes: int) -> dict:
        return {"device_pages_used": self.used_pages(), "peak_pages": self.stats["peak_pages"],
                "device_bytes_budget": self.cfg.num_pages * page_bytes,
                "peak_bytes": self.stats["peak_pages"] * page_bytes}
