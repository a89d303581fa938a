"""The generation engine: request validation, continuous batching, chunked prefill, preemption, sampling.

Sequences are long-lived handles (:class:`SeqHandle`): ``begin`` validates a request and queues it,
``step`` runs one scheduler iteration, ``pause`` / ``resume`` take a sequence out of ``step()``'s
default set and back, ``release`` (``abort``) frees it. ``generate`` and ``stream`` are loops over
that API, and so are the post-training partial rollouts (megak3/posttrain/rollout.py).

Each scheduler iteration admits waiting sequences (oldest first) while the batch and the pages allow
(prefix lookup first: a hit restores MLA blocks + KDA state and skips those prompt tokens; a hit whose
pinned pages would not leave room falls back to a cold prefill, and a sequence that fits neither way
waits), runs one prefill chunk of the oldest prefilling sequence (chunks end at KDA checkpoint
boundaries so the state there can be saved), then one decode step over every decoding sequence as a
ragged batch. Prefilling sequences whose next chunk is that same computation (equal embeddings over an
equal computed past: the K samples of one prompt admitted together, cold or on the same cached blocks)
keep its result, the chunk's MLA latents, KDA state and last logits, instead of recomputing it when their
own turn comes (one chunk held at a time: a prompt longer than ``prefill_chunk`` shares its first chunk
after the admission): the schedule and every output
are those of the engine without this, bit for bit (the forward is deterministic and its inputs are
equal); ``cache_stats()["prefill_shared"]`` counts the prefill tokens so saved. A sequence begun while an
earlier one with its prompt (longer than a checkpoint interval) has no token yet is *held* out of admission
until that one has (megak3/inference/prompt_holds.py), then restores the prompt from the prefix cache.
Admission reserves only the prompt's pages (plus one for the first new token): a
decoding sequence grows page by page, and when the pool runs out the newest sequence holding pages
is *preempted by recompute* (paused sequences and sequences outside the current step first): its
pages are freed (its committed blocks stay cached and evictable), and when it is admitted again it
prefills prompt + generated tokens (through the prefix cache) and continues with the same sampling
generator, so its tokens are those of an uninterrupted run. Bookkeeping lives in
:class:`CacheManager` (megak3/inference/cache.py), tensor work in :class:`ModelRunner`
(megak3/inference/runner.py).
"""
from __future__ import annotations

import itertools
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .cache import CacheConfig, CacheManager
from .prompt_holds import admissible, find_leader, salt as prompt_salt
from .handles import COLD, PrefillChunk, SeqHandle
from .runner import ModelRunner
from .sampling import make_generator, sample
from .types import Completion, InferenceError, SamplingParams, Scored

_ENGINE_IDS = itertools.count(1)
class Engine:
    """Generation over a K3 model (the module docstring; the contract in docs/INTERFACES.md).

    ``Engine(model, tokenizer=None, page_size=16, num_pages=None, checkpoint_interval=512,
    checkpoint_mode="all", host_pages=0, prefill_chunk=256, max_batch=32)``: ``page_size`` tokens per
    prefix block / MLA page; ``num_pages`` the pool (cache memory budget; default: four full-context
    sequences plus 64 KDA checkpoints); ``checkpoint_interval`` tokens between KDA checkpoints;
    ``checkpoint_mode`` "all" | "last" | "none" (megak3/inference/cache.py); ``host_pages`` the host
    tier; ``prefill_chunk`` tokens per prefill step; ``max_batch`` sequences running at once;
    ``preempt`` (default True) admits on the prompt's pages and preempts by recompute when decoding
    runs out of pages; False reserves prompt + max_tokens pages at admission (the former policy: no
    sequence is ever preempted, far fewer run at once); ``cache_dtype`` the MLA latents' dtype in the
    page pool: None = the model's (bf16 for a bf16 model), or "float32" / "bfloat16" / "float16"; KDA
    states and checkpoints stay fp32 either way (megak3/inference/runner.py). A bf16 pool under an fp32
    model moves next-token logits by 4e-5 of the largest logit on the test model (bound tested: 1e-3,
    tests/test_inference_engine_api.py; bf16 keeps 8 mantissa bits of each latent) and halves the
    bytes of an MLA page. ``share_prompts`` (default True): hold the later samples of a long prompt
    until the first has its prompt in the prefix cache (megak3/inference/prompt_holds.py; False: every
    sample prefills its prompt itself; the tokens are the same either way).
    """

    def __init__(self, model, tokenizer=None, *, page_size: int = 16, num_pages: Optional[int] = None,
                 checkpoint_interval: int = 512, checkpoint_mode: str = "all", host_pages: int = 0,
                 prefill_chunk: int = 256, max_batch: int = 32, preempt: bool = True,
                 cache_dtype: Optional[str] = None, share_prompts: bool = True):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_context = int(model.config.max_seq_len)
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise InferenceError(f"cache.prefill_chunk={prefill_chunk!r} must be an integer >= 1")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InferenceError(f"max_batch={max_batch!r} must be an integer >= 1")
        self.prefill_chunk, self.max_batch, self.preempt = prefill_chunk, max_batch, bool(preempt)
        self.share_prompts = bool(share_prompts)
        probe = CacheConfig(page_size, 1, checkpoint_interval, checkpoint_mode, host_pages).validate()
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if cache_dtype is not None and cache_dtype not in dtypes:
            raise InferenceError(f"cache.dtype={cache_dtype!r} must be one of {', '.join(dtypes)} "
                                 "(or None: the model's dtype)")
        pool_dtype = dtypes.get(cache_dtype)
        self.runner = ModelRunner(model, page_size, 0, pool_dtype=pool_dtype)
        if num_pages is None:   # 4 full-context sequences plus 64 checkpoints
            num_pages = 4 * -(-self.max_context // page_size) + 64 * self.runner.checkpoint_pages
        probe.num_pages = num_pages
        self.cache = CacheManager(probe, self.runner.checkpoint_pages)
        self.runner = ModelRunner(model, page_size, num_pages, host_pages, pool_dtype=pool_dtype)
        self._ids = itertools.count(1)
        self._engine_id = next(_ENGINE_IDS)
        self._live: Dict[int, SeqHandle] = {}   # begun, unfinished, not released; in begin order
        self.preemptions = 0
        self.prefill_shared = 0   # prefill tokens a sequence took from its twin's chunk instead of recomputing
        self.prefill_computed = 0   # prefill tokens run through the model (step, score, next_logits)
        self._hit_pasts: Dict[bytes, object] = {}

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

    # ------------------------------------------------------------------ sequence handles
    def begin(self, prompt: List[int], params: SamplingParams, images: Optional[list] = None) -> SeqHandle:
        """Validate one request and queue it; returns its handle (no model work until :meth:`step`).
        Raises InferenceError (one line) on a bad prompt, bad sampling value, or a request that could
        not fit the pool even alone."""
        return self._request(prompt, params, images, "prompt")

    def step(self, handles: Optional[Sequence[SeqHandle]] = None) -> List[Tuple[SeqHandle, int, float]]:
        """One scheduler iteration over ``handles`` (default: every live, unpaused sequence): admit,
        one prefill chunk, one decode step. Returns (handle, token, logprob) per token produced (at most
        one per handle; with ``params.top_logprobs`` its alternatives are ``handle.top_logprobs[-1]``). A
        finished sequence frees its pages and leaves the engine; passing it again is a no-op."""
        if handles is None:
            active = [h for h in self._live.values() if not h.paused]
        else:
            active = []
            for h in handles:
                self._own(h)
                if h.finish is not None:
                    continue
                if h.id not in self._live:
                    raise InferenceError(f"sequence {h.id} was released; begin a new one")
                if h.paused:
                    raise InferenceError(f"sequence {h.id} is paused; resume it before stepping it")
                active.append(h)
            active.sort(key=lambda h: h.id)   # oldest first: admission, prefill and preemption order
        return list(self._iterate(active))

    def pause(self, h: SeqHandle) -> None:
        """Keep ``h``'s state and pages but leave it out of ``step()``; under page pressure a paused
        sequence is the first preempted (it then recomputes its past when resumed)."""
        self._own(h)
        h.paused = h.finish is None

    def resume(self, h: SeqHandle) -> None:
        """Make a paused sequence steppable again. A sequence paused inside its prefill re-embeds the
        rest of its prompt (the embedding table may have been refit); its cached past stays as computed."""
        self._own(h)
        h.paused = False
        if h.state is not None and h.fed < h.pre:
            h.x0 = self.runner.embed(h.tokens[:h.pre], h.images)

    def release(self, h: SeqHandle) -> None:
        """Free ``h``'s pages and forget it (a finished sequence was already freed: no-op)."""
        self._own(h)
        if self._live.pop(h.id, None) is not None and h.state is not None:
            self.cache.finish(h.id)
        h.state = h.x0 = None

    def abort(self, h: SeqHandle) -> None:
        """Stop an unfinished sequence (finish_reason "abort") and free it: a disconnected client."""
        if h.finish is None:
            h.finish = "abort"
        self.release(h)

    def completion(self, h: SeqHandle) -> Completion:
        """The :class:`Completion` of ``h`` so far (its text cut at a stop token / string)."""
        out = list(h.out)
        text = ""
        if self.tokenizer is not None:
            shown = out[:-1] if (h.finish == "stop" and h.stop_at is None) else out
            text = self.tokenizer.decode(shown)
            if h.stop_at is not None:
                text = text[:h.stop_at]
        return Completion(list(h.prompt), out, list(h.logprobs), h.finish, text,
                          [list(t) for t in h.top_logprobs] if h.params.top_logprobs else None)

    def live(self) -> List[SeqHandle]:
        """Unfinished, unreleased sequences in begin order (running, waiting, paused)."""
        return list(self._live.values())

    # ----------------------------------------------------------------- batch entry points
    def generate(self, prompts: List[List[int]], params: Union[SamplingParams, List[SamplingParams]],
                 images: Optional[List[Optional[list]]] = None) -> List[Completion]:
        """Complete every prompt (continuously batched); results in input order. ``images``: per
        prompt, the image tensors its media placeholders stand for (or None)."""
        hs = self._requests(prompts, params, images)
        try:
            while any(h.finish is None for h in hs):
                self.step(hs)
        finally:
            for h in hs:
                self.release(h)
        return [self.completion(h) for h in hs]

    def stream(self, prompt: List[int], params: SamplingParams, images: Optional[list] = None
               ) -> Iterator[tuple]:
        """Yield (token, logprob) as each token is produced (closing the iterator aborts the sequence)."""
        h = self.begin(prompt, params, images)
        try:
            while h.finish is None:
                for _, tok, lp in self.step([h]):
                    yield tok, lp
        finally:
            self.abort(h)

    def score(self, seqs: List[List[int]]) -> List[Scored]:
        """log p(ids[i] | ids[:i]) and whether ids[i] is the argmax, for i = 1 .. n-1 of each sequence
        (at most ``max_context + 1`` tokens: the forward runs over ``ids[:-1]``, like a Hugging Face
        model scoring a full-context window)."""
        out = []
        for ids in seqs:
            self._check_ids(ids, "seqs", extra=2)
            if len(ids) < 2:
                out.append(Scored([], []))
                continue
            s = self._handle(list(ids[:-1]), SamplingParams(max_tokens=1), None, 1)
            self._admit_now(s, lookup=False)
            chunks = []
            try:
                while s.fed < s.pre:
                    chunks.append(self._prefill_chunk(s, all_logits=True))
            finally:
                self.cache.finish(s.id)
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
            s = self._handle(list(p), SamplingParams(max_tokens=1), None, 1)
            self._admit_now(s)
            try:
                while s.fed < s.pre:
                    logits = self._prefill_chunk(s)
            finally:
                self.cache.finish(s.id)
            rows.append(logits)
        return torch.stack(rows)

    def cache_stats(self) -> dict:
        return {**self.cache.stats, **self.cache.cache_bytes(self.runner.page_bytes),
                "preemptions": self.preemptions, "prefill_shared": self.prefill_shared,
                "prefill_computed": self.prefill_computed}

    # ------------------------------------------------------------------------------- checks
    def _own(self, h) -> None:
        if not isinstance(h, SeqHandle) or h.engine_id != self._engine_id:
            raise InferenceError("not a sequence handle of this engine (use the one Engine.begin returned)")

    def _check_ids(self, ids, what: str, extra: int = 0) -> None:
        """Token ids in the vocabulary, at most ``max_context - 1 + extra`` of them (a prompt leaves
        room for one new token; ``score`` predicts its last token without feeding it: extra=2)."""
        V = self.model.config.vocab_size
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(t, int) for t in ids):
            raise InferenceError(f"{what}: every entry must be a non-empty list of token ids")
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise InferenceError(f"{what}: token id {bad} is outside the vocabulary [0, {V})")
        limit = self.max_context - 1 + extra
        if len(ids) > limit:
            room = "leaving room for one new token" if extra == 0 else f"at most {limit} tokens to score"
            raise InferenceError(f"{what}: {len(ids)} tokens exceed the context ({self.max_context} tokens, "
                                 f"model.max_seq_len, {room}); shorten the prompt")

    def _handle(self, prompt, params, images, max_new) -> SeqHandle:
        return SeqHandle(next(self._ids), prompt, params, images, max_new, make_generator(params), list(prompt),
                         engine_id=self._engine_id)

    def _request(self, p, sp, images, what: str) -> SeqHandle:
        self._check_ids(p, what)
        if not isinstance(sp, SamplingParams):
            raise InferenceError(f"params of {what} must be a SamplingParams")
        sp.validate()
        if sp.stop and self.tokenizer is None:
            raise InferenceError("sampling.stop needs a tokenizer; this engine has none")
        if images is not None and not isinstance(images, (list, tuple)):
            raise InferenceError(f"{what}: images must be a list of image tensors or None")
        max_new = min(sp.max_tokens, self.max_context - len(p))
        if not self.cache.fits_alone(len(p), max_new):
            raise InferenceError(f"cache.num_pages={self.cache.cfg.num_pages} cannot hold a {len(p)}-token "
                                 f"prompt plus {max_new} new tokens; raise cache.num_pages")
        h = self._handle(list(p), sp, list(images) if images else None, max_new)
        if self.share_prompts and self.cache.reuse and len(p) > self.cache.cfg.checkpoint_interval:
            h.lead = find_leader(h, self._live.values())
        self._live[h.id] = h
        return h

    def _requests(self, prompts, params, images) -> List[SeqHandle]:
        if not isinstance(prompts, (list, tuple)):
            raise InferenceError("prompts must be a list of token-id lists")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InferenceError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise InferenceError(f"images: {len(images)} entries for {len(prompts)} prompts (None where a "
                                 "prompt has no image)")
        hs = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist)):
                hs.append(self._request(p, sp, images[i], f"prompts[{i}]"))
        except InferenceError:
            for h in hs:
                self.release(h)
            raise
        return hs

    # ----------------------------------------------------------------------------- schedule
    def _iterate(self, active: List[SeqHandle]):
        """One scheduler iteration over ``active`` (oldest first); yields (seq, token, logprob)."""
        self._hit_pasts = {}   # sequences admitted now on the same cached blocks have an equal past
        waiting = admissible([h for h in active if h.state is None], active)
        prefilling = [h for h in active if h.state is not None and h.fed < h.pre]
        decoding = [h for h in active if h.state is not None and h.fed >= h.pre]
        for h in waiting:
            running = len(prefilling) + len(decoding)
            if running >= self.max_batch:
                break
            # with others running, leave a page per running sequence for its next decode step
            if not self._admit(h, active, headroom=(running if self.preempt else 0) if running else None):
                break   # wait for a running sequence to free its pages
            prefilling.append(h)
        if prefilling:   # a sequence whose prefill ends here decodes from the next iteration on
            h = prefilling[0]
            twins = [] if h.shared else self._twins(h, prefilling[1:])
            start = h.fed
            logits = self._prefill_chunk(h)
            if twins:   # they take this result when their turn comes (in the same order as without it)
                table = self.cache.seqs[h.id].table
                chunk = PrefillChunk(start, h.fed, h.past, self.runner.read_latents(table, start, h.fed),
                               self.runner.copy_state(h.state), logits)
                for t in twins:
                    t.shared.append(chunk)
            if h.fed == h.pre:
                h.x0 = None
                yield from self._emit(h, logits)
        if decoding:
            decoding = self._make_room(decoding, active)
        if decoding:
            logits = self._decode(decoding)
            for h, row in zip(decoding, logits):
                yield from self._emit(h, row)

    def _holders(self, keep: List[SeqHandle]) -> List[SeqHandle]:
        """Preemption candidates, first to go first: sequences holding pages that are paused or not in
        ``keep`` (newest first), then those of ``keep`` (newest first)."""
        held = [h for h in self._live.values() if h.state is not None]
        kept = {h.id for h in keep}
        idle = [h for h in held if h.paused or h.id not in kept]
        busy = [h for h in held if not h.paused and h.id in kept]
        return idle[::-1] + busy[::-1]

    def _preempt(self, h: SeqHandle) -> None:
        """Free ``h``'s pages; it waits and recomputes its past on its next admission."""
        self.cache.finish(h.id)
        h.state = h.x0 = None
        h.fed = 0
        h.shared = []
        h.preemptions += 1
        self.preemptions += 1

    def _admit(self, h: SeqHandle, active: List[SeqHandle], headroom: Optional[int]) -> bool:
        """Admit ``h`` if it fits (``headroom`` spare pages when others run); with nothing else running
        it preempts idle holders until it fits."""
        if headroom is not None:
            return self._begin(h, headroom=headroom)
        while not self._begin(h):
            victims = [v for v in self._holders(active) if v is not h]
            if not victims:
                raise InferenceError(f"cache.num_pages={self.cache.cfg.num_pages} cannot hold a "
                                     f"{len(h.tokens)}-token prefill; raise cache.num_pages")
            self._preempt(victims[0])
        return True

    def _admit_now(self, s: SeqHandle, lookup: bool = True) -> None:
        """Admit a one-shot sequence (score / next_logits), preempting live sequences if needed."""
        while not self._begin(s, lookup=lookup):
            victims = self._holders([])
            if not victims:
                raise InferenceError(f"cache.num_pages={self.cache.cfg.num_pages} cannot hold a "
                                     f"{len(s.prompt)}-token sequence; raise cache.num_pages")
            self._preempt(victims[0])

    def _make_room(self, decoding: List[SeqHandle], active: List[SeqHandle]) -> List[SeqHandle]:
        """Pages for every decoding sequence's next token, preempting the newest holders when the pool
        runs out; returns the sequences that stay in this decode step."""
        batch = list(decoding)
        for h in list(decoding):
            if h not in batch:
                continue   # preempted for an older sequence
            while self.cache.shortfall(h.id, h.fed + 1) > 0:
                victims = self._holders(active)   # an older sequence is never preempted for a newer one
                if victims == [h] and self.cache.drop_checkpoints(h.id):
                    continue
                if victims == [h]:
                    raise InferenceError(f"cache.num_pages={self.cache.cfg.num_pages} is too small for one "
                                         f"sequence of {h.fed + 1} tokens and its checkpoints; raise it")
                v = victims[0]
                self._preempt(v)
                if v in batch:
                    batch.remove(v)
                if v is h:
                    break
            if h in batch:   # take the page now: the next sequence's check sees it gone
                self.runner.execute(self.cache.grow(h.id, h.fed + 1))
        return batch

    def _begin(self, s: SeqHandle, lookup: bool = True, headroom: int = 0) -> bool:
        """Pages, prefix-cache restore and prompt embeddings for ``s``; False when it does not fit now."""
        salt = prompt_salt(s)
        pre = len(s.tokens)
        grow = 1 if self.preempt else max(1, s.max_new - len(s.out))   # pages for the first token / all
        hit = self.cache.begin(s.id, s.tokens[:pre], grow, salt, lookup=lookup, headroom=headroom)
        if hit is None:
            return False
        self.runner.execute(hit.actions)
        s.state = self.runner.load_state(hit.ckpt_pages) if hit.tokens else self.runner.new_state()
        s.past = COLD if not hit.tokens else self._hit_pasts.setdefault(
            self.cache.seqs[s.id].hashes[hit.tokens // self.cache.cfg.page_size - 1], object())
        s.shared = []
        s.pre = pre
        s.fed = hit.tokens
        if not s.preemptions:
            s.hit_tokens = hit.tokens
        s.x0 = self.runner.embed(s.tokens[:pre], s.images)
        return True

    def _prefill_chunk(self, s: SeqHandle, all_logits: bool = False) -> torch.Tensor:
        start, n = s.fed, s.pre
        end = min(start + self.prefill_chunk, n)
        bounds = [b for b in self.cache.prefix_boundaries(s.id, start, n) if b < end]
        end = bounds[0] if bounds else end
        self.runner.execute(self.cache.grow(s.id, end))
        table = self.cache.seqs[s.id].table
        if s.shared:   # a twin computed this chunk: take its result (what this forward would give)
            c = s.shared.pop(0)
            assert (c.start, c.end) == (start, end) and not all_logits
            self.runner.write_latents(table, start, c.latents)
            s.state, logits, s.past = self.runner.copy_state(c.state), c.logits[None], c.past
            self.prefill_shared += end - start
        else:
            logits = self.runner.forward(s.x0[:, start:end], [s.state], [start], [table], all_logits)
            self.prefill_computed += end - start
            s.past = object()   # its past now includes this chunk: equal only to its twins'
        s.fed = end
        self._after_forward(s)
        return logits[0]

    def _twins(self, h: SeqHandle, others: List[SeqHandle]) -> List[SeqHandle]:
        """The prefilling sequences whose next chunk computes what ``h``'s next chunk does: an equal
        computed past (``past``), position, prompt and embeddings. A sequence holding a chunk already is
        left out, so each holds at most one (memory: one chunk's latents and one KDA state per prompt;
        a prompt longer than a chunk shares its first chunk, then each sample computes the rest)."""
        return [t for t in others if not t.shared and t.past is h.past and t.fed == h.fed and t.pre == h.pre
                and t.tokens[:t.pre] == h.tokens[:h.pre] and torch.equal(t.x0, h.x0)]

    def _decode(self, seqs: List[SeqHandle]) -> torch.Tensor:
        for s in seqs:
            self.runner.execute(self.cache.grow(s.id, s.fed + 1))
        ids = torch.as_tensor([[s.tokens[s.fed]] for s in seqs], device=self.runner.device)
        x0 = self.model.embed(ids)
        logits = self.runner.forward(x0, [s.state for s in seqs], [s.fed for s in seqs],
                                     [self.cache.seqs[s.id].table for s in seqs])
        for s in seqs:
            s.fed += 1
            self._after_forward(s)
        return logits

    def _after_forward(self, s: SeqHandle) -> None:
        self.cache.commit(s.id, s.tokens, s.fed)
        if self.cache.wants_checkpoint(s.id, s.fed, len(s.prompt) + s.max_new):
            pages, actions = self.cache.checkpoint_pages(s.id, s.fed)
            self.runner.execute(actions)
            self.runner.save_state(s.state, pages)

    def _emit(self, s: SeqHandle, logits_V: torch.Tensor):
        k = s.params.top_logprobs
        tok, lp, *top = sample(logits_V, s.params, s.gen, k)
        if k:
            s.top_logprobs.append(top[0])
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
        if s.finish is not None:   # pages freed (its blocks stay cached) before anyone sees the token
            self.cache.finish(s.id)
            s.state = s.x0 = None
            self._live.pop(s.id, None)
        yield s, tok, lp
