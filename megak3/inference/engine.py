"""The generation engine: request validation, continuous batching, chunked prefill, sampling.

Each scheduler iteration admits waiting requests while the cache can promise their pages (prefix
lookup first: a hit restores MLA blocks + KDA state and skips those prompt tokens), runs one prefill
chunk of the oldest prefilling sequence (chunks end at KDA checkpoint boundaries so the state there
can be saved), then one decode step over every decoding sequence as a ragged batch. Requests join
while others decode; results keep input order. Bookkeeping lives in :class:`CacheManager`
(megak3/inference/cache.py), tensor work in :class:`ModelRunner` (megak3/inference/runner.py).
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Union

import torch

from .cache import CacheConfig, CacheManager
from .runner import ModelRunner, SeqState
from .sampling import make_generator, sample
from .types import Completion, InferenceError, SamplingParams, Scored


@dataclass
class _Seq:
    rid: int
    prompt: List[int]
    params: SamplingParams
    images: Optional[list] = None
    max_new: int = 0
    gen: Optional[torch.Generator] = None
    tokens: List[int] = field(default_factory=list)     # prompt + generated
    fed: int = 0                                        # tokens already through the model
    x0: Optional[torch.Tensor] = None                   # prompt embeddings while prefilling
    state: Optional[SeqState] = None
    logprobs: List[float] = field(default_factory=list)
    finish: Optional[str] = None
    stop_at: Optional[int] = None                       # text cut (stop string position)
    hit_tokens: int = 0

    @property
    def out(self) -> List[int]:
        return self.tokens[len(self.prompt):]


class Engine:
    """Generation over a K3 model (the module docstring; the contract in docs/INTERFACES.md).

    ``Engine(model, tokenizer=None, page_size=16, num_pages=None, checkpoint_interval=512,
    checkpoint_mode="all", host_pages=0, prefill_chunk=256, max_batch=32)``: ``page_size`` tokens per
    prefix block / MLA page; ``num_pages`` the pool (cache memory budget; default: four full-context
    sequences plus 64 KDA checkpoints); ``checkpoint_interval`` tokens between KDA checkpoints;
    ``checkpoint_mode`` "all" | "last" | "none" (megak3/inference/cache.py); ``host_pages`` the host
    tier; ``prefill_chunk`` tokens per prefill step; ``max_batch`` sequences running at once.
    The pool is fp32 whatever the model dtype.
    """

    def __init__(self, model, tokenizer=None, *, page_size: int = 16, num_pages: Optional[int] = None,
                 checkpoint_interval: int = 512, checkpoint_mode: str = "all", host_pages: int = 0,
                 prefill_chunk: int = 256, max_batch: int = 32):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_context = int(model.config.max_seq_len)
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise InferenceError(f"cache.prefill_chunk={prefill_chunk!r} must be an integer >= 1")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InferenceError(f"max_batch={max_batch!r} must be an integer >= 1")
        self.prefill_chunk, self.max_batch = prefill_chunk, max_batch
        probe = CacheConfig(page_size, 1, checkpoint_interval, checkpoint_mode, host_pages).validate()
        self.runner = ModelRunner(model, page_size, 0)
        if num_pages is None:   # 4 full-context sequences plus 64 checkpoints
            num_pages = 4 * -(-self.max_context // page_size) + 64 * self.runner.checkpoint_pages
        probe.num_pages = num_pages
        self.cache = CacheManager(probe, self.runner.checkpoint_pages)
        self.runner = ModelRunner(model, page_size, num_pages, host_pages)
        self._next_id = 0

    @classmethod
    def from_pretrained(cls, path: str, *, device="cpu", dtype="float32", tokenizer=None,
                        **cache_options) -> "Engine":
        """An engine over a megak3 run / checkpoint directory (any training layout) or a Hugging Face
        export directory; ``cache_options`` are the keyword arguments of ``Engine``."""
        from .loading import load_model

        model, tok, info = load_model(path, device=device, dtype=dtype, tokenizer=tokenizer)
        eng = cls(model, tok, **cache_options)
        eng.load_info = info
        return eng

    # ---------------------------------------------------------------------------- public API
    def generate(self, prompts: List[List[int]], params: Union[SamplingParams, List[SamplingParams]],
                 images: Optional[List[Optional[list]]] = None) -> List[Completion]:
        """Complete every prompt (continuously batched); results in input order. ``images``: per
        prompt, the image tensors its media placeholders stand for (or None)."""
        seqs = self._requests(prompts, params, images)
        for _ in self._schedule(seqs):
            pass
        return [self._completion(s) for s in seqs]

    def stream(self, prompt: List[int], params: SamplingParams, images: Optional[list] = None
               ) -> Iterator[tuple]:
        """Yield (token, logprob) as each token is produced."""
        seqs = self._requests([prompt], params, [images])
        for s, tok, lp in self._schedule(seqs):
            yield tok, lp

    def score(self, seqs: List[List[int]]) -> List[Scored]:
        """log p(ids[i] | ids[:i]) and whether ids[i] is the argmax, for i = 1 .. n-1 of each sequence."""
        out = []
        for ids in seqs:
            self._check_ids(ids, "seqs", allow_full=True)
            if len(ids) < 2:
                out.append(Scored([], []))
                continue
            s = _Seq(self._new_id(), list(ids[:-1]), SamplingParams(max_tokens=1), tokens=list(ids[:-1]))
            self._begin(s, lookup=False)
            chunks = []
            while s.fed < len(s.prompt):
                chunks.append(self._prefill_chunk(s, all_logits=True))
            self.cache.finish(s.rid)
            logp = torch.log_softmax(torch.cat(chunks, 0), -1)
            tgt = torch.as_tensor(ids[1:])
            lp = logp.gather(1, tgt[:, None])[:, 0]
            out.append(Scored([float(v) for v in lp], [bool(b) for b in logp.argmax(-1) == tgt]))
        return out

    def next_logits(self, prompts: List[List[int]]) -> torch.Tensor:
        """fp32 logits [N, V] of the token after each prompt, through the prefix cache (a hit
        restores the deepest checkpointed boundary and prefills the rest)."""
        rows = []
        for i, p in enumerate(prompts):
            self._check_ids(p, f"prompts[{i}]")
            s = _Seq(self._new_id(), list(p), SamplingParams(max_tokens=1), max_new=1, tokens=list(p))
            self._begin(s)
            try:
                while s.fed < len(s.prompt):
                    logits = self._prefill_chunk(s)
            finally:
                self.cache.finish(s.rid)
            rows.append(logits)
        return torch.stack(rows)

    def cache_stats(self) -> dict:
        return {**self.cache.stats, **self.cache.cache_bytes(self.runner.page_bytes)}

    # ------------------------------------------------------------------------------- checks
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _check_ids(self, ids, what: str, allow_full: bool = False) -> None:
        V = self.model.config.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(t, int) for t in ids):
            raise InferenceError(f"{what}: every entry must be a non-empty list of token ids")
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise InferenceError(f"{what}: token id {bad} is outside the vocabulary [0, {V})")
        limit = self.max_context if allow_full else self.max_context - 1
        if len(ids) > limit:
            raise InferenceError(f"{what}: {len(ids)} tokens exceed the context ({self.max_context} tokens, "
                                 f"model.max_seq_len, {'' if allow_full else 'leaving room for one new token'}); "
                                 "shorten the prompt")

    def _requests(self, prompts, params, images) -> List[_Seq]:
        if not isinstance(prompts, (list, tuple)):
            raise InferenceError("prompts must be a list of token-id lists")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InferenceError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        images = list(images) if images is not None else [None] * len(prompts)
        seqs = []
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            self._check_ids(p, f"prompts[{i}]")
            if not isinstance(sp, SamplingParams):
                raise InferenceError(f"params[{i}] must be a SamplingParams")
            sp.validate()
            if sp.stop and self.tokenizer is None:
                raise InferenceError("sampling.stop needs a tokenizer; this engine has none")
            max_new = min(sp.max_tokens, self.max_context - len(p))
            if not self.cache.fits_alone(len(p), max_new):
                raise InferenceError(f"cache.num_pages={self.cache.cfg.num_pages} cannot hold a {len(p)}-token "
                                     f"prompt plus {max_new} new tokens; raise cache.num_pages")
            seqs.append(_Seq(self._new_id(), list(p), sp, images[i], max_new, make_generator(sp), list(p)))
        return seqs

    # ----------------------------------------------------------------------------- schedule
    def _schedule(self, seqs: List[_Seq]):
        """Run ``seqs`` to completion; yields (seq, token, logprob) per generated token."""
        waiting, prefilling, decoding = deque(seqs), [], []
        try:
            while waiting or prefilling or decoding:
                yield from self._step(waiting, prefilling, decoding)
        finally:
            for s in list(prefilling) + list(decoding):
                if s.rid in self.cache.seqs:
                    self.cache.finish(s.rid)

    def _step(self, waiting: deque, prefilling: list, decoding: list):
        """One scheduler iteration over the three queues, updated in place: admit waiting sequences
        while the batch and the pages allow, one prefill chunk of the oldest prefilling sequence, one
        ragged decode step over the decoding ones. Yields (seq, token, logprob) per generated token.
        The one scheduling core: generate/stream (:meth:`_schedule`) and the post-training partial
        rollouts (megak3/posttrain/rollout.py, which stop between iterations) both run it."""
        while waiting and len(prefilling) + len(decoding) < self.max_batch:
            s = waiting[0]
            if (prefilling or decoding) and not self.cache.can_begin(len(s.prompt), s.max_new):
                break   # wait for a running sequence to free its pages
            waiting.popleft()
            self._begin(s)
            prefilling.append(s)
        if prefilling:
            s = prefilling[0]
            logits = self._prefill_chunk(s)
            if s.fed == len(s.prompt):
                prefilling.pop(0)
                s.x0 = None
                yield from self._emit(s, logits)
                if s.finish is None:
                    decoding.append(s)
        if decoding:
            logits = self._decode(decoding)
            for s, row in zip(list(decoding), logits):
                yield from self._emit(s, row)
            decoding[:] = [s for s in decoding if s.finish is None]

    def _begin(self, s: _Seq, lookup: bool = True) -> None:
        salt = b""
        if s.images:
            h = hashlib.blake2b(digest_size=16)
            for im in s.images:
                h.update(im.detach().float().cpu().numpy().tobytes())
            salt = h.digest()
        hit = self.cache.begin(s.rid, s.prompt, s.max_new, salt, lookup=lookup)
        self.runner.execute(hit.actions)
        s.state = self.runner.load_state(hit.ckpt_pages) if hit.tokens else self.runner.new_state()
        s.fed = s.hit_tokens = hit.tokens
        s.x0 = self.runner.embed(s.prompt, s.images)

    def _prefill_chunk(self, s: _Seq, all_logits: bool = False) -> torch.Tensor:
        start, n = s.fed, len(s.prompt)
        end = min(start + self.prefill_chunk, n)
        bounds = [b for b in self.cache.prefix_boundaries(s.rid, start, n) if b < end]
        end = bounds[0] if bounds else end
        self.runner.execute(self.cache.grow(s.rid, end))
        table = self.cache.seqs[s.rid].table
        logits = self.runner.forward(s.x0[:, start:end], [s.state], [start], [table], all_logits)
        s.fed = end
        self._after_forward(s)
        return logits[0]

    def _decode(self, seqs: List[_Seq]) -> torch.Tensor:
        for s in seqs:
            self.runner.execute(self.cache.grow(s.rid, s.fed + 1))
        ids = torch.as_tensor([[s.tokens[s.fed]] for s in seqs], device=self.runner.device)
        x0 = self.model.embed(ids)
        logits = self.runner.forward(x0, [s.state for s in seqs], [s.fed for s in seqs],
                                     [self.cache.seqs[s.rid].table for s in seqs])
        for s in seqs:
            s.fed += 1
            self._after_forward(s)
        return logits

    def _after_forward(self, s: _Seq) -> None:
        self.cache.commit(s.rid, s.tokens, s.fed)
        if self.cache.wants_checkpoint(s.rid, s.fed):
            pages, actions = self.cache.checkpoint_pages(s.rid, s.fed)
            self.runner.execute(actions)
            self.runner.save_state(s.state, pages)

    def _emit(self, s: _Seq, logits_V: torch.Tensor):
        tok, lp = sample(logits_V, s.params, s.gen)
        s.tokens.append(tok)
        s.logprobs.append(lp)
        sp = s.params
        stops = set(sp.stop_token_ids)
        if not sp.ignore_eos and self.tokenizer is not None:
            stops.add(self.tokenizer.eos_id)
        elif not sp.ignore_eos:
            stops.add(int(self.model.config.eos_token_id))
        if tok in stops:
            s.finish = "stop"
        elif sp.stop:
            text = self.tokenizer.decode(s.out)
            at = [text.find(x) for x in sp.stop if x in text]
            if at:
                s.finish, s.stop_at = "stop", min(at)
        if s.finish is None and (len(s.out) >= s.max_new or len(s.tokens) >= self.max_context):
            s.finish = "length"
        yield s, tok, lp
        if s.finish is not None:
            self.cache.finish(s.rid)

    def _completion(self, s: _Seq) -> Completion:
        out = list(s.out)
        text = ""
        if self.tokenizer is not None:
            shown = out[:-1] if (s.finish == "stop" and s.stop_at is None) else out
            text = self.tokenizer.decode(shown)
            if s.stop_at is not None:
                text = text[:s.stop_at]
        return Completion(list(s.prompt), out, list(s.logprobs), s.finish, text)
