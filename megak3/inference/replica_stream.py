"""The streamed side of :class:`megak3.inference.replicas.ReplicaClient`: a ``stream`` call (the choices
of one prompt, on one replica) as seen from the server's event loop, and one :class:`ReplicaStream`
per choice. The client's reader thread fills each choice's asyncio queue (tokens, then ``None`` at its
end, or the call's error); the last choice to close settles the router."""
from __future__ import annotations

import time
from typing import List


class StreamGroup:
    """One ``stream`` call ``cid`` of ``client`` on replica ``k`` (a prompt's choices, one asyncio queue
    each): what its choices made, and which are still open."""

    def __init__(self, client, cid: int, k: int, ticket: int, salt: bytes, prompt: list, queues):
        self.c, self.cid, self.k, self.ticket, self.salt, self.prompt = client, cid, k, ticket, salt, prompt
        self.queues, self.n = queues, len(queues)
        self.toks: List[List[int]] = [[] for _ in queues]
        self.open = set(range(self.n))
        self.arrived = time.perf_counter()

    def leave(self, j: int, finished: bool) -> None:
        """Choice ``j`` is done: ``finished`` (its end or error was read) or closed early (cancelled)."""
        if j not in self.open:
            return
        self.open.discard(j)
        live = self.cid in self.c.pending
        if not self.open:
            if live and not finished:
                self.c._cancel(self.cid)          # the whole call: the worker drops it or aborts the rest
            self.c.pending.pop(self.cid, None)
            self.c._done(self.ticket, self.k, self.salt, [self.prompt + t for t in self.toks])
        elif live and not finished:
            self.c._cancel(self.cid, j)


class ReplicaStream:
    """``async for (token, logprob, top) in stream``: one choice of a :class:`StreamGroup`.
    ``aclose()`` before its end cancels this choice in the worker (its sequence is aborted)."""

    def __init__(self, group: StreamGroup, j: int):
        self.g, self.j, self.done = group, j, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        g, m = self.g, self.g.c.metrics
        item = await g.queues[self.j].get()
        if item is None or isinstance(item, BaseException):
            self.done = True
            if item is None and m:
                m.finished(len(g.toks[self.j]), 1, time.perf_counter() - g.arrived)
            g.leave(self.j, finished=True)
            if item is None:
                raise StopAsyncIteration
            raise item
        if not g.toks[self.j] and m:
            m.ttft.observe(time.perf_counter() - g.arrived)
        g.toks[self.j].append(item[0])
        return item

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.g.leave(self.j, finished=False)


__all__ = ["StreamGroup", "ReplicaStream"]
