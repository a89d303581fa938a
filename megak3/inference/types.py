"""The generation contract's value types: sampling parameters, results and the user-error type."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple


class InferenceError(ValueError):
    """A one-line user error (bad path, prompt beyond the context, bad sampling value); callers print
    ``str(e)`` and exit 2 (CLI) or answer HTTP 400 (server)."""


@dataclass
class SamplingParams:
    max_tokens: int = 16
    """most tokens to generate (the context length also stops a sequence)"""
    temperature: float = 0.0
    """0 = greedy (argmax); > 0 divides the logits before top-k / top-p and sampling"""
    top_p: float = 1.0
    """nucleus: keep the smallest set of most likely tokens whose probability reaches top_p"""
    top_k: int = 0
    """keep the k most likely tokens; 0 = off"""
    seed: Optional[int] = None
    """seed of this request's own generator (its tokens do not depend on its batch mates); None = random"""
    stop_token_ids: Tuple[int, ...] = ()
    """tokens that end the sequence (kept in token_ids, not in text); eos is always one unless ignore_eos"""
    stop: Tuple[str, ...] = ()
    """strings that end the sequence, checked on the decoded text; the text ends before the stop string"""
    ignore_eos: bool = False
    top_logprobs: int = 0
    """also record, per generated token, the k most likely (token, logprob) of the distribution it was
    sampled from (``SeqHandle.top_logprobs``, ``Completion.top_logprobs``); 0 = off"""

    def validate(self) -> None:
        def bad(name, value, must):
            raise InferenceError(f"sampling.{name}={value!r} must {must}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "be an integer >= 1")
        if not _real(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "be a number >= 0 (0 = greedy)")
        if not _real(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "lie in (0, 1]; use 1 to turn it off")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            bad("top_k", self.top_k, "be an integer >= 0; use 0 to turn it off")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2 ** 63):
            bad("seed", self.seed, "be an integer in [0, 2**63) or None")
        if not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool) or self.top_logprobs < 0:
            bad("top_logprobs", self.top_logprobs, "be an integer >= 0; use 0 to turn it off")
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(isinstance(i, int) and i >= 0 for i in ids):
            bad("stop_token_ids", ids, "be a list of token ids >= 0")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "be a list of non-empty strings")
        self.stop_token_ids, self.stop = tuple(ids), tuple(self.stop)


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class Completion:
    prompt_ids: List[int]
    token_ids: List[int]
    """generated tokens (a stop token that ended the sequence is included)"""
    logprobs: List[float]
    """log p of each generated token under the distribution it was sampled from: with temperature > 0,
    ``log_softmax(logits / T)`` truncated by top-k / top-p and renormalised (vLLM's processed logprobs;
    the behaviour logprob RL needs); greedy (temperature 0): the model's ``log_softmax(logits)``"""
    finish_reason: str
    """"stop" (stop token or string), "length" (max_tokens or the context length) or "abort"
    (``Engine.abort`` before it finished)"""
    text: str
    """decoded generated text; a stop token is not shown and a stop string and what follows it are cut"""
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None
    """with ``SamplingParams.top_logprobs`` = k > 0: per generated token, the k most likely (id, logprob)
    of the distribution it was sampled from (the one ``logprobs`` is of), best first; tokens top-k /
    top-p removed are not listed. None when not asked"""


@dataclass
class Scored:
    logprobs: List[float] = field(default_factory=list)
    """len(ids) - 1 values: log p(ids[i] | ids[:i]) for i = 1 .. n-1"""
    greedy: List[bool] = field(default_factory=list)
    """ids[i] == argmax of the model's distribution at position i - 1"""
