"""Prompt scoring for the server's ``echo`` with ``max_tokens: 0``: each sequence's token logprobs from one
training-style forward of the engine's model (``model(ids, cu_seqlens=..., return_logits=True)``, the same
call the RL trainer scores rows with), not through the engine's paged decode path (``Engine.score``: one
sequence at a time through the prefix cache). So a served MOPD teacher gives the trainer the logprobs a
teacher loaded in-process gives (tests/test_mopd_served.py), and a scoring request takes no cache pages
from the sequences being decoded.

Rows are laid out as the trainer's ``response_batch`` lays them out: ``[B, T]`` padded with the pad id,
one ``cu_seqlens`` segment per row and one for its padding; at most ``max_tokens`` positions per forward
(rows grouped in arrival order), so the logits tensor stays ``[B, T, V]`` of that size.
"""
from __future__ import annotations

import math
from typing import List

import torch

from .types import InferenceError


@torch.no_grad()
def prompt_logprobs(model, seqs: List[List[int]], temperature: float = 1.0, pad_id: int = 0,
                    max_tokens: int = 2048) -> List[List[float]]:
    """``len(s) - 1`` values per sequence ``s``: ``log softmax(logits / T)[s[i]]`` at position ``i - 1``,
    i = 1 .. len(s) - 1 (T = ``temperature``; 0 scores with the untempered logits, as greedy sampling's
    logprobs are the model's own). Raises :class:`RuntimeError` when a value is not finite (broken weights)."""
    out: List[List[float]] = [[] for _ in seqs]
    todo = [i for i, s in enumerate(seqs) if len(s) >= 2]
    dev = next(model.parameters()).device
    while todo:
        group, longest = [], 0
        for i in todo:   # arrival order, at most max_tokens padded positions (one row always)
            L = len(seqs[i]) - 1
            if group and (len(group) + 1) * max(longest, L) > max_tokens:
                break
            group.append(i)
            longest = max(longest, L)
        todo = todo[len(group):]
        B, T = len(group), longest
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        tgt = torch.zeros((B, T), dtype=torch.long)
        cu = [0]
        for b, i in enumerate(group):
            s = seqs[i]
            L = len(s) - 1
            ids[b, :L] = torch.tensor(s[:-1])
            tgt[b, :L] = torch.tensor(s[1:])
            cu += [b * T + L] if L < T else []
            cu.append((b + 1) * T)
        logits = model(ids.to(dev), cu_seqlens=torch.tensor(cu, dtype=torch.int32), return_logits=True).logits
        if temperature > 0:   # the trainer's transform (RLRunner._logits_logp), op for op
            logits = logits.float() / temperature
        lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tgt.to(dev).unsqueeze(-1)).squeeze(-1).cpu()
        for b, i in enumerate(group):
            row = [float(v) for v in lp[b, :len(seqs[i]) - 1]]
            if not all(math.isfinite(v) for v in row):
                raise RuntimeError("the model's logprobs are not finite (non-finite weights?)")
            out[i] = row
    return out


def check_scoring(seqs: List[List[int]], vocab_size: int, max_context: int) -> None:
    """:class:`InferenceError` unless every id lies in the vocabulary and every sequence fits the context
    (``max_context + 1`` tokens: the forward runs over all but the last)."""
    for k, s in enumerate(seqs):
        if any(not 0 <= t < vocab_size for t in s):
            raise InferenceError(f"prompt {k}: token ids must lie in [0, {vocab_size})")
        if len(s) > max_context + 1:
            raise InferenceError(f"prompt {k} has {len(s)} tokens; scoring takes at most max_model_len + 1 = "
                                 f"{max_context + 1}")


__all__ = ["prompt_logprobs", "check_scoring"]
