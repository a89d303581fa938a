"""The server's one door to the engine: a thread that owns :class:`megak3.inference.Engine` and batches
the requests of concurrent HTTP clients (the asyncio side awaits; the engine's CPU work never runs
on the event loop).

Every engine call the server makes is in :class:`EngineClient`, built on the engine's public
``generate`` / ``stream`` / ``next_logits``. Each round the thread takes every queued job: all
non-streamed jobs go into ONE ``Engine.generate`` call (continuous batching inside the engine:
requests that arrived while the previous call ran are served together), then each streamed job
runs ``Engine.stream`` one sequence at a time (today's engine streams one prompt per call). What
this adapter would take from a handle-based engine API (begin/step/abort per sequence):

- abort: a disconnected client's queued job is dropped and its stream is closed (which frees its
  pages), but a sequence inside a running ``generate`` call runs to its end;
- streamed sequences that join the batch (today a stream runs alone and delays queued jobs);
- per-token top-k log-probabilities: computed here by ``Engine.next_logits`` over every prefix of
  the output (one prefill per token, O(len^2)); the engine's own logits at each step would be free.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
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


@dataclass
class _Job:
    kind: str                         # "generate" | "stream"
    reqs: List[Request]
    loop: asyncio.AbstractEventLoop
    out: Any                          # asyncio.Future (generate) | asyncio.Queue (stream)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)


class EngineClient:
    """``await generate(reqs)`` -> [Result]; ``async for item in stream(req)`` -> (token, logprob, top)
    tuples. ``metrics`` (megak3/inference/metrics.py) is told about
    queueing, running, tokens and first-token times."""

    def __init__(self, engine, metrics=None):
        self.engine, self.metrics = engine, metrics
        self.q: "queue.Queue[Optional[_Job]]" = queue.Queue()
        self._stats = dict(engine.cache_stats())   # written by the engine thread only, read by /metrics
        self.thread = threading.Thread(target=self._loop, name="megak3-engine", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=60)

    # ------------------------------------------------------------------------------- asyncio side
    def _submit(self, kind: str, reqs: List[Request], out) -> _Job:
        job = _Job(kind, reqs, asyncio.get_running_loop(), out)
        if self.metrics:
            self.metrics.waiting.inc(len(reqs))
        self.q.put(job)
        return job

    async def generate(self, reqs: List[Request], disconnected=None) -> List[Result]:
        """Results of ``reqs`` (one engine call with whatever else is queued). ``disconnected``: an
        async callable polled while waiting; when it answers True the job is cancelled (dropped if
        it has not started) and :class:`ClientDisconnected` is raised."""
        fut = asyncio.get_running_loop().create_future()
        job = self._submit("generate", reqs, fut)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=0.25)
                if done:
                    return fut.result()
                if disconnected is not None and await disconnected():
                    raise ClientDisconnected()
        finally:
            job.cancel.set()

    async def stream(self, req: Request) -> AsyncIterator[Tuple[int, float, list]]:
        """(token, logprob, top) per generated token as the engine makes it; closing the iterator
        early (a client that went away) stops the engine's sequence and frees its pages."""
        aq: asyncio.Queue = asyncio.Queue()
        job = self._submit("stream", [req], aq)
        try:
            while True:
                item = await aq.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            job.cancel.set()

    # -------------------------------------------------------------------------------- engine side
    def _loop(self) -> None:
        while True:
            first = self.q.get()
            if first is None:
                return
            jobs = [first]
            while True:
                try:
                    j = self.q.get_nowait()
                except queue.Empty:
                    break
                if j is None:
                    self.q.put(None)
                    break
                jobs.append(j)
            gen = [j for j in jobs if j.kind == "generate" and not self._dropped(j)]
            if gen:
                self._started(gen)
                self._run_generate(gen)
            for j in jobs:
                if j.kind == "stream" and not self._dropped(j):
                    self._started([j])
                    self._run_stream(j)

    def _dropped(self, job: _Job) -> bool:
        """A job whose client went away before it started: counted out of the queue, never run."""
        if job.cancel.is_set() and self.metrics:
            self.metrics.waiting.dec(len(job.reqs))
        return job.cancel.is_set()

    def _started(self, jobs: List[_Job]) -> None:
        if self.metrics:
            self.metrics.waiting.dec(sum(len(j.reqs) for j in jobs))

    @staticmethod
    def _deliver(job: _Job, value) -> None:
        def put():
            if isinstance(job.out, asyncio.Queue):
                job.out.put_nowait(value)
            elif not job.out.done():
                (job.out.set_exception if isinstance(value, BaseException) else job.out.set_result)(value)
        try:
            job.loop.call_soon_threadsafe(put)
        except RuntimeError:   # the client's event loop is closed: nobody is waiting
            pass

    def _run_generate(self, jobs: List[_Job]) -> None:
        reqs = [r for j in jobs for r in j.reqs]
        images = [r.images for r in reqs]
        t0 = time.perf_counter()
        if self.metrics:
            self.metrics.running.inc(len(reqs))
        try:
            res = self.engine.generate([r.prompt for r in reqs], [r.params for r in reqs],
                                       **({"images": images} if any(im is not None for im in images) else {}))
            res = [Result(c, self._top(r, c)) for r, c in zip(reqs, res)]
        except Exception as e:  # noqa: BLE001 - one job's failure must not fail its batch mates
            res = None
            err = e
        finally:
            self._snapshot()
            if self.metrics:
                self.metrics.running.dec(len(reqs))
        if res is None:
            if len(jobs) > 1:
                for j in jobs:
                    self._run_generate([j])
            else:
                self._deliver(jobs[0], err)
            return
        if self.metrics:
            self.metrics.finished(sum(len(r.completion.token_ids) for r in res), len(res), time.perf_counter() - t0)
        k = 0
        for j in jobs:
            self._deliver(j, res[k:k + len(j.reqs)])
            k += len(j.reqs)

    def _run_stream(self, job: _Job) -> None:
        req = job.reqs[0]
        t0 = time.perf_counter()
        toks: List[int] = []
        if self.metrics:
            self.metrics.running.inc()
        it = self.engine.stream(req.prompt, req.params,
                                **({"images": req.images} if req.images is not None else {}))
        try:
            for tok, lp in it:
                if job.cancel.is_set():
                    break            # closing the generator (finally) frees the sequence's pages
                if not toks and self.metrics:
                    self.metrics.ttft.observe(time.perf_counter() - job.arrived)
                top = self._top_one(req.prompt + toks, req.top_logprobs) if req.top_logprobs else []
                toks.append(tok)
                self._snapshot()
                self._deliver(job, (tok, lp, top))
            else:
                if self.metrics:
                    self.metrics.finished(len(toks), 1, time.perf_counter() - t0)
                self._deliver(job, None)
        except Exception as e:  # noqa: BLE001 - handed to the request's coroutine
            self._deliver(job, e)
        finally:
            it.close()
            self._snapshot()
            if self.metrics:
                self.metrics.running.dec()

    def cache_stats(self) -> Dict[str, float]:
        """The engine's cache counters (``Engine.cache_stats``) as the engine thread last saw them: at
        the start and end of every engine call and after every streamed token (the engine is never
        touched from the HTTP side)."""
        return self._stats

    def _snapshot(self) -> None:
        self._stats = dict(self.engine.cache_stats())

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

    def _top(self, req: Request, c: Completion) -> List[List[Tuple[int, float]]]:
        if not req.top_logprobs or not c.token_ids:
            return []
        prefixes = [req.prompt + c.token_ids[:i] for i in range(len(c.token_ids))]
        return [_topk(row, req.top_logprobs) for row in self.engine.next_logits(prefixes)]

    def _top_one(self, prefix: List[int], k: int) -> List[Tuple[int, float]]:
        return _topk(self.engine.next_logits([prefix])[0], k)


def _topk(logits_V: torch.Tensor, k: int) -> List[Tuple[int, float]]:
    lp = torch.log_softmax(logits_V.float(), -1)
    v, i = torch.topk(lp, min(k, lp.numel()))
    return [(int(a), float(b)) for a, b in zip(i, v)]
