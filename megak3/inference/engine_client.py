"""The server's one door to the engine: a thread that owns :class:`megak3.inference.Engine` and runs
the sequences of every concurrent HTTP client in one continuous batch (the asyncio side awaits; the
engine's CPU work never runs on the event loop).

Every engine call the server makes is in :class:`EngineClient`, on the engine's sequence API
(``begin`` / ``step`` / ``abort`` / ``completion``). The engine thread loops:

1. take every queued job (a non-streamed request's prompts and choices, or one streamed choice; the
   streamed choices of one :meth:`EngineClient.streams` call are queued as one item) and
   ``begin`` each of its sequences; a refusal (``InferenceError``: a bad value, a request that
   cannot fit the pool even alone) fails that job alone; a call job (:meth:`EngineClient.call`, e.g.
   :meth:`EngineClient.score`, the server's ``echo`` prompt scoring) runs there and then, between two steps;
2. ``abort`` the sequences of every job whose client went away (streamed or not: the engine frees
   their pages at once);
3. ``step`` every live sequence of every job: streamed and non-streamed sequences share each
   prefill / decode batch, and the engine admits waiting ones as pages allow (the ``n`` choices of a
   long prompt prefill it once: the engine holds the later ones until the first has filled the prefix
   cache, megak3/inference/prompt_holds.py);
4. hand each (token, logprob, top) to its job's asyncio queue (``loop.call_soon_threadsafe``); a
   non-streamed job gets its :class:`Result` list once all its sequences have finished.

Per-token top-k alternatives come from the engine's own sampling distribution
(``SamplingParams.top_logprobs``: the distribution the token's logprob is of), no extra forward.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

import torch

from .types import Completion


class ClientDisconnected(Exception):
    """The client went away while its request waited (the server answers nobody)."""


@dataclass
class Request:
    """One prompt of a request, ready for the engine."""
    prompt: List[int]
    params: Any                       # SamplingParams
    images: Optional[list] = None     # image tensors for the prompt's media slots
    top_logprobs: int = 0             # top-k alternatives per generated token (0 = none)


@dataclass
class Result:
    completion: Completion
    top: List[List[Tuple[int, float]]] = field(default_factory=list)   # per token: [(id, logprob)] best first


@dataclass(eq=False)
class _Job:
    stream: bool
    reqs: List[Request]
    loop: asyncio.AbstractEventLoop
    out: Any                          # asyncio.Future (generate) | asyncio.Queue (stream)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    handles: list = field(default_factory=list)   # SeqHandle per request, once begun (engine thread)
    started: set = field(default_factory=set)     # ids of handles counted as running (engine thread)
    fn: Any = None                    # a call job: fn(engine) run on the engine thread between two steps


class TokenStream:
    """``async for (token, logprob, top) in stream``; the job is queued when the stream is made.
    ``aclose()`` (or dropping the stream) aborts its sequence, which frees its pages."""

    def __init__(self, job: _Job):
        self.job, self.done = job, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        item = await self.job.out.get()
        if item is None or isinstance(item, BaseException):
            self.done = True
            self.job.cancel.set()
            if item is None:
                raise StopAsyncIteration
            raise item
        return item

    async def aclose(self) -> None:
        self.done = True
        self.job.cancel.set()

    def __del__(self):
        self.job.cancel.set()


class EngineClient:
    """``await generate(reqs)`` -> [Result]; ``async for item in stream(req)`` -> (token, logprob, top)
    tuples. ``metrics`` (megak3/inference/metrics.py, or anything with its ``running`` / ``waiting``
    inc/dec, ``ttft.observe`` and ``finished``) is told about queueing, running, tokens and
    first-token times."""

    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.q: "queue.Queue[Any]" = queue.Queue()   # a _Job, a list of them (streams), None: stop
        self._jobs: List[_Job] = []                # begun, unfinished (engine thread only)
        self.steps = 0                             # engine.step calls made (engine thread)
        self.aborted = 0                           # sequences taken out unfinished (engine thread)
        self._snapshot(ended=True)                 # written by the engine thread only, read by /metrics
        self.thread = threading.Thread(target=self._loop, name="megak3-engine", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=60)

    # ------------------------------------------------------------------------------- asyncio side
    def _submit(self, stream: bool, reqs: List[Request], out) -> _Job:
        job = _Job(stream, reqs, asyncio.get_running_loop(), out)
        if self.metrics:
            self.metrics.waiting.inc(len(reqs))
        self.q.put(job)
        return job

    async def generate(self, reqs: List[Request], disconnected=None) -> List[Result]:
        """Results of ``reqs`` (their sequences join the running batch). ``disconnected``: an async
        callable polled every 0.25 s while waiting; when it answers True the job's sequences are
        aborted (or, not begun yet, dropped) and :class:`ClientDisconnected` is raised."""
        fut = asyncio.get_running_loop().create_future()
        job = self._submit(False, reqs, fut)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=0.25)
                if done:
                    return fut.result()
                if disconnected is not None and await disconnected():
                    raise ClientDisconnected()
        finally:
            job.cancel.set()

    async def call(self, fn):
        """``fn(engine)``'s result (or exception), run on the engine thread between two steps."""
        fut = asyncio.get_running_loop().create_future()
        self.q.put(_Job(False, [], asyncio.get_running_loop(), fut, fn=fn))
        return await fut

    async def score(self, seqs: List[List[int]], temperature: float) -> List[List[float]]:
        """Token logprobs of each sequence (megak3/inference/scoring.py: one training-style forward of the
        engine's model, on the engine thread)."""
        from .scoring import prompt_logprobs

        pad = self.engine.tokenizer.pad_id
        return await self.call(lambda e: prompt_logprobs(e.model, seqs, temperature, pad))

    def stream(self, req: Request) -> AsyncIterator[Tuple[int, float, list]]:
        """(token, logprob, top) per generated token as the engine makes it (a :class:`TokenStream`,
        queued at once); an engine refusal is raised by the first ``__anext__``, before any token;
        closing the stream early aborts the sequence."""
        return self.streams([req])[0]

    def streams(self, reqs: List[Request]) -> List[TokenStream]:
        """One :class:`TokenStream` per request (e.g. the ``n`` choices of a streamed request), queued
        as one item: the engine thread begins them all in the same round, before its next step, so
        they prefill and decode in the same batches. Each is closed (aborted) on its own."""
        loop = asyncio.get_running_loop()
        jobs = [_Job(True, [r], loop, asyncio.Queue()) for r in reqs]
        if self.metrics and jobs:
            self.metrics.waiting.inc(len(jobs))
        self.q.put(jobs)
        return [TokenStream(j) for j in jobs]

    # -------------------------------------------------------------------------------- engine side
    def _loop(self) -> None:
        while True:
            incoming = [] if self._jobs else [self.q.get()]   # idle: sleep until a job comes
            while None not in incoming:
                try:
                    incoming.append(self.q.get_nowait())
                except queue.Empty:
                    break
            if None in incoming:
                for j in list(self._jobs):
                    self._fail(j, RuntimeError("the server is shutting down"))
                return
            incoming = [j for x in incoming for j in (x if isinstance(x, list) else [x])]   # streams() puts a list
            try:
                for j in incoming:
                    self._begin(j)
                for j in [j for j in self._jobs if j.cancel.is_set()]:
                    self._end(j, abort=True)
                if self._jobs:
                    self._step()
            except Exception as e:  # noqa: BLE001 - a fault fails the running jobs; the thread goes on
                for j in list(self._jobs):
                    self._fail(j, e)

    def _begin(self, job: _Job) -> None:
        if job.fn is not None:   # a call: answered now, never part of the batch
            try:
                value = job.fn(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller's error
                value = e
            self._deliver(job, [value])
            return
        if job.cancel.is_set():   # the client went away before it started: never reaches the engine
            if self.metrics:
                self.metrics.waiting.dec(len(job.reqs))
            return
        try:
            for r in job.reqs:
                sp = replace(r.params, top_logprobs=r.top_logprobs) if r.top_logprobs else r.params
                job.handles.append(self.engine.begin(r.prompt, sp, r.images))
        except Exception as e:  # noqa: BLE001 - a refusal (or fault) of this job alone
            self._jobs.append(job)
            self._fail(job, e)
            return
        self._jobs.append(job)

    def _step(self) -> None:
        live = [h for j in self._jobs for h in j.handles if not h.finished and not h.paused]
        t0 = time.perf_counter()
        try:
            out = self.engine.step(live)
        except Exception as e:  # noqa: BLE001 - the step's sequences fail; the server goes on
            for j in list(self._jobs):
                self._fail(j, e)
            return
        finally:
            self.steps += 1
            self._snapshot()
        now = time.perf_counter()
        owner = {h.id: j for j in self._jobs for h in j.handles}
        per_job: Dict[int, list] = {}
        for h, tok, lp in out:
            j = owner[h.id]
            self._running(j, h, now)
            if j.stream:
                per_job.setdefault(id(j), [j, []])[1].append(
                    (tok, lp, list(h.top_logprobs[-1]) if h.params.top_logprobs else []))
        for j in list(self._jobs):   # admitted without a token yet: running too
            for h in j.handles:
                if h.admitted:
                    self._running(j, h, None)
        if out and self.metrics:
            self.metrics.finished(len(out), 0, now - t0)
        for j, items in per_job.values():
            self._deliver(j, items)
        for j in list(self._jobs):
            if all(h.finished for h in j.handles):
                self._end(j)

    def _running(self, job: _Job, h, first_token_at: Optional[float]) -> None:
        if h.id not in job.started:
            job.started.add(h.id)
            if self.metrics:
                self.metrics.waiting.dec()
                self.metrics.running.inc()
        if first_token_at is not None and len(h.token_ids) == 1 and self.metrics:
            self.metrics.ttft.observe(first_token_at - job.arrived)

    def _end(self, job: _Job, abort: bool = False) -> None:
        """Take ``job`` out of the batch: aborted (its client went away) or delivered."""
        self._jobs.remove(job)
        for h in job.handles:
            if abort:
                self.aborted += h.finish is None
                self.engine.abort(h)
            else:
                self.engine.release(h)
        self._snapshot(ended=True)   # before the counts below: a replica worker reports both when they change
        if self.metrics:
            began = len(job.started)
            self.metrics.running.dec(began)
            self.metrics.waiting.dec(len(job.reqs) - began)
        if abort:
            return
        if job.stream:
            self._deliver(job, [None])
        else:
            self._deliver(job, [[Result(c, c.top_logprobs or []) for c in map(self.engine.completion, job.handles)]])

    def _fail(self, job: _Job, err: BaseException) -> None:
        try:
            self._end(job, abort=True)
        except Exception:  # noqa: BLE001 - the engine may be broken; the job is failed either way
            if job in self._jobs:
                self._jobs.remove(job)
        self._deliver(job, [err])

    @staticmethod
    def _deliver(job: _Job, values: list) -> None:
        """Hand ``values`` to the job's coroutine (stream: each item in order; generate: the one result)."""
        def put():
            if isinstance(job.out, asyncio.Queue):
                for v in values:
                    job.out.put_nowait(v)
            elif not job.out.done():
                v = values[0]
                (job.out.set_exception if isinstance(v, BaseException) else job.out.set_result)(v)
        try:
            job.loop.call_soon_threadsafe(put)
        except RuntimeError:   # the client's event loop is closed: nobody is waiting
            pass

    def cache_stats(self) -> Dict[str, float]:
        """The engine's cache counters (``Engine.cache_stats``) as the engine thread last saw them:
        after every engine step and every job's end (the engine is never touched from the HTTP side),
        plus ``live_sequences`` (begun, unfinished, unreleased), ``aborted_sequences`` (taken out
        unfinished since start: disconnects and failures) and ``pages_available`` (pages a new sequence
        can still get: free + evictable cached - reserved; the whole pool when nothing runs), the last
        as of the last job's end (counting the evictable pages walks the cache's LRU: not every step)."""
        return self._stats

    def _snapshot(self, ended: bool = False) -> None:
        avail = self.engine.cache.available() if ended else self._stats["pages_available"]
        self._stats = {**self.engine.cache_stats(), "live_sequences": len(self.engine.live()),
                       "pages_available": avail, "aborted_sequences": self.aborted}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    @property
    def model_config(self):
        return self.engine.model.config

    @property
    def device(self) -> torch.device:
        return next(self.engine.model.parameters()).device

    @property
    def num_pages(self) -> int:
        return self.engine.cache.cfg.num_pages

    num_replicas = 1

    def alive(self) -> bool:
        return self.thread.is_alive()

    def replicas_up(self) -> int:
        return int(self.alive())
