"""The OpenAI-style HTTP server (megak3/inference/server.py), driven by a real HTTP client (http.client)
against a server on 127.0.0.1 at an ephemeral port: completions equal the full-recompute greedy loop,
chat renders the plain template, concurrent requests are answered, streaming sends the same text in
pieces, bad requests get HTTP 400 with a JSON message and the server keeps serving."""
import http.client
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megak3.inference import Engine
from megak3.inference.server import make_server
from megak3.data.chat import generation_prompt
from test_generate_cli import greedy_reference, make_tiny_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    run, model, tok = make_tiny_run(tmp_path_factory.mktemp("run"))
    engine = Engine.from_pretrained(str(run))
    srv = _start(engine)
    yield srv.server_address[1], model, tok, engine
    srv.shutdown()
    srv.server_close()


def _start(engine):
    srv = make_server(engine, "127.0.0.1", 0, model_name="tiny")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def _call(port, method, path, body=None, raw=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.status, r.getheader("Content-Type"), r.read()
    c.close()
    return out


def _json(port, method, path, body=None, raw=None):
    status, ctype, data = _call(port, method, path, body, raw)
    assert ctype == "application/json", (status, ctype, data)
    return status, json.loads(data)


def test_models_and_greedy_completions(served):
    port, model, tok, _ = served
    st, m = _json(port, "GET", "/v1/models")
    assert st == 200 and m["data"][0]["id"] == "tiny" and m["data"][0]["max_model_len"] == 96
    prompts = ["def main(", "class Point:"]
    st, r = _json(port, "POST", "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 8,
                                                     "temperature": 0, "logprobs": 1})
    assert st == 200 and r["object"] == "text_completion" and len(r["choices"]) == 2
    for p, ch in zip(prompts, r["choices"]):
        ref = greedy_reference(model, tok.encode(p), 8, eos=tok.eos_id)
        shown = ref[:-1] if ref[-1] == tok.eos_id else ref
        assert ch["text"] == tok.decode(shown)
        assert ch["finish_reason"] == ("stop" if ref[-1] == tok.eos_id else "length")
        assert len(ch["logprobs"]["token_logprobs"]) == len(ref)
    assert r["usage"]["prompt_tokens"] == sum(len(tok.encode(p)) for p in prompts)
    # token-id prompts are the same request
    st, r2 = _json(port, "POST", "/v1/completions", {"prompt": [tok.encode(p) for p in prompts], "max_tokens": 8,
                                                      "temperature": 0})
    assert [c["text"] for c in r2["choices"]] == [c["text"] for c in r["choices"]]


def test_chat_and_concurrent_requests(served):
    port, model, tok, _ = served
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def main("}]
    st, r = _json(port, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                          "logprobs": True})
    assert st == 200 and r["object"] == "chat.completion"
    ref = greedy_reference(model, generation_prompt(tok, msgs), 6, eos=tok.eos_id)   # the SFT template
    assert r["choices"][0]["message"] == {"role": "assistant",
                                          "content": tok.decode(ref[:-1] if ref[-1] == tok.eos_id else ref)}
    assert len(r["choices"][0]["logprobs"]["content"]) == len(ref)
    # eight clients at once, with seeds: every one gets its own answer, the same as alone
    bodies = [{"prompt": f"the quick {i}", "max_tokens": 5, "temperature": 1.0, "seed": i} for i in range(8)]
    alone = [_json(port, "POST", "/v1/completions", b)[1]["choices"][0]["text"] for b in bodies[:2]]
    got = [None] * 8

    def worker(i):
        got[i] = _json(port, "POST", "/v1/completions", bodies[i])

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert all(g is not None and g[0] == 200 for g in got)
    assert [g[1]["choices"][0]["text"] for g in got[:2]] == alone


def _sse(port, path, body):
    st, ctype, data = _call(port, "POST", path, body)
    assert st == 200 and ctype == "text/event-stream", (st, data)
    events = [ln[len("data: "):] for ln in data.decode().split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_sends_the_same_text(served):
    port, model, tok, _ = served
    body = {"prompt": "def main(", "max_tokens": 10, "temperature": 0}
    full = _json(port, "POST", "/v1/completions", body)[1]["choices"][0]
    ev = _sse(port, "/v1/completions", {**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in ev) == full["text"]
    assert ev[-1]["choices"][0]["finish_reason"] == full["finish_reason"]
    assert len(ev) > 2                                                        # in pieces, not one
    stop = full["text"][2:4]
    ev = _sse(port, "/v1/completions", {**body, "stream": True, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in ev) == full["text"][:full["text"].find(stop)]
    assert ev[-1]["choices"][0]["finish_reason"] == "stop"
    ch = _sse(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                             "temperature": 0, "stream": True})
    assert ch[0]["choices"][0]["delta"] == {"role": "assistant"} and ch[-1]["choices"][0]["finish_reason"]


def test_bad_requests_get_400_and_the_server_keeps_serving(served):
    port, _, tok, _ = served
    long_prompt = "the quick brown fox " * 60
    cases = [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 2}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "top_k": "a"}, "top_k"),
        ({"prompt": "x", "seed": -3}, "seed"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": long_prompt}, "prompt"),
        ({"prompt": [999999]}, "prompt"),
        ({"prompt": 12}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "stream": True, "temperature": -1}, "temperature"),
    ]
    for body, param in cases:
        st, r = _json(port, "POST", "/v1/completions", body)
        assert st == 400 and r["error"]["param"] == param and r["error"]["type"] == "invalid_request_error", (body, r)
        assert r["error"]["message"] and "\n" not in r["error"]["message"]
    for raw in (b"{not json", b"[1, 2]"):
        st, r = _json(port, "POST", "/v1/completions", raw=raw)
        assert st == 400 and "JSON" in r["error"]["message"]
    st, r = _json(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user"}]})
    assert st == 400 and r["error"]["param"] == "messages"
    st, r = _json(port, "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert st == 404 and "gpt-9" in r["error"]["message"]
    st, r = _json(port, "POST", "/v1/nothing", {"prompt": "x"})
    assert st == 404
    # still serving
    st, r = _json(port, "POST", "/v1/completions", {"prompt": "def", "max_tokens": 2, "temperature": 0})
    assert st == 200 and r["choices"][0]["finish_reason"] in ("stop", "length")


def test_serve_command_starts_and_refuses_a_bad_checkpoint(tmp_path, capsys):
    from megak3.inference.cli import main

    for argv, needle in ((["serve", "--checkpoint", str(tmp_path / "none"), "--port", "0"], "no such"),
                         (["serve", "--checkpoint", str(tmp_path), "--port", "70000"], "--port")):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and needle in err, err
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    run, model, tok = make_tiny_run(tmp_path / "run")
    p = subprocess.Popen([sys.executable, "-m", "megak3.generate", "serve", "--checkpoint", str(run), "--port", "0",
                          "--model-name", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        assert line.startswith("serving tiny on http://127.0.0.1:"), (line, p.stderr.read() if p.poll() else "")
        port = int(line.split("http://127.0.0.1:")[1].split(" ")[0])
        deadline = time.time() + 30
        st, r = _json(port, "POST", "/v1/completions", {"prompt": "def", "max_tokens": 3, "temperature": 0})
        ref = greedy_reference(model, tok.encode("def"), 3, eos=tok.eos_id)
        assert st == 200 and time.time() < deadline
        assert r["choices"][0]["text"] == tok.decode(ref[:-1] if ref[-1] == tok.eos_id else ref)
    finally:
        p.terminate()
        p.wait(30)


class _GatedEngine:
    """The real engine, with its first generate call held until ``release`` is set; records the
    number of prompts of every call."""

    def __init__(self, engine):
        self.engine, self.calls, self.release = engine, [], threading.Event()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        if len(self.calls) == 1:
            assert self.release.wait(60)
        return self.engine.generate(prompts, params)


def test_requests_that_arrive_together_share_one_engine_call(served):
    _, model, tok, engine = served
    gated = _GatedEngine(engine)
    srv = _start(gated)
    port = srv.server_address[1]
    try:
        prompts = [f"the quick {i}" for i in range(6)]
        got = {}

        def worker(i):
            got[i] = _json(port, "POST", "/v1/completions", {"prompt": prompts[i], "max_tokens": 4, "temperature": 0})

        first = threading.Thread(target=worker, args=(0,))
        first.start()
        deadline = time.time() + 30
        while not gated.calls and time.time() < deadline:
            time.sleep(0.01)
        rest = [threading.Thread(target=worker, args=(i,)) for i in range(1, 6)]
        for t in rest:
            t.start()
        batcher = srv.RequestHandlerClass.service.batcher
        while batcher.q.qsize() < 5 and time.time() < deadline:
            time.sleep(0.01)
        gated.release.set()
        for t in [first] + rest:
            t.join(60)
        assert gated.calls == [1, 5]                          # the five waiting requests went in one call
        for i, p in enumerate(prompts):
            ref = greedy_reference(model, tok.encode(p), 4, eos=tok.eos_id)
            assert got[i][0] == 200
            assert got[i][1]["choices"][0]["text"] == tok.decode(ref[:-1] if ref[-1] == tok.eos_id else ref)
    finally:
        gated.release.set()
        srv.shutdown()
        srv.server_close()
