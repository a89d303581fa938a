"""One engine replica in its own process: loads the checkpoint, then serves engine jobs from the server
over the socket it inherited (megak3/inference/replica_wire.py: JSON frames, no pickle).

    python -m megak3.inference.replica_worker --fd N --checkpoint RUN [--device cpu] [--dtype float32]
        [--threads 1] [--checkpoint-interval 512]

Inside, an :class:`megak3.inference.engine_client.EngineClient` (the server's single-engine adapter)
runs the jobs it receives, streamed or not (a stream call's choices are begun together, their tokens
sent as each is made, tagged with the choice's index), in shared decode steps on the engine's sequence API
(``begin`` / ``step`` / ``abort``), and the ``score`` jobs (``echo``) on its engine thread, exactly as the
one-engine server does. Started by
:class:`megak3.inference.replicas.ReplicaClient`; it exits when the server closes the socket.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import select
import socket
import sys
import threading

from .replica_wire import WireClosed, error_out, recv, request_in, result_out, send


class _Load:
    """The engine client's metrics hooks, reduced to the running / waiting counts the worker reports."""

    class _Counter:
        def __init__(self, owner):
            self.owner, self.v = owner, 0

        def inc(self, n=1):
            self.v += n
            self.owner.changed()

        def dec(self, n=1):
            self.v -= n
            self.owner.changed()

    class _Nop:
        def observe(self, *_):
            pass

    def __init__(self, report):
        self.report = report
        self.running, self.waiting, self.ttft = self._Counter(self), self._Counter(self), self._Nop()

    def changed(self):
        self.report()

    def finished(self, *_):
        pass


def serve(sock: socket.socket, engine) -> None:
    from .engine_client import EngineClient

    loop = asyncio.new_event_loop()
    lock = threading.Lock()

    def put(msg):
        with lock:
            send(sock, msg)

    client = EngineClient(engine)
    tasks = {}      # call id -> its asyncio task (the loop thread's; the engine thread reads its size)

    def report():   # called by the engine thread and the loop thread: a snapshot, sent as is
        try:
            put({"op": "load", "running": load.running.v, "waiting": load.waiting.v, "calls": len(tasks),
                 "stats": client.cache_stats()})
        except OSError:
            pass

    load = _Load(report)
    client.metrics = load
    put({"op": "hello", "pid": os.getpid(), "max_context": engine.max_context,
         "num_pages": engine.cache.cfg.num_pages, "page_size": engine.cache.cfg.page_size,
         "checkpoint_interval": engine.cache.cfg.checkpoint_interval, "stats": client.cache_stats()})

    closed = {}     # stream call id -> its choices cancelled one by one ("cancel" with "i") before it began
    pumps = {}      # stream call id -> {choice: (the task sending its tokens, its TokenStream)}

    def drop(rid, i):
        """Cancel choice ``i`` of stream call ``rid`` alone (its sequence is aborted now)."""
        t, s = pumps[rid][i]
        t.cancel()
        loop.create_task(s.aclose())      # a pump cancelled before it ran never closes its stream

    async def pump(rid, i, s):
        try:
            async for t, lp, top in s:
                put({"id": rid, "op": "token", "i": i, "t": int(t), "lp": float(lp),
                     "top": [[int(a), float(v)] for a, v in top]})
        finally:
            await s.aclose()              # cancelled (or failed): the engine aborts the sequence
        put({"id": rid, "op": "end", "i": i})

    async def stream(rid, reqs):
        """All choices of the call begun together (one ``streams`` item), their tokens sent as made."""
        streams = client.streams(reqs)
        mine = {i: loop.create_task(pump(rid, i, s)) for i, s in enumerate(streams)}
        pumps[rid] = {i: (mine[i], s) for i, s in enumerate(streams)}
        try:
            for i in closed.pop(rid, ()):
                if i in mine:
                    drop(rid, i)
            while True:
                done, rest = await asyncio.wait(mine.values(), return_when=asyncio.FIRST_EXCEPTION)
                err = next((t.exception() for t in done if not t.cancelled() and t.exception() is not None), None)
                if err is not None:
                    raise err
                if not rest:
                    return
        finally:
            pumps.pop(rid, None)
            for t in mine.values():
                t.cancel()
            for s in streams:             # a pump cancelled before it ran never closes its stream
                await s.aclose()

    async def answer(rid, body, *cleanup):
        """Run ``body()`` for call ``rid``: its reply, or its error, goes back to the server; a cancel
        ends it quietly; ``cleanup`` callables run last."""
        try:
            await body()
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - the request's error goes back to the server
            put(error_out(rid, e))
        finally:
            tasks.pop(rid, None)
            for fn in cleanup:
                fn()

    async def run(msg):
        rid = msg["id"]

        async def body():
            reqs = [request_in(x, _device(engine)) for x in msg["reqs"]]
            if msg["op"] == "generate":
                res = await client.generate(reqs)
                put({"id": rid, "op": "result", "results": [result_out(r) for r in res]})
            else:
                await stream(rid, reqs)
        await answer(rid, body, lambda: closed.pop(rid, None), report)

    async def score(msg):
        rid = msg["id"]

        async def body():
            seqs = [[int(t) for t in x] for x in msg["seqs"]]
            lps = await client.score(seqs, float(msg["temperature"]))
            put({"id": rid, "op": "scores", "logprobs": lps})
        await answer(rid, body)

    def dispatch(msg):
        if msg.get("op") == "score":
            tasks[msg["id"]] = loop.create_task(score(msg))
        elif msg.get("op") == "cancel" and msg.get("i") is not None:
            # one choice of a stream call (the others go on); before the call's body ran: noted for it
            rid, i = msg.get("id"), msg.get("i")
            if rid in pumps and i in pumps[rid]:
                drop(rid, i)
            elif rid in tasks:
                closed.setdefault(rid, set()).add(i)
            report()
        elif msg.get("op") == "cancel":
            # popped here: a task cancelled before its first step never runs its body (nor its finally),
            # so a cancel that arrives right behind its call leaves nothing behind and reaches no engine
            t = tasks.pop(msg.get("id"), None)
            closed.pop(msg.get("id"), None)
            if t is not None:
                t.cancel()
            report()
        elif msg.get("op") in ("generate", "stream"):
            tasks[msg["id"]] = loop.create_task(run(msg))

    def dispatch_all(msgs):
        for m in msgs:
            dispatch(m)

    def reader():
        # the frames already in the socket go to the loop in one callback: a cancel right behind its call
        # (a client that left before the worker read either) is dispatched before the call's task first
        # runs, whatever the threads' timing, so that call never reaches the engine
        try:
            while True:
                msgs = [recv(sock)]
                while select.select([sock], [], [], 0)[0]:
                    msgs.append(recv(sock))
                loop.call_soon_threadsafe(dispatch_all, msgs)
        except (WireClosed, OSError, ValueError):
            loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=reader, name="replica-reader", daemon=True).start()
    try:
        loop.run_forever()
    finally:
        client.close()


def _device(engine):
    return next(engine.model.parameters()).device


def main(argv=None) -> int:
    from megak3.inference.options import add_model_args, load_engine

    p = argparse.ArgumentParser(prog="python -m megak3.inference.replica_worker")
    add_model_args(p)
    p.add_argument("--fd", type=int, required=True, help="the inherited socket to the server")
    p.add_argument("--checkpoint-interval", type=int, default=512)
    a = p.parse_args(argv)
    sock = socket.socket(fileno=a.fd)
    try:
        engine = load_engine(a)
    except (ValueError, OSError) as e:
        try:
            send(sock, {"op": "error", "kind": "inference", "message": " ".join(str(e).split())})
        except OSError:
            pass
        return 2
    serve(sock, engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
