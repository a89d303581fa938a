"""Engine replicas behind the cache-affine router, for the HTTP server (``serve --replicas N``).

:class:`ReplicaClient` has :class:`megak3.inference.engine_client.EngineClient`'s interface (``await
generate(reqs)``, ``async for .. in stream(req)``, ``cache_stats``, ``tokenizer``, ``max_context``, ...),
so :class:`megak3.inference.service.OpenAIService` runs over either. Behind it, N worker processes
(megak3/inference/replica_worker.py), each loading the checkpoint and batching its own jobs with an
``EngineClient``; the server talks to them over socketpairs in JSON frames (replica_wire.py: no pickle
either way). The server itself reads only the model config and the tokenizer, never the weights.

Routing (megak3/inference/router.py): each distinct prompt of a request is routed once by its ids, its decode
budget and its image salt (the engine's: blake2b-128 over the images' fp32 bytes), and all ``n`` choices of
that prompt go to the same replica (a GRPO-like group shares its prefix); a streamed request's choices go
there in one ``stream`` call, begun together in its engine, each cancelled alone when closed early;
streamed copies of a prompt (one ``stream`` call each) follow the first copy's replica. A scoring request
(``echo``, :meth:`ReplicaClient.score`) reads no cache: it goes whole to the up replica with the fewest calls
in flight. When a request finishes, the router records its
prompt + output as cached on that replica, so the next turn of a session goes back there.

A worker that dies fails its in-flight requests (the server answers them with a JSON 500), is marked
down in the router (skipped; its cache model emptied) and is restarted, up to ``max_restarts`` times;
the other replicas keep serving meanwhile.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .cache import image_salt
from .engine_client import ClientDisconnected, Request, Result
from .replica_stream import ReplicaStream, StreamGroup
from .replica_wire import WireClosed, recv, request_out, result_in, scores_in, send
from .router import Router
from .types import InferenceError


class ReplicaDied(RuntimeError):
    """The replica running a request exited before answering it (the server's 500)."""


@dataclass
class _Call:
    replica: int
    loop: asyncio.AbstractEventLoop
    out: Any                          # asyncio.Future (generate, score) | [asyncio.Queue] per choice (stream)
    seqs: Any = None                  # a score call's sequences (its answer is checked against them)
    ended: set = field(default_factory=set)   # a stream call's choices whose "end" came


class _ProcessLink:
    """A worker process on this machine and the server's end of its socketpair."""

    def __init__(self, argv: List[str]):
        mine, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-m", "megak3.inference.replica_worker",
                                      "--fd", str(theirs.fileno()), *argv],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        theirs.close()
        self.sock = mine

    @property
    def pid(self) -> int:
        return self.proc.pid

    def recv(self, timeout: Optional[float] = None) -> dict:
        self.sock.settimeout(timeout)
        try:
            return recv(self.sock)
        except socket.timeout:
            raise WireClosed(f"no message in {timeout} s") from None
        finally:
            try:
                self.sock.settimeout(None)
            except OSError:
                pass

    def send(self, msg: dict) -> None:
        send(self.sock, msg)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def wait(self, timeout: float = 10.0) -> Optional[int]:
        """The worker's exit status (killed after ``timeout`` seconds)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


_ACTOR = None


def _replica_actor():
    """The Ray actor class (defined on first use: Ray is imported only with ``--ray-address``). Each
    actor owns one worker process (a :class:`_ProcessLink` on its node, like megak3/envs/ray_backend.py's
    env workers) and relays its frames as JSON text: ``send(text)``, ``poll() -> [text] (None: the
    worker exited)``. The actor runs one call at a time, so frames keep their order."""
    global _ACTOR
    if _ACTOR is None:
        import ray

        @ray.remote(num_cpus=1, max_restarts=0)
        class ReplicaActor:
            def __init__(self, argv):
                import queue as _queue

                self.link, self.q = _ProcessLink(argv), _queue.Queue()
                threading.Thread(target=self._pump, daemon=True).start()

            def _pump(self):
                try:
                    while True:
                        self.q.put(json.dumps(self.link.recv()))
                except (WireClosed, OSError):
                    self.q.put(None)

            def pid(self):
                return self.link.pid

            def send(self, text: str):
                self.link.send(json.loads(text))

            def poll(self):
                out = []
                while not self.q.empty():
                    out.append(self.q.get())
                return out

        _ACTOR = ReplicaActor
    return _ACTOR


class _RayLink:
    """A worker process owned by a Ray actor (wherever the cluster places it)."""

    def __init__(self, argv: List[str]):
        self.actor = _replica_actor().remote(argv)
        self.buf: List[Optional[str]] = []
        self.pid = None

    def recv(self, timeout: Optional[float] = None) -> dict:
        import ray
        from ray.exceptions import RayActorError

        end = None if timeout is None else time.monotonic() + timeout
        while not self.buf:
            try:
                self.buf = ray.get(self.actor.poll.remote())
            except RayActorError as e:
                raise WireClosed(f"the replica's Ray actor died: {type(e).__name__}") from None
            if not self.buf:
                if end is not None and time.monotonic() > end:
                    raise WireClosed(f"no message in {timeout} s")
                time.sleep(0.005)
        text = self.buf.pop(0)
        if text is None:
            raise WireClosed("the replica's worker process exited")
        return json.loads(text)

    def send(self, msg: dict) -> None:
        self.actor.send.remote(json.dumps(msg))      # in order: one caller, a one-call-at-a-time actor

    def close(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float = 10.0) -> Optional[int]:
        self.close()
        return None


def ensure_ray(address: str) -> None:
    """Join the Ray cluster at ``address`` ("local": start one on this machine, loopback only)."""
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
    if address == "local":
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", configure_logging=False, runtime_env=env)
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False, runtime_env=env)


class _Replica:
    """One engine worker (a :class:`_ProcessLink` or a :class:`_RayLink`) and its last reports."""

    def __init__(self, index: int, argv: List[str], start_timeout: float, ray: bool = False):
        self.index, self.argv, self.start_timeout, self.ray = index, argv, start_timeout, ray
        self.lock = threading.Lock()       # one frame at a time on the link; swaps on restart
        self.up, self.restarts = False, 0
        self.running = self.waiting = self.calls = 0
        self.stats: Dict[str, float] = {}
        self.hello: Dict[str, Any] = {}
        self.link = None

    def spawn(self) -> None:
        self.link = (_RayLink if self.ray else _ProcessLink)(self.argv)

    def handshake(self) -> None:
        try:
            msg = self.link.recv(self.start_timeout)
        except (WireClosed, OSError) as e:
            rc = self.link.proc.poll() if isinstance(self.link, _ProcessLink) else None
            raise InferenceError(f"engine replica {self.index} did not start "
                                 f"({'exit status ' + str(rc) if rc is not None else e})") from None
        if msg.get("op") != "hello":
            raise InferenceError(str(msg.get("message") or f"engine replica {self.index} did not start"))
        self.hello, self.stats = msg, dict(msg.get("stats") or {})
        self.up = True

    @property
    def pid(self) -> Optional[int]:
        return self.hello.get("pid")

    def send(self, msg: dict) -> None:
        with self.lock:
            if not self.up or self.link is None:
                raise ReplicaDied(f"engine replica {self.index} is down (restarting)")
            self.link.send(msg)

    def stop(self, timeout: float = 10.0) -> None:
        self.up = False
        with self.lock:
            if self.link is not None:
                self.link.close()
        if self.link is not None:
            self.link.wait(timeout)


class ReplicaClient:
    """``replicas`` engine worker processes over ``checkpoint`` behind a :class:`Router` (the module
    docstring). ``threads``: torch threads per worker; ``checkpoint_interval``: the engines' KDA
    checkpoint interval (the router's granularity); ``policy``: the router's; ``ray_address``: run
    each worker under a Ray actor on that cluster ("local": a Ray instance started here) instead of
    as a child process; ``max_restarts``: restarts per replica after its worker dies."""

    def __init__(self, checkpoint: str, replicas: int, *, device: str = "cpu", dtype: str = "float32",
                 threads: int = 1, checkpoint_interval: int = 512, tokenizer=None, policy: str = "affinity",
                 max_restarts: int = 3, start_timeout: float = 600.0, metrics=None, ray_address: Optional[str] = None):
        from .loading import load_config_and_tokenizer

        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise InferenceError(f"--replicas {replicas!r} must be an integer >= 1")
        self.config, self.tok = load_config_and_tokenizer(checkpoint, tokenizer)
        argv = ["--checkpoint", str(checkpoint), "--device", device, "--dtype", dtype, "--threads", str(threads),
                "--checkpoint-interval", str(checkpoint_interval)]
        self.max_restarts, self.closing = max_restarts, False
        if ray_address is not None:
            ensure_ray(ray_address)
            argv[1] = str(os.path.abspath(os.path.expanduser(str(checkpoint))))   # the actors' working dir differs
        self.reps = [_Replica(k, argv, start_timeout, ray=ray_address is not None) for k in range(replicas)]
        try:
            for r in self.reps:          # all load at once
                r.spawn()
            for r in self.reps:
                r.handshake()
        except BaseException:
            for r in self.reps:
                r.stop(timeout=5)
            raise
        h = self.reps[0].hello
        self._max_context, self.interval = int(h["max_context"]), int(h["checkpoint_interval"])
        self.router = Router(replicas, checkpoint_interval=self.interval,
                             capacity_tokens=int(h["num_pages"]) * int(h["page_size"]), policy=policy)
        self.rlock = threading.Lock()      # the router: routed from the event loop, marked down by readers
        self.pending: Dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._sticky: "OrderedDict[int, Tuple[list, int]]" = OrderedDict()   # id(prompt) -> (prompt, replica)
        self._metrics = None
        self.metrics = metrics
        self.last_replica: Optional[int] = None      # where the last routed prompt went
        self.readers = [threading.Thread(target=self._read, args=(r,), name=f"replica-{r.index}", daemon=True)
                        for r in self.reps]
        for t in self.readers:
            t.start()

    # ------------------------------------------------------------------------------ properties
    @property
    def metrics(self):
        return self._metrics

    @metrics.setter
    def metrics(self, m) -> None:
        self._metrics = m
        if m is not None:
            m.registry.register(_ReplicaCollector(self))

    @property
    def tokenizer(self):
        return self.tok

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def model_config(self):
        return self.config

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")       # images are built here and shipped to the workers as data

    @property
    def num_pages(self) -> int:
        return sum(int(r.hello.get("num_pages", 0)) for r in self.reps)

    @property
    def num_replicas(self) -> int:
        return len(self.reps)

    def replicas_up(self) -> int:
        return sum(r.up for r in self.reps)

    def alive(self) -> bool:
        return self.replicas_up() > 0

    def cache_stats(self) -> Dict[str, float]:
        """The replicas' engine cache counters summed (``peak_pages``: the sum of the replicas' peaks),
        as each worker last reported them (at the start and end of each of its engine calls)."""
        out: Dict[str, float] = {}
        for r in self.reps:
            for k, v in r.stats.items():
                if isinstance(v, (int, float)):
                    out[k] = out.get(k, 0) + v
        return out

    def replica_stats(self, k: int) -> Dict[str, float]:
        """Replica ``k``'s engine cache counters as it last reported them."""
        return dict(self.reps[k].stats)

    def close(self) -> None:
        self.closing = True
        for r in self.reps:
            r.stop()
        for t in self.readers:
            t.join(timeout=10)

    # ------------------------------------------------------------------------------ asyncio side
    def _call(self, k: int, op: str, reqs: List[Request], out) -> int:
        cid = next(self._ids)
        self.pending[cid] = _Call(k, asyncio.get_running_loop(), out)
        try:
            self.reps[k].send({"id": cid, "op": op, "reqs": [request_out(r) for r in reqs]})
        except (OSError, ReplicaDied) as e:
            self.pending.pop(cid, None)
            raise ReplicaDied(f"engine replica {k} is down: {e}") from None
        return cid

    def _cancel(self, cid: int, choice: Optional[int] = None) -> None:
        """Cancel call ``cid`` in its worker (``choice``: that choice of a stream call alone)."""
        call = self.pending.get(cid) if choice is not None else self.pending.pop(cid, None)
        if call is not None:
            try:
                self.reps[call.replica].send({"id": cid, "op": "cancel"} if choice is None
                                             else {"id": cid, "op": "cancel", "i": choice})
            except (OSError, ReplicaDied):
                pass

    def _route(self, prompt: List[int], max_new: int, salt: bytes, replica: Optional[int] = None) -> Tuple[int, int]:
        with self.rlock:
            k = self.router.route(prompt, max_new=max_new, salt=salt, replica=replica)
            self.last_replica = k
            return k, self.router.last_ticket

    def _done(self, ticket: int, k: int, salt: bytes, seqs: List[List[int]]) -> None:
        with self.rlock:
            self.router.done(ticket, seqs[0] if seqs else (), salt)
            for s in seqs[1:]:
                self.router.cached(k, s, salt)

    async def generate(self, reqs: List[Request], disconnected=None) -> List[Result]:
        """Results of ``reqs``; the choices of one prompt (the same list object) go to one replica."""
        groups: "OrderedDict[int, List[int]]" = OrderedDict()
        for i, r in enumerate(reqs):
            groups.setdefault(id(r.prompt), []).append(i)
        loop = asyncio.get_running_loop()
        calls = []        # (indexes, replica, ticket, salt, cid, future)
        t0 = time.perf_counter()
        try:
            for idx in groups.values():
                first = reqs[idx[0]]
                salt = image_salt(first.images)
                k, ticket = self._route(first.prompt, sum(reqs[i].params.max_tokens for i in idx), salt)
                fut = loop.create_future()
                try:
                    cid = self._call(k, "generate", [reqs[i] for i in idx], fut)
                except ReplicaDied:
                    self._done(ticket, k, salt, [])
                    raise
                calls.append([idx, k, ticket, salt, cid, fut, None])
            while True:
                futs = {c[5] for c in calls}
                done, rest = await asyncio.wait(futs, timeout=0.25)
                if not rest or any(f.exception() is not None for f in done):
                    break
                if disconnected is not None and await disconnected():
                    raise ClientDisconnected()
            out: List[Optional[Result]] = [None] * len(reqs)
            for c in calls:
                res = c[5].result()              # a replica's error is this request's
                c[6] = res
                for i, r in zip(c[0], res):
                    out[i] = r
            if self.metrics:
                self.metrics.finished(sum(len(r.completion.token_ids) for r in out), len(out),
                                      time.perf_counter() - t0)
            return out
        finally:
            for idx, k, ticket, salt, cid, fut, res in calls:
                if not fut.done():
                    self._cancel(cid)
                self.pending.pop(cid, None)
                seqs = [reqs[i].prompt + r.completion.token_ids for i, r in zip(idx, res)] if res else []
                self._done(ticket, k, salt, seqs)

    async def score(self, seqs: List[List[int]], temperature: float) -> List[List[float]]:
        """Token logprobs of each sequence (the ``echo`` scoring, megak3/inference/scoring.py), all on one
        replica: the up replica with the fewest calls in flight (scoring reads no prefix cache, so the
        router's affinity has nothing to gain; concurrent scoring requests spread over the replicas)."""
        up = [r.index for r in self.reps if r.up]
        if not up:
            raise ReplicaDied("no engine replica is up")
        busy = {k: 0 for k in up}
        for c in list(self.pending.values()):
            if c.replica in busy:
                busy[c.replica] += 1
        k = min(up, key=lambda i: (busy[i], i))
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        cid = next(self._ids)
        self.pending[cid] = _Call(k, loop, fut, seqs)
        try:
            self.reps[k].send({"id": cid, "op": "score", "seqs": [[int(t) for t in s] for s in seqs],
                               "temperature": float(temperature)})
        except (OSError, ReplicaDied) as e:
            self.pending.pop(cid, None)
            raise ReplicaDied(f"engine replica {k} is down: {e}") from None
        try:
            return await fut
        finally:
            if not fut.done():
                self._cancel(cid)
            self.pending.pop(cid, None)

    def stream(self, req: Request) -> ReplicaStream:
        """(token, logprob, top) per token from the replica the router picks (copies of one prompt:
        the first copy's replica); the call is sent at once. :meth:`streams` of one request."""
        return self.streams([req])[0]

    def streams(self, reqs: List[Request]) -> List[ReplicaStream]:
        """One :class:`ReplicaStream` per request, sent at once (from a coroutine): the requests of one
        prompt (the same list object: a streamed request's ``n`` choices) are routed once and go to
        their replica in one ``stream`` call, whose worker begins them together (they share the
        prompt's prefix and the decode batches); a prompt streamed again (``stream`` per copy) follows
        its first copy's replica. Close each (``aclose``): an unfinished one is cancelled alone."""
        groups: "OrderedDict[int, List[int]]" = OrderedDict()
        for i, r in enumerate(reqs):
            groups.setdefault(id(r.prompt), []).append(i)
        out: List[Optional[ReplicaStream]] = [None] * len(reqs)
        sent: List[StreamGroup] = []
        try:
            for idx in groups.values():
                g = self._stream_call([reqs[i] for i in idx])
                sent.append(g)
                for j, i in enumerate(idx):
                    out[i] = ReplicaStream(g, j)
        except BaseException:
            for g in sent:
                for j in range(g.n):
                    g.leave(j, finished=False)
            raise
        return out

    def _stream_call(self, reqs: List[Request]) -> StreamGroup:
        first = reqs[0]
        salt = image_salt(first.images)
        prev = self._sticky.get(id(first.prompt))
        replica = prev[1] if prev is not None and prev[0] is first.prompt else None
        k, ticket = self._route(first.prompt, sum(r.params.max_tokens for r in reqs), salt, replica)
        self._sticky[id(first.prompt)] = (first.prompt, k)
        self._sticky.move_to_end(id(first.prompt))
        while len(self._sticky) > 256:
            self._sticky.popitem(last=False)
        queues = [asyncio.Queue() for _ in reqs]
        try:
            cid = self._call(k, "stream", reqs, queues)
        except ReplicaDied:
            self._done(ticket, k, salt, [])
            raise
        return StreamGroup(self, cid, k, ticket, salt, first.prompt, queues)

    # ------------------------------------------------------------------------------ reader threads
    @staticmethod
    def _deliver(call: _Call, value, last: bool, i: Optional[int] = None) -> None:
        """``value`` to the call's caller: a stream call's choice ``i`` (None: every choice), or its future."""
        def put():
            if isinstance(call.out, list):
                for q in (call.out if i is None else call.out[i:i + 1]):
                    q.put_nowait(value)
            elif not call.out.done():
                (call.out.set_exception if isinstance(value, BaseException) else call.out.set_result)(value)
        try:
            call.loop.call_soon_threadsafe(put)
        except RuntimeError:   # the caller's event loop is closed: nobody is waiting
            pass

    def _read(self, rep: _Replica) -> None:
        while True:
            link = rep.link
            try:
                while True:
                    msg = link.recv()
                    self._handle(rep, msg)
            except (WireClosed, OSError, ValueError, KeyError, TypeError):
                pass
            if self.closing or not self._died(rep):
                return

    def _handle(self, rep: _Replica, msg: dict) -> None:
        op = msg.get("op")
        if op == "load":
            rep.running, rep.waiting, rep.calls = int(msg["running"]), int(msg["waiting"]), int(msg.get("calls", 0))
            rep.stats = dict(msg.get("stats") or {})
            if self.metrics:
                self.metrics.running.set(sum(r.running for r in self.reps))
                self.metrics.waiting.set(sum(r.waiting for r in self.reps))
            return
        cid = msg.get("id")
        call = self.pending.get(cid)
        if call is None:
            return
        if op == "token":
            self._deliver(call, (int(msg["t"]), float(msg["lp"]), [(int(i), float(v)) for i, v in msg["top"]]),
                          False, int(msg.get("i", 0)))
            return
        if op == "end" and isinstance(call.out, list):      # one choice of a stream call
            i = int(msg.get("i", 0))
            call.ended.add(i)
            self._deliver(call, None, True, i)
            if len(call.ended) < len(call.out):
                return
        self.pending.pop(cid, None)
        if op == "result":
            self._deliver(call, [result_in(x) for x in msg["results"]], True)
        elif op == "scores" and call.seqs is not None:
            try:
                self._deliver(call, scores_in(msg, call.seqs), True)
            except (ValueError, KeyError) as e:
                self._deliver(call, RuntimeError(f"engine replica {rep.index}: {e}"), True)
        elif op == "error":
            err = InferenceError(msg["message"]) if msg.get("kind") == "inference" else RuntimeError(msg["message"])
            self._deliver(call, err, True)

    def _died(self, rep: _Replica) -> bool:
        """Fail replica ``rep``'s requests, mark it down and restart it; True when it is up again."""
        k = rep.index
        with rep.lock:
            rep.up = False
            try:
                rep.link.close()
            except OSError:
                pass
        rc = rep.link.wait(10)
        with self.rlock:
            self.router.set_up(k, False)
        rep.running = rep.waiting = rep.calls = 0
        err = ReplicaDied(f"engine replica {k} exited (status {rc}) while running this request; it is restarted")
        for cid, call in list(self.pending.items()):
            if call.replica == k:
                self.pending.pop(cid, None)
                self._deliver(call, err, True)
        if rep.restarts >= self.max_restarts:
            print(f"megak3 serve: engine replica {k} exited (status {rc}); restarted {rep.restarts} times "
                  "already, it stays down", file=sys.stderr, flush=True)
            return False
        rep.restarts += 1
        print(f"megak3 serve: engine replica {k} exited (status {rc}); restarting it", file=sys.stderr, flush=True)
        try:
            with rep.lock:
                rep.spawn()
            rep.handshake()
        except (InferenceError, OSError) as e:
            print(f"megak3 serve: engine replica {k} did not restart: {e}", file=sys.stderr, flush=True)
            return False
        if self.closing:
            rep.stop()
            return False
        with self.rlock:
            self.router.set_up(k, True)
        return True


class _ReplicaCollector:
    """Per-replica series for /metrics (prometheus_client custom collector)."""

    def __init__(self, client: ReplicaClient):
        self.c = client

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.c
        fams = [GaugeMetricFamily("megak3_replica_up", "1 when the engine replica's worker is serving",
                                  labels=["replica"]),
                GaugeMetricFamily("megak3_replica_requests_running", "prompts inside the replica's engine call",
                                  labels=["replica"]),
                GaugeMetricFamily("megak3_replica_requests_waiting", "prompts queued for the replica's engine",
                                  labels=["replica"]),
                CounterMetricFamily("megak3_replica_routed_prefix_hit_tokens",
                                    "prompt tokens the router expected the replica to restore from its cache",
                                    labels=["replica"]),
                CounterMetricFamily("megak3_replica_prefix_cache_hit_tokens",
                                    "prompt tokens the replica's engine served from its prefix cache",
                                    labels=["replica"]),
                CounterMetricFamily("megak3_replica_restarts", "times the replica's worker was restarted",
                                    labels=["replica"]),
                GaugeMetricFamily("megak3_replica_calls", "engine calls (requests) the replica's worker holds",
                                  labels=["replica"]),
                GaugeMetricFamily("megak3_replica_cache_pages_available",
                                  "pages a new sequence can still get on the replica (as of its last request end)",
                                  labels=["replica"])]
        for r in c.reps:
            lab = [str(r.index)]
            fams[0].add_metric(lab, float(r.up))
            fams[1].add_metric(lab, r.running)
            fams[2].add_metric(lab, r.waiting)
            fams[3].add_metric(lab, c.router.stats.per_replica_reused[r.index])
            fams[4].add_metric(lab, r.stats.get("hit_tokens", 0))
            fams[5].add_metric(lab, r.restarts)
            fams[6].add_metric(lab, r.calls)
            fams[7].add_metric(lab, r.stats.get("pages_available", 0))
        yield from fams

    def describe(self):
        return []


__all__ = ["ReplicaClient", "ReplicaDied", "image_salt"]
