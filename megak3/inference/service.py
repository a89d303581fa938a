"""OpenAI requests -> engine requests -> OpenAI responses, for the HTTP server (no HTTP here).

Prompts: ``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists
(completions; an empty string is the single token eos, as in the CLI); ``messages`` are rendered with megak3's chat template, the one SFT trains on
(megak3/data/chat.py: ``<|bos|>role\\n content <|eos|>`` per message, then the open
``<|bos|>assistant\\n`` header). A message's content is a string or a list of parts: ``text`` parts
are joined with newlines, ``image_url`` parts (megak3/inference/media.py) become the message's
images, whose ``<|media|>`` slots the template puts after the role header and before the text.

Sampling: ``max_tokens`` (chat also ``max_completion_tokens``) default 16, ``temperature`` default
1.0 (as OpenAI; 0 = greedy), ``top_p``, ``top_k`` (0 = off), ``ignore_eos``, ``stop``. Choice
``k`` of a request (prompt ``k // n``, copy ``k % n``) samples with ``seed + k`` when ``seed`` is
given. ``logprobs``: each generated token's log probability under the distribution it was sampled
from (temperature and top-k / top-p applied; greedy: the model's own), with the ``top_logprobs`` /
completions ``logprobs`` = k most likely alternatives of that same distribution (the engine's, at
sampling time; tokens truncation removed are not listed); streams carry them too. A prompt of
``max_model_len`` tokens or more is refused; a shorter one generates at most up to the context.

Scoring: completions with ``echo: true`` and ``max_tokens: 0`` (:meth:`OpenAIService.echo`) answer each
prompt's text and, with ``logprobs: 0``, the logprob of each of its tokens after the first under
``softmax(logits / temperature)`` (0: the untempered logits), from one forward of the engine's model as the
trainer runs it (megak3/inference/scoring.py); a prompt may then hold ``max_model_len + 1`` tokens. This is
how an RL run reads a served MOPD teacher (megak3/posttrain/teacher_client.py), the tokenizer and
vocabulary of which it checks through ``GET /v1/models`` (``vocab_size``, ``tokenizer_sha256``,
``special_ids``: extensions of the model card).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, List, Optional

from .api_models import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                         ChatCompletionResponse, ChatLogprobs, CompletionChoice, CompletionLogprobs,
                         CompletionRequest, CompletionResponse, Delta, ModelCard, ModelList, TokenLogprob,
                         TopLogprob, Usage)
from .engine_client import EngineClient, Request
from .types import InferenceError, SamplingParams

DEFAULT_MAX_TOKENS = 16


async def _chain(head, rest):
    """``head`` (unless None) then the items of ``rest``."""
    if head is not None:
        yield head
        async for x in rest:
            yield x


class RequestError(ValueError):
    """A bad request: HTTP ``status`` with a one-line message naming ``param``."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code: Optional[str] = None):
        super().__init__(" ".join(str(message).split()))
        self.param, self.status, self.code = param, status, code


class TextStream:
    """Generated tokens -> text pieces safe to show: a piece is released only when no stop string can
    still begin in it and it does not end inside a multi-byte character; a stop string ends the text
    before it; eos / a stop token is not shown. ``finish`` is set once the text has ended."""

    def __init__(self, tokenizer, sp: SamplingParams):
        self.tok, self.sp = tokenizer, sp
        self.stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {tokenizer.eos_id})
        self.hold = max((len(s) for s in sp.stop), default=1) - 1
        self.ids: List[int] = []
        self.sent = 0
        self.finish: Optional[str] = None

    def push(self, t: int) -> str:
        if self.finish is not None:
            return ""
        if t in self.stops:
            return self.close("stop")
        self.ids.append(t)
        text = self.tok.decode(self.ids)
        cut = min((text.find(s) for s in self.sp.stop if s in text), default=-1)
        if cut >= 0:
            piece = text[self.sent:cut] if cut > self.sent else ""
            self.sent, self.finish = cut, "stop"
            return piece
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe > self.sent:
            piece, self.sent = text[self.sent:safe], safe
            return piece
        return ""

    def close(self, finish: str = "length") -> str:
        """The rest of the text (the stream ended with ``finish`` unless a stop was already seen)."""
        if self.finish is not None:
            return ""
        self.finish = finish
        text = self.tok.decode(self.ids)
        cut = min((text.find(s) for s in self.sp.stop if s in text), default=-1)
        if cut >= 0:
            text, self.finish = text[:cut], "stop"
        piece = text[self.sent:] if len(text) > self.sent else ""
        self.sent = max(self.sent, len(text))
        return piece


class OpenAIService:
    """The endpoints' logic over one :class:`EngineClient`; ``allowed_media_dir`` enables file:// images
    under that directory; ``metrics`` a :class:`megak3.inference.metrics.ServerMetrics` or None."""

    def __init__(self, client: EngineClient, model_name: str, allowed_media_dir: Optional[str] = None,
                 metrics=None):
        self.client, self.model_name = client, model_name
        self.allowed_media_dir, self.metrics = allowed_media_dir, metrics
        self.tok = client.tokenizer
        self.created = int(time.time())

    # ------------------------------------------------------------------------------------ requests
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created,
                                         max_model_len=self.client.max_context,
                                         vocab_size=int(self.client.model_config.vocab_size),
                                         tokenizer_sha256=self.tok.sha256(), special_ids=self.tok.special_ids())])

    def _check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise RequestError(f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                               "model", status=404, code="model_not_found")

    def _check_ids(self, ids: List[int], what: str, param: str) -> None:
        vocab = self.tok.vocab_size
        if any(t >= vocab for t in ids):
            raise RequestError(f"{what}: token ids must lie in [0, {vocab})", param)
        if len(ids) >= self.client.max_context:
            raise RequestError(f"{what} has {len(ids)} tokens; the model's context is {self.client.max_context} "
                               "tokens (max_model_len): shorten it", param)

    def _params(self, req, n_prompts: int, max_tokens: Optional[int]) -> List[SamplingParams]:
        n = req.n or 1
        base = SamplingParams(
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p), top_k=req.top_k or 0,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()), ignore_eos=bool(req.ignore_eos))
        out = []
        for k in range(n_prompts * n):
            sp = replace(base, seed=None if req.seed is None else (req.seed + k) % 2 ** 63)
            try:
                sp.validate()
            except ValueError as e:
                raise RequestError(str(e).replace("sampling.", "", 1), str(e).split("=", 1)[0][9:]) from None
            out.append(sp)
        return out

    def completion_requests(self, req: CompletionRequest) -> List[Request]:
        self._check_model(req)
        ids = self._prompt_ids(req)
        for i, x in enumerate(ids):
            self._check_ids(x, f"prompt {i}", "prompt")
        n = req.n or 1
        params = self._params(req, len(ids), req.max_tokens)
        return [Request(ids[k // n], sp, None, req.logprobs or 0) for k, sp in enumerate(params)]

    def _encode(self, text: str) -> List[int]:
        return self.tok.encode(text) or [self.tok.eos_id]

    def chat_requests(self, req: ChatCompletionRequest) -> List[Request]:
        from megak3.data.chat import ChatFormatError, generation_prompt

        from .media import image_slots, image_tensor, read_image_url

        self._check_model(req)
        msgs, images, slots = [], [], []
        cfg = self.client.model_config
        for i, m in enumerate(req.messages):
            if isinstance(m.content, str):
                text, k = m.content, 0
            else:
                text = "\n".join(part.text for part in m.content if part.type == "text")
                k = 0
                for j, part in enumerate(m.content):
                    if part.type != "image_url":
                        continue
                    where = f"messages[{i}].content[{j}]"
                    try:
                        raw, name = read_image_url(part.image_url.url, self.allowed_media_dir)
                        im = image_tensor(raw, cfg, f"{where} ({name})")
                    except InferenceError as e:
                        raise RequestError(f"{where}.{e}" if str(e).startswith("image_url") else str(e),
                                           f"{where}.image_url") from None
                    images.append(im.to(self.client.device))
                    slots.append(image_slots(im, cfg))
                    k += 1
            msgs.append({"role": m.role, "content": text, **({"images": ["<image>"] * k} if k else {})})
        try:
            ids = generation_prompt(self.tok, msgs, slots)
        except ChatFormatError as e:
            raise RequestError(str(e), "messages") from None
        self._check_ids(ids, "the rendered conversation", "messages")
        n = req.n or 1
        params = self._params(req, 1, req.max_completion_tokens or req.max_tokens)
        return [Request(ids, sp, images or None, (req.top_logprobs or 0) if req.logprobs else 0)
                for sp in params[:n]]

    # ----------------------------------------------------------------------------------- responses
    def _piece(self, t: int) -> str:
        return self.tok.decode([t])

    def _completion_logprobs(self, toks: List[int], lps: List[float], tops: List[list], want_top: bool,
                             offset: int = 0) -> CompletionLogprobs:
        texts = [self._piece(t) for t in toks]
        offs = []
        for s in texts:
            offs.append(offset)
            offset += len(s)
        top = None
        if want_top:   # OpenAI's shape is a dict by token text: of alternatives that decode alike, the likeliest
            top = [{} for _ in tops]
            for d, row in zip(top, tops):
                for i, lp in row:
                    d.setdefault(self._piece(i), lp)
        return CompletionLogprobs(tokens=texts, token_logprobs=list(lps), top_logprobs=top, text_offset=offs)

    def _chat_logprobs(self, toks: List[int], lps: List[float], tops: List[list]) -> ChatLogprobs:
        def entry(t, lp):
            s = self._piece(t)
            return dict(token=s, logprob=lp, bytes=list(s.encode()))

        return ChatLogprobs(content=[TokenLogprob(**entry(t, lp), top_logprobs=[TopLogprob(**entry(i, v)) for i, v in
                                                                              (tops[k] if tops else [])])
                                     for k, (t, lp) in enumerate(zip(toks, lps))])

    def _usage(self, reqs: List[Request], generated: int) -> Usage:
        seen, p = set(), 0
        for r in reqs:   # n copies of a prompt count it once
            if id(r.prompt) not in seen:
                seen.add(id(r.prompt))
                p += len(r.prompt)
        if self.metrics:
            self.metrics.prompt_tokens.inc(p)
        return Usage(prompt_tokens=p, completion_tokens=generated, total_tokens=p + generated)

    async def _generate(self, reqs, disconnected):
        try:
            return await self.client.generate(reqs, disconnected)
        except InferenceError as e:
            raise RequestError(str(e)) from None

    def _prompt_ids(self, req: CompletionRequest) -> List[List[int]]:
        p = req.prompt
        if isinstance(p, str):
            return [self._encode(p)]
        if isinstance(p[0], str):
            return [self._encode(t) for t in p]
        if isinstance(p[0], int):
            return [list(p)]
        return [list(x) for x in p]

    async def echo(self, req: CompletionRequest) -> CompletionResponse:
        """``echo`` with ``max_tokens: 0``: each prompt's text and, with ``logprobs: 0``, its tokens'
        logprobs (the first null) from one forward of the engine's model (megak3/inference/scoring.py)."""
        from .scoring import check_scoring

        self._check_model(req)
        ids = self._prompt_ids(req)
        try:
            check_scoring(ids, int(self.client.model_config.vocab_size), self.client.max_context)
        except InferenceError as e:
            raise RequestError(str(e), "prompt") from None
        lps = await self.client.score(ids, 1.0 if req.temperature is None else float(req.temperature))
        choices = []
        for k, (x, lp) in enumerate(zip(ids, lps)):
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(x, [None] + list(lp), [[]] * len(x), True)
                logprobs.top_logprobs[0] = None
            choices.append(CompletionChoice(index=k, text=self.tok.decode(x), finish_reason="length",
                                            logprobs=logprobs))
        n = sum(len(x) for x in ids)
        if self.metrics:
            self.metrics.prompt_tokens.inc(n)
        return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
                                  choices=choices, usage=Usage(prompt_tokens=n, completion_tokens=0, total_tokens=n))

    async def completions(self, req: CompletionRequest, disconnected=None) -> CompletionResponse:
        if req.echo:
            return await self.echo(req)
        reqs = self.completion_requests(req)
        res = await self._generate(reqs, disconnected)
        choices = [CompletionChoice(
            index=k, text=r.completion.text, finish_reason=r.completion.finish_reason,
            logprobs=None if req.logprobs is None else self._completion_logprobs(
                r.completion.token_ids, r.completion.logprobs, r.top, True))
            for k, r in enumerate(res)]
        return CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
                                  choices=choices, usage=self._usage(reqs, sum(len(r.completion.token_ids)
                                                                               for r in res)))

    async def chat(self, req: ChatCompletionRequest, disconnected=None) -> ChatCompletionResponse:
        reqs = self.chat_requests(req)
        res = await self._generate(reqs, disconnected)
        choices = [ChatChoice(index=k, message=AssistantMessage(content=r.completion.text),
                              finish_reason=r.completion.finish_reason,
                              logprobs=self._chat_logprobs(r.completion.token_ids, r.completion.logprobs, r.top)
                              if req.logprobs else None)
                   for k, r in enumerate(res)]
        return ChatCompletionResponse(id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()),
                                      model=self.model_name, choices=choices,
                                      usage=self._usage(reqs, sum(len(r.completion.token_ids) for r in res)))

    async def stream(self, req, reqs: List[Request], chat: bool) -> AsyncIterator[dict]:
        """The SSE chunks (as dicts) of a streamed request whose ``reqs`` were built (validated) already:
        every choice is sent to the engine at once (they decode in the same batches), then each
        choice's events in turn: pieces of text as the engine produces them, each with the log
        probabilities of the tokens it completes when asked; a final usage chunk with
        ``stream_options.include_usage``. Nothing is yielded before every choice has its first token,
        so an engine refusal raises :class:`RequestError` before the first event (the server then
        answers a 400 JSON error instead of starting the event stream)."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        generated = 0
        want_lp = bool(req.logprobs) if chat else req.logprobs is not None

        def chunk(k, text, finish, toks=(), lps=(), tops=(), first=False):
            lp = None
            if want_lp and (toks or finish):
                lp = (self._chat_logprobs(list(toks), list(lps), list(tops)) if chat
                      else self._completion_logprobs(list(toks), list(lps), list(tops), True))
            if chat:
                delta = Delta(role="assistant") if first else Delta(content=text if text or finish is None else None)
                out = ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[
                    ChatChunkChoice(index=k, delta=delta, finish_reason=finish, logprobs=lp)]).model_dump()
                out["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
                return out
            return CompletionResponse(id=rid, created=created, model=self.model_name, choices=[
                CompletionChoice(index=k, text=text, finish_reason=finish, logprobs=lp)]).model_dump()

        streams = self.client.streams(reqs)   # every choice joins the batch now (a prompt's n choices together)
        try:
            heads = []
            for s in streams:   # an engine refusal surfaces here, before the first event (and headers)
                try:
                    heads.append(await s.__anext__())
                except StopAsyncIteration:
                    heads.append(None)
                except InferenceError as e:
                    raise RequestError(str(e)) from None
            for k, (r, s) in enumerate(zip(reqs, streams)):
                ts = TextStream(self.tok, r.params)
                if chat:
                    yield chunk(k, "", None, first=True)
                toks, lps, tops = [], [], []
                async for t, lp, top in _chain(heads[k], s):
                    generated += 1
                    toks.append(t)
                    lps.append(lp)
                    tops.append(top)
                    piece = ts.push(t)
                    if piece:
                        yield chunk(k, piece, None, toks, lps, tops)
                        toks, lps, tops = [], [], []
                    if ts.finish is not None:
                        break
                await s.aclose()
                piece = ts.close("length")
                yield chunk(k, piece, ts.finish, toks, lps, tops)
        finally:
            for s in streams:
                await s.aclose()
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = self._usage(reqs, generated).model_dump()
            obj = "chat.completion.chunk" if chat else "text_completion"
            yield {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [],
                   "usage": usage}
        elif self.metrics:
            self._usage(reqs, generated)

