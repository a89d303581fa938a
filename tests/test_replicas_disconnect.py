"""Client disconnects on the replica path (``serve --replicas 2``, megak3/inference/replicas.py) on a real
uvicorn socket: a client that hangs up mid-generation, streamed or not, one choice or n=2, gets its
sequences aborted in the worker's engine (its aborted counter rises by the number of choices, no live
sequence is left, every page is available again) and the router's outstanding work and the worker's
calls go back to 0 (one choice of a stream closed early is aborted alone); a client that hangs up while its request has not reached an engine yet (the worker
held with SIGSTOP) never reaches one; a cancel of a finished or unknown call is ignored. Afterwards the server answers as a lone engine does."""
import http.client
import json
import os
import signal
import threading
import time

import pytest

from megak3.inference import Engine, SamplingParams
from megak3.inference.server import bind, make_app, uvicorn_server
from test_generate_cli import make_tiny_run

INTERVAL = 16
CONTEXT = 2048          # a long budget: 2000 decode steps take seconds even for the tiny model
LONG = {"prompt": "def", "max_tokens": CONTEXT - 48, "temperature": 0, "ignore_eos": True}


def _wait(cond, what, timeout=30.0):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from megak3.inference.replicas import ReplicaClient

    run, _, tok = make_tiny_run(tmp_path_factory.mktemp("run"), max_seq_len=CONTEXT)
    client = ReplicaClient(str(run), 2, checkpoint_interval=INTERVAL, start_timeout=300)
    server = None
    try:
        app = make_app(None, "tiny", client=client)
        sock = bind("127.0.0.1", 0)
        server = uvicorn_server(app)
        th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        th.start()
        _wait(lambda: server.started, "uvicorn started")
        yield sock.getsockname()[1], client, run, tok
    finally:
        if server is not None:
            server.should_exit = True
            th.join(30)
        client.close()


def _open(port, body):
    """A connection with ``body`` POSTed to /v1/completions (the response not read)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    return conn


def _hang_up(conn):
    conn.sock.shutdown(2)
    conn.close()


def _metrics(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for ln in text.splitlines():
        if ln.startswith("megak3_replica_"):
            name, v = ln.rsplit(" ", 1)
            out[name] = float(v)
    return out


def _total(client, key):
    return sum(client.replica_stats(k).get(key, 0) for k in range(2))


def _idle(client):
    return (not client.pending and client.router.load == [0, 0]
            and all(r.running == r.waiting == r.calls == 0 for r in client.reps)
            and all(client.replica_stats(k).get("live_sequences") == 0
                    and client.replica_stats(k).get("pages_available") == client.reps[k].hello["num_pages"]
                    for k in range(2)))


def _assert_idle_in_metrics(port, client):
    m = _metrics(port)
    for k in range(2):
        lab = f'{{replica="{k}"}}'
        assert m[f"megak3_replica_requests_running{lab}"] == 0 and m[f"megak3_replica_requests_waiting{lab}"] == 0
        assert m[f"megak3_replica_calls{lab}"] == 0
        assert m[f"megak3_replica_cache_pages_available{lab}"] == client.reps[k].hello["num_pages"]


def test_a_disconnect_mid_generation_aborts_the_workers_sequences(served):
    port, client, run, tok = served
    _wait(lambda: _idle(client), "idle at the start")
    cases = [(dict(LONG), 1), ({**LONG, "stream": True}, 1),
             ({**LONG, "n": 2, "temperature": 0.8, "seed": 3}, 2),
             ({**LONG, "n": 2, "temperature": 0.8, "seed": 3, "stream": True}, 2)]
    for body, n in cases:
        aborted = _total(client, "aborted_sequences")
        t0 = time.time()
        conn = _open(port, body)
        if body.get("stream"):
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: {")   # tokens are flowing
        _wait(lambda: sum(r.running for r in client.reps) == n, f"{n} running ({body})")
        assert sum(r.running > 0 for r in client.reps) == 1          # the choices of a prompt share a replica
        _hang_up(conn)
        _wait(lambda: _total(client, "aborted_sequences") == aborted + n and _idle(client), f"aborted ({body})")
        took = time.time() - t0
        assert _total(client, "aborted_sequences") == aborted + n, body
        print(f"{body.get('stream', False)=} n={n}: aborted and idle {took:.2f} s after the request")
    _assert_idle_in_metrics(port, client)
    _serves_like_a_lone_engine(port, run, tok)


def test_a_disconnect_before_the_worker_begins_never_reaches_its_engine(served):
    """Both workers held (SIGSTOP): the call and its cancel wait in the socket, so the worker reads the
    cancel right behind the call; the request must reach no engine and leave no call behind. Cancels of
    calls the workers finished long ago (or never had) change nothing."""
    port, client, run, tok = served
    _wait(lambda: _idle(client), "idle at the start")
    aborted, lookups = _total(client, "aborted_sequences"), _total(client, "lookups")
    pids = [r.pid for r in client.reps]
    for p in pids:
        os.kill(p, signal.SIGSTOP)
    try:
        for body in (dict(LONG), {**LONG, "stream": True}, {**LONG, "n": 2, "seed": 1, "temperature": 0.8}):
            conn = _open(port, body)
            _wait(lambda: len(client.pending) >= 1, "the call sent to a replica")
            _hang_up(conn)
            _wait(lambda: not client.pending and client.router.load == [0, 0], "cancelled by the server")
    finally:
        for p in pids:
            os.kill(p, signal.SIGCONT)
    time.sleep(0.5)                                  # the workers read the calls and the cancels
    for r in client.reps:                            # cancels of finished calls (ids 1-3) and of an unknown one
        for cid in (1, 2, 3, 10 ** 9):
            r.send({"id": cid, "op": "cancel"})
    _wait(lambda: _idle(client), "idle")
    assert _total(client, "aborted_sequences") == aborted and _total(client, "lookups") == lookups
    assert [r.pid for r in client.reps] == pids and client.replicas_up() == 2
    _assert_idle_in_metrics(port, client)
    _serves_like_a_lone_engine(port, run, tok)


def test_one_streamed_choice_closed_early_is_cancelled_alone(served):
    """Of a prompt's 2 streamed choices (one worker call), the first is closed after its first token:
    the worker aborts that sequence alone, the other streams on to its end with the lone engine's
    tokens, and nothing is left behind; closed before its worker began the call, it never sends a token."""
    import asyncio

    from megak3.inference.engine_client import Request

    port, client, run, tok = served
    _wait(lambda: _idle(client), "idle at the start")
    aborted = _total(client, "aborted_sequences")
    prompt = tok.encode("def")
    sps = [SamplingParams(max_tokens=CONTEXT - 48, ignore_eos=True), SamplingParams(max_tokens=12, ignore_eos=True)]

    async def go():
        a, b = client.streams([Request(prompt, sps[0]), Request(prompt, sps[1])])
        await a.__anext__()                                   # mid-generation
        await a.aclose()
        return [t async for t, _, _ in b]

    got = asyncio.run(go())
    engine = Engine.from_pretrained(str(run), checkpoint_interval=INTERVAL)
    want = engine.generate([prompt], sps[1])[0].token_ids
    assert got == want
    _wait(lambda: _total(client, "aborted_sequences") == aborted + 1 and _idle(client), "the first choice aborted")
    assert _total(client, "aborted_sequences") == aborted + 1

    # the same, closed before its worker began the call (both workers held): the worker reads the choice's
    # cancel right behind the call and never sends one token of it
    seen = []
    handle = client._handle
    client._handle = lambda rep, msg: (seen.append(msg), handle(rep, msg))
    pids = [r.pid for r in client.reps]
    aborted = _total(client, "aborted_sequences")

    async def held():
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        try:
            a, b = client.streams([Request(prompt, sps[0]), Request(prompt, sps[1])])
            await a.aclose()
        finally:
            for p in pids:
                os.kill(p, signal.SIGCONT)
        return [t async for t, _, _ in b]

    try:
        assert asyncio.run(held()) == want
        _wait(lambda: _idle(client), "idle")
    finally:
        del client._handle
    assert not [m for m in seen if m.get("op") == "token" and m.get("i") == 0]
    assert len([m for m in seen if m.get("op") == "token" and m.get("i") == 1]) == len(want)
    assert _total(client, "aborted_sequences") - aborted in (0, 1)    # dropped before or after its begin


def _serves_like_a_lone_engine(port, run, tok):
    engine = Engine.from_pretrained(str(run), checkpoint_interval=INTERVAL)
    for body in ({"prompt": "def main(", "max_tokens": 8, "temperature": 0},
                 {"prompt": "class", "max_tokens": 6, "temperature": 0.9, "seed": 4, "n": 2, "ignore_eos": True}):
        conn = _open(port, body)
        got = json.loads(conn.getresponse().read())
        conn.close()
        n = body.get("n", 1)
        sps = [SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                              ignore_eos=body.get("ignore_eos", False),
                              seed=None if "seed" not in body else body["seed"] + k) for k in range(n)]
        ref = engine.generate([tok.encode(body["prompt"])] * n, sps)
        assert [c["text"] for c in got["choices"]] == [r.text for r in ref], got
