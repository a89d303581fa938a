"""Token choice from one sequence's logits: greedy, or temperature / top-k / top-p sampling drawn from
the request's own generator (so a request's tokens do not depend on its batch mates)."""
from __future__ import annotations

import random

import torch

from .types import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's CPU generator (None for greedy): seeded by ``params.seed``, else at random."""
    if params.temperature == 0:
        return None
    seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2 ** 63)
    return torch.Generator("cpu").manual_seed(seed)


def filtered_probs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (fp32, on the CPU)."""
    z = logits_V.float().cpu() / params.temperature
    if params.top_k and params.top_k < z.numel():
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    p = z.softmax(-1)
    if params.top_p < 1.0:
        sp, order = p.sort(descending=True)
        before = sp.cumsum(0) - sp             # mass of the strictly more likely tokens
        sp = sp.masked_fill(before >= params.top_p, 0.0)   # keep the smallest set reaching top_p
        p = torch.zeros_like(p).scatter_(0, order, sp)
        p = p / p.sum()
    return p


def sample(logits_V: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> tuple[int, float]:
    """(token, log p(token) under the unmodified model distribution)."""
    logp_V = torch.log_softmax(logits_V.float(), -1)
    if params.temperature == 0:
        tok = int(logits_V.argmax())
    else:
        tok = int(torch.multinomial(filtered_probs(logits_V, params), 1, generator=gen))
    return tok, float(logp_V[tok])
