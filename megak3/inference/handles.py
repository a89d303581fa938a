"""The records of :class:`megak3.inference.engine.Engine`'s sequences: :class:`SeqHandle` (one sequence, the
public handle) and :class:`PrefillChunk` (a prefill chunk's result kept for the samples of the same prompt)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .runner import SeqState
from .types import SamplingParams

COLD = object()
"""``SeqHandle.past`` of a sequence admitted without a prefix hit, before its first chunk (zero state, no pages)"""


@dataclass(eq=False)
class PrefillChunk:
    """A prefill chunk's result, kept for the twins that take it: positions start .. end-1."""
    start: int
    end: int
    past: object          # the ``past`` of a sequence after it
    latents: torch.Tensor  # ModelRunner.read_latents of those positions
    state: SeqState       # the KDA state after it
    logits: torch.Tensor  # of its last position


@dataclass(eq=False)
class SeqHandle:
    """One sequence of an :class:`Engine` (``Engine.begin``). Read ``id``, ``prompt``, ``token_ids``,
    ``logprobs``, ``top_logprobs`` (per token, when ``params.top_logprobs`` > 0: the k most likely
    (id, logprob) of the distribution sampled), ``finish_reason``, ``finished``, ``paused``,
    ``held``, ``preemptions``; the engine owns the rest."""
    id: int
    """unique among the sequences of its engine, whoever began them"""
    prompt: List[int]
    params: SamplingParams
    images: Optional[list] = None
    max_new: int = 0
    gen: Optional[torch.Generator] = None
    tokens: List[int] = field(default_factory=list)     # prompt + generated
    fed: int = 0                                        # tokens already through the model
    pre: int = 0                                        # tokens to prefill (prompt; + generated after a preemption)
    x0: Optional[torch.Tensor] = None                   # embeddings of tokens[:pre] while prefilling
    state: Optional[SeqState] = None                    # None: waiting (not admitted, or preempted)
    logprobs: List[float] = field(default_factory=list)
    top_logprobs: List[list] = field(default_factory=list)   # per token [(id, logprob)] when params.top_logprobs
    finish: Optional[str] = None
    stop_at: Optional[int] = None                       # text cut (stop string position)
    hit_tokens: int = 0
    past: object = None                                 # the same object for sequences whose computed past is equal
    shared: List["PrefillChunk"] = field(default_factory=list)   # the chunk of its prefill a twin computed (0 or 1)
    paused: bool = False
    preemptions: int = 0
    lead: Optional["SeqHandle"] = None                  # held until this sequence has its first token (prompt_holds.py)
    salt: Optional[bytes] = None                        # prefix-cache salt (hash of its images), once computed
    engine_id: int = 0

    @property
    def out(self) -> List[int]:
        return self.tokens[len(self.prompt):]

    @property
    def token_ids(self) -> List[int]:
        """generated tokens so far"""
        return self.out

    @property
    def finish_reason(self) -> Optional[str]:
        """"stop", "length", "abort" or None while running"""
        return self.finish

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def admitted(self) -> bool:
        """whether it holds pages now (False while waiting, after a preemption and once finished)"""
        return self.state is not None

    @property
    def held(self) -> bool:
        """whether it waits for an earlier sample of its prompt to fill the prefix cache
        (megak3/inference/prompt_holds.py; re-decided at each ``step``)"""
        return self.lead is not None and self.state is None
