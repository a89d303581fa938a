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


def filtered_logprobs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution sampled (fp32, on the CPU): ``log_softmax(logits / T)``,
    tokens outside top-k / top-p set to -inf and the kept ones renormalised."""
    z = logits_V.float().cpu() / params.temperature
    if params.top_k and params.top_k < z.numel():
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, float("-inf"))
    lp = torch.log_softmax(z, -1)
    if params.top_p < 1.0:
        sp, order = lp.exp().sort(descending=True)
        before = sp.cumsum(0) - sp             # mass of the strictly more likely tokens
        drop = torch.zeros_like(lp, dtype=torch.bool).scatter_(0, order, before >= params.top_p)
        lp = lp.masked_fill(drop, float("-inf"))   # keep the smallest set reaching top_p
        lp = lp - torch.logsumexp(lp, 0)
    return lp


def filtered_probs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (fp32, on the CPU)."""
    return filtered_logprobs(logits_V, params).exp()


def sample(logits_V: torch.Tensor, params: SamplingParams, gen: torch.Generator | None,
           top: int = 0) -> tuple[int, float] | tuple[int, float, list]:
    """(token, its logprob); with ``top`` > 0, (token, logprob, [(id, logprob)] of the ``top`` most
    likely tokens of the same distribution, best first; tokens top-k / top-p removed are not listed).
    Sampling (temperature > 0): the logprob under the distribution sampled (temperature applied,
    top-k / top-p truncated and renormalised; vLLM's "processed" logprobs), so it is the exact
    behaviour logprob of RL. Greedy: the model's unmodified ``log_softmax(logits)``."""
    if params.temperature == 0:
        tok = int(logits_V.argmax())
        lp_V = torch.log_softmax(logits_V.float(), -1)
    else:
        lp_V = filtered_logprobs(logits_V, params)
        tok = int(torch.multinomial(lp_V.exp(), 1, generator=gen))
    if not top:
        return tok, float(lp_V[tok])
    v, i = torch.topk(lp_V, min(top, lp_V.numel()))
    return tok, float(lp_V[tok]), [(int(a), float(b)) for a, b in zip(i, v) if b > float("-inf")]
