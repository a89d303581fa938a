"""Engine replicas behind the cache-affine router (megak3/inference/replicas.py, ``serve --replicas N``):
outputs through 2 worker processes equal one in-process engine's (greedy and seeded sampling, streams
too; a streamed request's n choices begun together on one replica, a long prompt prefilled once); a
multi-turn session returns to its replica and that engine reports a prefix hit; a killed
worker fails only its request (JSON 500), is restarted, and the server keeps serving; bad
``--replicas`` values are one line and exit 2."""
import json
import os
import signal
import threading
import time

import pytest
import torch

from megak3.inference import Engine, SamplingParams
from megak3.inference.server import make_app
from test_generate_cli import make_tiny_run

INTERVAL = 16


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    from fastapi.testclient import TestClient

    from megak3.inference.replicas import ReplicaClient

    run, model, tok = make_tiny_run(tmp_path_factory.mktemp("run"))
    client = ReplicaClient(str(run), 2, checkpoint_interval=INTERVAL, start_timeout=300)
    app = make_app(None, "tiny", client=client)
    engine = Engine.from_pretrained(str(run), checkpoint_interval=INTERVAL)
    with TestClient(app, raise_server_exceptions=False) as c:   # a fault is the app's JSON 500
        yield c, client, engine, tok


def test_two_replicas_equal_one_engine_greedy_seeded_and_streamed(replicated):
    c, client, engine, tok = replicated
    prompts = ["def main(", "class Point:", "the quick brown", "return sum(x"]
    results = {}

    def post(i, body):
        results[i] = c.post("/v1/completions", json=body).json()

    bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 2} for p in prompts]
    bodies += [{"prompt": p, "max_tokens": 6, "temperature": 0.9, "seed": 5 + i, "ignore_eos": True, "n": 2}
               for i, p in enumerate(prompts)]
    threads = [threading.Thread(target=post, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, b in enumerate(bodies):
        n = b.get("n", 1)
        sps = [SamplingParams(max_tokens=b["max_tokens"], temperature=b["temperature"],
                              ignore_eos=b.get("ignore_eos", False),
                              seed=None if "seed" not in b else b["seed"] + k) for k in range(n)]
        ref = engine.generate([tok.encode(b["prompt"])] * n, sps)
        got = results[i]["choices"]
        assert [x["text"] for x in got] == [r.text for r in ref], (b, got)
        if "logprobs" in b:                     # computed in the worker, carried back as numbers
            assert got[0]["logprobs"]["token_logprobs"] == pytest.approx(ref[0].logprobs, abs=1e-5)
            assert all(len(t) >= 1 for t in got[0]["logprobs"]["top_logprobs"])
    assert min(client.router.stats.per_replica_work) > 0     # both replicas served
    # a stream through a replica: the same tokens as the engine's
    r = c.post("/v1/completions", json={"prompt": "def main(", "max_tokens": 8, "temperature": 0, "stream": True})
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in r.text.split("\n\n")
                   if e.startswith("data: {"))
    assert text == engine.generate([tok.encode("def main(")], SamplingParams(max_tokens=8))[0].text
    # n = 2 streamed, seeded: the copies follow the first copy's replica and each equals its own seed's run
    work = list(client.router.stats.per_replica_work)
    r = c.post("/v1/completions", json={"prompt": "class", "max_tokens": 5, "temperature": 0.9, "seed": 4, "n": 2,
                                        "ignore_eos": True, "stream": True})
    texts = ["", ""]
    for e in r.text.split("\n\n"):
        if e.startswith("data: {"):
            ch = json.loads(e[6:])["choices"][0]
            texts[ch["index"]] += ch["text"]
    ref = engine.generate([tok.encode("class")] * 2, [SamplingParams(max_tokens=5, temperature=0.9, seed=4 + k,
                                                                     ignore_eos=True) for k in range(2)])
    assert texts == [x.text for x in ref]
    assert sum(a != b for a, b in zip(work, client.router.stats.per_replica_work)) == 1


def test_a_session_returns_to_its_replica_and_hits_its_cache(replicated):
    c, client, engine, tok = replicated
    prompt = tok.encode("the quick brown fox jumps over the lazy dog. def main(argv): return sum(x")
    assert len(prompt) > 2 * INTERVAL
    before = [client.replica_stats(k).get("hit_tokens", 0) for k in range(2)]
    client.router.balance = 1e9    # the load guard is tests/test_router.py's: here the first test's uneven
    # cumulative work must not move the session
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    k1 = client.last_replica
    out = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    assert r.json()["choices"][0]["text"] == tok.decode(out)
    turn2 = prompt + out + tok.encode(" class Point:")
    r2 = c.post("/v1/completions", json={"prompt": turn2, "max_tokens": 4, "temperature": 0})
    assert r2.status_code == 200
    assert client.last_replica == k1 and client.router.stats.fallbacks == 0
    client.router.balance = 1.1
    deadline = time.time() + 10            # the worker reports its counters after each engine call
    while client.replica_stats(k1).get("hit_tokens", 0) == before[k1] and time.time() < deadline:
        time.sleep(0.05)
    gained = client.replica_stats(k1)["hit_tokens"] - before[k1]
    assert gained >= (len(turn2) - 1) // INTERVAL * INTERVAL - INTERVAL and gained > 0
    assert client.replica_stats(1 - k1).get("hit_tokens", 0) == before[1 - k1]
    m = c.get("/metrics").text
    assert f'megak3_replica_routed_prefix_hit_tokens_total{{replica="{k1}"}}' in m
    assert c.get("/health").json() == {"status": "ok", "replicas": 2, "replicas_up": 2}


def test_streamed_choices_begin_together_on_one_replica(replicated, monkeypatch):
    """A streamed request's n choices are begun together in one worker: before the first token of the
    request reaches the server, that worker has reported all n sequences live (its ``load`` message,
    sent by the engine thread after the step that begins them); every token comes from that replica;
    the texts equal one engine's (greedy, and seeded: choice k samples with seed + k); a long prompt
    is prefilled once there, the other n - 1 choices restoring its blocks from the prefix cache."""
    c, client, engine, tok = replicated
    seen = []                                  # (replica, message) in the order each reader thread got them
    handle = client._handle

    def record(rep, msg):
        seen.append((rep.index, msg))
        handle(rep, msg)

    monkeypatch.setattr(client, "_handle", record)
    long = " def area(self): return self.w * self.h  # the rectangle's area, in square units"
    for n, extra, prompt in ((2, {"temperature": 0}, "class Point:"), (3, {"temperature": 0}, "class Point:"),
                             (2, {"temperature": 0.9, "seed": 7}, "class Point:"),
                             (3, {"temperature": 0.9, "seed": 11}, "class Point:"),
                             (3, {"temperature": 0}, "class Rect:" + long), (2, {"temperature": 0.9, "seed": 3},
                                                                              "class Box:" + long)):
        deadline = time.time() + 30
        while any(client.replica_stats(k).get("live_sequences") for k in range(2)) and time.time() < deadline:
            time.sleep(0.02)
        del seen[:]
        hits = [client.replica_stats(k).get("hit_tokens", 0) for k in range(2)]
        body = {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "n": n, "stream": True, **extra}
        r = c.post("/v1/completions", json=body)
        texts = [""] * n
        for e in r.text.split("\n\n"):
            if e.startswith("data: {"):
                ch = json.loads(e[6:])["choices"][0]
                texts[ch["index"]] += ch["text"]
        ref = engine.generate([tok.encode(body["prompt"])] * n,
                              [SamplingParams(max_tokens=5, temperature=extra["temperature"], ignore_eos=True,
                                              seed=None if "seed" not in extra else extra["seed"] + k)
                               for k in range(n)])
        assert texts == [x.text for x in ref], body
        first = next(i for i, (_, m) in enumerate(seen) if m.get("op") == "token")
        k = seen[first][0]
        assert {rk for rk, m in seen if m.get("op") == "token"} == {k}, body       # one replica
        live = [m["stats"].get("live_sequences", 0) for rk, m in seen[:first] if rk == k and m.get("op") == "load"]
        assert max(live, default=0) == n, (body, live)          # all n begun before any token was sent
        ids = tok.encode(prompt)
        if len(ids) > INTERVAL:          # a new long prompt: prefilled once, the other n - 1 restore its blocks
            deadline = time.time() + 10
            while client.replica_stats(k).get("hit_tokens", 0) == hits[k] and time.time() < deadline:
                time.sleep(0.02)
            gained = client.replica_stats(k).get("hit_tokens", 0) - hits[k]
            assert gained >= (n - 1) * ((len(ids) - 1) // INTERVAL * INTERVAL - INTERVAL) > 0, (body, gained)


def test_one_engine_client_prefills_a_shared_long_prompt_once(replicated):
    """The single-engine client (what each worker runs): a request's n choices of one long prompt,
    streamed or not, are prefilled once (n - 1 restore the first's blocks: the engine's hit counter),
    with the tokens of the engine's own ``generate``."""
    import asyncio

    from megak3.inference.engine_client import EngineClient, Request

    c, client, engine, tok = replicated
    prompts = [tok.encode(f"class Shape{i}: def area(self): return self.w * self.h  # in square units, rounded")
               for i in range(2)]
    sps = [SamplingParams(max_tokens=4, temperature=0.9, seed=k, ignore_eos=True) for k in range(3)]
    ec = EngineClient(engine)
    try:
        before = ec.cache_stats()["hit_tokens"]

        async def go():
            got = [r.completion.token_ids for r in await ec.generate([Request(prompts[0], sp) for sp in sps])]
            ss = ec.streams([Request(prompts[1], sp) for sp in sps])
            return got, [[t async for t, _, _ in s] for s in ss]

        got, streamed = asyncio.run(go())
        gained = ec.cache_stats()["hit_tokens"] - before
    finally:
        ec.close()
    assert got == [x.token_ids for x in engine.generate([prompts[0]] * 3, sps)]
    assert streamed == [x.token_ids for x in engine.generate([prompts[1]] * 3, sps)]
    assert gained >= 2 * 2 * ((len(prompts[0]) - 1) // INTERVAL * INTERVAL - INTERVAL) > 0, gained


def _kill_replica_0_during(c, client, body):
    """POST ``body`` routed to replica 0, SIGKILL that worker while the request is in flight; the response."""
    old_pid = client.reps[0].pid
    os.kill(old_pid, signal.SIGSTOP)          # hold it so that the request is in flight when it dies
    result = {}

    def post():
        result["r"] = c.post("/v1/completions", json=body)

    client.router.load[1] += 10 ** 6          # make replica 0 the router's choice
    try:
        t = threading.Thread(target=post)
        t.start()
        deadline = time.time() + 30
        while not any(call.replica == 0 for call in client.pending.values()) and time.time() < deadline:
            time.sleep(0.02)
        os.kill(old_pid, signal.SIGKILL)
        t.join(60)
    finally:
        client.router.load[1] -= 10 ** 6
    deadline = time.time() + 120
    while client.replicas_up() < 2 and time.time() < deadline:
        time.sleep(0.1)
    assert client.replicas_up() == 2 and client.reps[0].pid != old_pid
    return result["r"]


def test_a_killed_worker_fails_its_request_and_is_restarted(replicated):
    c, client, engine, tok = replicated
    body = {"prompt": "def", "max_tokens": 4, "temperature": 0}
    r = _kill_replica_0_during(c, client, body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert "replica 0" in r.json()["error"]["message"]
    assert client.reps[0].restarts == 1 and c.get("/health").json()["replicas_up"] == 2
    r = _kill_replica_0_during(c, client, {**body, "stream": True})
    if r.headers["content-type"].startswith("application/json"):       # died before the first token: the
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text  # headers wait for it
    else:                                                               # after it: an error event, then [DONE]
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error", r.text
    assert client.reps[0].restarts == 2
    for _ in range(2):                                                  # and the server goes on
        ok = c.post("/v1/completions", json=body)
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["text"] == engine.generate([tok.encode("def")],
                                                                  SamplingParams(max_tokens=4))[0].text


def test_bad_replicas_values_are_one_line(tmp_path, capsys):
    from megak3.inference.cli import main

    for argv, needle in ((["--replicas", "0"], "--replicas 0 must be"), (["--replicas", "two"], "--replicas"),
                         (["--replicas", "-3"], "--replicas -3 must be"),
                         (["--checkpoint-interval", "20"], "--checkpoint-interval 20"),
                         (["--replicas", "2"], "holds no complete megak3 checkpoint")):   # before any worker
        try:
            rc = main(["serve", "--checkpoint", str(tmp_path), "--port", "0", *argv])
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and needle in err, err


@pytest.mark.slow
def test_replicas_as_ray_actors_equal_one_engine(tmp_path):
    """``--ray-address local``: the same worker under a Ray actor (a local Ray instance on loopback); a
    client that goes away, streamed or not, aborts its sequence in the actor's worker."""
    ray = pytest.importorskip("ray")
    import asyncio

    from megak3.inference.engine_client import ClientDisconnected, Request
    from megak3.inference.replicas import ReplicaClient

    run, model, tok = make_tiny_run(tmp_path / "run", max_seq_len=2048)   # room for a long generation
    engine = Engine.from_pretrained(str(run))
    started_here = not ray.is_initialized()
    client = ReplicaClient(str(run), 2, ray_address="local", checkpoint_interval=INTERVAL)
    try:
        prompts = [tok.encode(p) for p in ("def main(", "class Point:", "the quick brown")]
        sp = SamplingParams(max_tokens=6, temperature=0.8, seed=3)

        async def go():
            return await asyncio.gather(*(client.generate([Request(p, sp)]) for p in prompts))

        got = [r[0].completion.token_ids for r in asyncio.run(go())]
        assert got == [c.token_ids for c in engine.generate(prompts, [sp] * 3)]
        assert min(client.router.stats.per_replica_work) > 0 and client.replicas_up() == 2
        # echo scoring through an actor's worker (a served MOPD teacher): the training forward's logprobs
        seqs = [p + [5, 6] for p in prompts]
        scored = asyncio.run(client.score(seqs, 0.7))
        for s, got in zip(seqs, scored):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([s[:-1]])).logits[0].float() / 0.7, -1)
            want = lp.gather(-1, torch.tensor(s[1:])[:, None])[:, 0]
            assert len(got) == len(s) - 1 and (torch.tensor(got) - want).abs().max() <= 1e-5
        # disconnects (what the server does when its client hangs up; HTTP: tests/test_replicas_disconnect.py)
        long = SamplingParams(max_tokens=2000, ignore_eos=True)

        def total(key):
            return sum(client.replica_stats(k).get(key, 0) for k in range(2))

        async def hang_up_stream():
            agen = client.stream(Request(prompts[0], long))
            await agen.__anext__()                                  # mid-generation
            await agen.aclose()

        async def gone():
            return sum(r.running for r in client.reps) > 0          # admitted: the client goes away

        async def hang_up_generate():
            with pytest.raises(ClientDisconnected):
                await client.generate([Request(prompts[1], long)], disconnected=gone)

        for hang_up in (hang_up_stream, hang_up_generate):
            aborted = total("aborted_sequences")
            asyncio.run(hang_up())
            deadline = time.time() + 30
            while not (total("aborted_sequences") == aborted + 1 and total("live_sequences") == 0
                       and all(r.running == r.calls == 0 for r in client.reps)) and time.time() < deadline:
                time.sleep(0.05)
            assert total("aborted_sequences") == aborted + 1 and total("live_sequences") == 0, hang_up
            assert all(r.running == r.calls == 0 for r in client.reps) and client.router.load == [0, 0]
            assert total("pages_available") == client.num_pages and not client.pending
    finally:
        client.close()
        if started_here:
            ray.shutdown()


def test_wire_carries_data_only():
    """Requests, results and image tensors go through JSON and come back equal; bad values are refused
    by the worker's SamplingParams check; unknown sampling fields are dropped; no pickle anywhere."""
    import socket

    import torch

    from megak3.inference.engine_client import Request, Result
    from megak3.inference.replica_wire import (WireClosed, recv, request_in, request_out, result_in, result_out,
                                               send)
    from megak3.inference.types import Completion, InferenceError

    ims = [torch.randn(3, 8, 8), torch.randn(3, 4, 4).bfloat16()]
    sp = SamplingParams(max_tokens=3, temperature=0.5, top_k=4, seed=9, stop=("x",), stop_token_ids=(2,))
    r = Request([1, 2, 3], sp, ims, 2)
    a, b = socket.socketpair()
    send(a, {"op": "generate", "reqs": [request_out(r)]})
    back = request_in(recv(b)["reqs"][0])
    assert back.prompt == [1, 2, 3] and back.params == sp and back.top_logprobs == 2
    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(ims, back.images))
    res = Result(Completion([1], [4, 5], [-0.5, -1.25], "length", "ab"), [[(4, -0.5), (6, -0.75)], [(5, -1.25)]])
    assert result_in(result_out(res)) == res
    bad = request_out(r)
    bad["params"]["temperature"] = -1
    bad["params"]["__class__"] = "os.system"
    with pytest.raises(InferenceError, match="temperature"):
        request_in(bad)
    a.sendall(b"\x00\x00\x00\x05[1,2]")
    with pytest.raises(WireClosed, match="not a JSON object"):
        recv(b)
    a.close()
    with pytest.raises(WireClosed):
        recv(b)


@pytest.mark.slow
def test_chat_images_through_a_replica_equal_the_training_forward(tmp_path):
    """An image in a chat message crosses the wire as data and gives the training forward's greedy
    tokens; a second turn with the same image returns to its replica, which reports a prefix hit."""
    import base64

    from fastapi.testclient import TestClient

    from megak3.inference.replicas import ReplicaClient
    from test_server import _image_reference, _png, shown

    run, model, tok = make_tiny_run(tmp_path / "run", max_seq_len=160, **{"vision.enabled": True})
    client = ReplicaClient(str(run), 2, checkpoint_interval=INTERVAL)
    client.router.balance = 1e9        # affinity only (the load guard is tests/test_router.py's)
    raw = _png(1)
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    with TestClient(make_app(None, "tiny", client=client)) as c:
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what is it"}]}]
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        assert text == shown(tok, _image_reference(model, tok, "what is it", raw, 4))
        k = client.last_replica
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "and then"}]
        r2 = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "temperature": 0})
        assert r2.status_code == 200 and client.last_replica == k
        deadline = time.time() + 10
        while not client.replica_stats(k).get("hit_tokens") and time.time() < deadline:
            time.sleep(0.05)
        assert client.replica_stats(k)["hit_tokens"] > 0 and client.router.stats.per_replica_reused[k] > 0
