"""Prompt holds: the samples of one long prompt prefill it once, through the prefix cache.

:meth:`megak3.inference.Engine.begin` gives a new sequence a *leader* (``SeqHandle.lead``) when an
earlier live, unpaused sequence with no generated token yet has the same prompt (and the same images,
compared by their hash, the prefix cache's salt), the prompt is longer than one KDA checkpoint
interval and the engine reuses prefixes (``Engine(share_prompts=True)``, the default; checkpoint mode
not "none"). While its leader prefills, the sequence is *held*: ``step`` leaves it out of admission
(it holds no pages). Once the leader has its first token, its prompt's blocks and KDA checkpoints are
in the prefix cache, and the held sequences are admitted like any other: a prefix hit restores all but
the tail after the last checkpoint boundary (the samples admitted in the same step on the same cached
blocks compute it once: prefill twins, megak3/inference/engine.py). The tokens of every
sequence are those of the engine without holds (a restored boundary state and the latents are what the
sequence would have computed); its logprobs agree to rounding, since a sequence may share decode steps
with other sequences than it would have, and a batched step rounds by its batch (tests/test_prompt_holds.py
compares tokens exactly and logprobs to 1e-5). Only when tokens arrive changes.

A hold never outlives its reason (decided in :func:`admissible`, each ``step``):

* the leader has its first token, or finished with one: the sequence is admitted (a cache hit);
* the leader ended without a token (aborted, or released), is paused by the caller, or is not among
  the sequences this ``step`` runs: the first of its held sequences in this step becomes the leader of
  the rest, and is admitted (it prefills cold, or from what the leader cached before it stopped);
* the leader is preempted before its first token: the sequences stay held; the leader is re-admitted
  (oldest first, held sequences take no pages) and continues from its cached blocks.

A held sequence that is paused, aborted or released is simply not stepped (it holds nothing). When the
pool is too tight to checkpoint the leader's prompt (``CacheManager.wants_checkpoint``), the held
sequences find a shallower hit (or none) and prefill more themselves: later, never different.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from .cache import image_salt
from .handles import SeqHandle


def salt(h: SeqHandle) -> bytes:
    """The prefix-cache salt of ``h``'s prompt: a hash of its images (b"" without images), computed once."""
    if h.salt is None:
        h.salt = image_salt(h.images)
    return h.salt


def find_leader(h: SeqHandle, live: Iterable[SeqHandle]) -> Optional[SeqHandle]:
    """The sequence ``h`` should wait for: the oldest live, unpaused, unheld sequence other than ``h``
    with ``h``'s prompt and images and no generated token yet (None: ``h`` prefills itself)."""
    for c in live:
        if c is h or c.lead is not None or c.paused or c.finish is not None or c.out:
            continue
        if len(c.prompt) == len(h.prompt) and c.prompt == h.prompt and salt(c) == salt(h):
            return c
    return None


def admissible(waiting: List[SeqHandle], active: List[SeqHandle]) -> List[SeqHandle]:
    """The sequences of ``waiting`` (oldest first) that may be admitted now; the others stay held.
    Ends or hands over the holds whose leader no longer prefills for them (the module docstring)."""
    stepped = {h.id for h in active}
    heir: Dict[int, SeqHandle] = {}   # a leader that stopped -> the held sequence that leads instead
    out = []
    for h in waiting:
        lead = h.lead
        while lead is not None and lead.id in heir and heir[lead.id] is not h:
            lead = h.lead = heir[lead.id]
        if lead is not None and lead.out:   # its prompt is in the prefix cache
            h.lead = None
        elif lead is not None and (lead.finish is not None or lead.paused or lead.id not in stepped):
            heir[lead.id] = h
            h.lead = None
        if h.lead is None:
            out.append(h)
    return out
