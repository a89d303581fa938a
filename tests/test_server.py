"""The OpenAI server (megak3/inference/server.py on FastAPI): completions, chat, n, seeds, logprobs and
top_logprobs (also streamed) against the training forward; concurrent requests and streams sharing
engine steps; an engine refusal of a stream as a 400 JSON; Prometheus metrics; images in chat
messages. Driven by FastAPI's TestClient, plus one real uvicorn socket (streaming in pieces, a client
that disconnects, streamed or not, aborts its sequence) and the real
``python -m megak3.generate serve`` process. Malformed requests: tests/test_server_errors.py."""
import base64
import http.client
import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megak3.data.chat import generation_prompt
from megak3.inference import Engine
from megak3.inference.server import bind, make_app, uvicorn_server
from test_generate_cli import greedy_reference, make_tiny_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from fastapi.testclient import TestClient

    run, model, tok = make_tiny_run(tmp_path_factory.mktemp("run"))
    engine = Engine.from_pretrained(str(run))
    app = make_app(engine, "tiny")
    with TestClient(app) as client:
        yield client, model, tok, engine, app


def shown(tok, ref):
    return tok.decode(ref[:-1] if ref and ref[-1] == tok.eos_id else ref)


def sse_events(text: str):
    events = [ln[len("data: "):] for ln in text.split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def training_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def test_models_and_greedy_completions_with_top_logprobs(served):
    c, model, tok, _, _ = served
    m = c.get("/v1/models").json()
    assert m["data"][0]["id"] == "tiny" and m["data"][0]["max_model_len"] == 96
    prompts = ["def main(", "class Point:"]
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 8, "temperature": 0,
                                        "logprobs": 3})
    assert r.status_code == 200, r.text
    r = r.json()
    assert r["object"] == "text_completion" and len(r["choices"]) == 2
    for p, ch in zip(prompts, r["choices"]):
        ids = tok.encode(p)
        ref = greedy_reference(model, ids, 8, eos=tok.eos_id)
        assert ch["text"] == shown(tok, ref)
        assert ch["finish_reason"] == ("stop" if ref[-1] == tok.eos_id else "length")
        lp = training_logprobs(model, ids + ref)
        for i, t in enumerate(ref):            # chosen and top-3 logprobs equal the training forward's
            row = lp[len(ids) - 1 + i]
            assert ch["logprobs"]["token_logprobs"][i] == pytest.approx(float(row[t]), abs=1e-4)
            top = sorted(ch["logprobs"]["top_logprobs"][i].values(), reverse=True)   # a dict by token text:
            want = [float(v) for v in row.topk(3).values]          # alternatives that decode alike share a key
            assert top[0] == pytest.approx(want[0], abs=1e-4)
            assert all(min(abs(v - w) for w in want) < 1e-4 for v in top)
    assert r["usage"]["prompt_tokens"] == sum(len(tok.encode(p)) for p in prompts)
    r2 = c.post("/v1/completions", json={"prompt": [tok.encode(p) for p in prompts], "max_tokens": 8,
                                         "temperature": 0}).json()
    assert [x["text"] for x in r2["choices"]] == [x["text"] for x in r["choices"]]
    r3 = c.post("/v1/completions", json={"prompt": "", "max_tokens": 3, "temperature": 0}).json()   # = [eos]
    assert r3["choices"][0]["text"] == shown(tok, greedy_reference(model, [tok.eos_id], 3, eos=tok.eos_id))


def test_n_and_seeds(served):
    c, _, _, _, _ = served
    body = {"prompt": ["the quick", "def"], "max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    r = c.post("/v1/completions", json={**body, "n": 3}).json()
    assert [x["index"] for x in r["choices"]] == list(range(6))
    # choice k = prompt k // n, copy k % n, sampled with seed + k: the same as a request of its own
    for k in (0, 2, 4):
        alone = c.post("/v1/completions", json={**body, "prompt": body["prompt"][k // 3], "seed": 11 + k}).json()
        assert alone["choices"][0]["text"] == r["choices"][k]["text"]
    assert len({x["text"] for x in r["choices"][:3]}) > 1
    assert r["usage"]["completion_tokens"] == 36
    assert r["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"] + len(served[2].encode("the quick"))


def test_chat_and_concurrent_requests(served):
    c, model, tok, _, _ = served
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def main("}]
    r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0, "logprobs": True,
                                             "top_logprobs": 2}).json()
    assert r["object"] == "chat.completion"
    ids = generation_prompt(tok, msgs)
    ref = greedy_reference(model, ids, 6, eos=tok.eos_id)   # the SFT template
    assert r["choices"][0]["message"] == {"role": "assistant", "content": shown(tok, ref)}
    content = r["choices"][0]["logprobs"]["content"]
    lp = training_logprobs(model, ids + ref)
    assert len(content) == len(ref)
    for i, e in enumerate(content):
        assert [x["logprob"] for x in e["top_logprobs"]] == pytest.approx(
            [float(v) for v in lp[len(ids) - 1 + i].topk(2).values], abs=1e-4)
    # parts: text parts joined with newlines render as the same conversation
    parts = [{"role": "user", "content": [{"type": "text", "text": "def"}, {"type": "text", "text": "main("}]}]
    rp = c.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 4, "temperature": 0}).json()
    ref = greedy_reference(model, generation_prompt(tok, [{"role": "user", "content": "def\nmain("}]), 4, tok.eos_id)
    assert rp["choices"][0]["message"]["content"] == shown(tok, ref)
    bodies = [{"prompt": f"the quick {i}", "max_tokens": 5, "temperature": 1.0, "seed": i} for i in range(8)]
    alone = [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies[:2]]
    got = [None] * 8

    def worker(i):
        got[i] = c.post("/v1/completions", json=bodies[i])

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert all(g is not None and g.status_code == 200 for g in got)
    assert [g.json()["choices"][0]["text"] for g in got[:2]] == alone


def test_streams_send_the_same_text_and_logprobs(served):
    c, model, tok, _, _ = served
    body = {"prompt": "def main(", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    full = c.post("/v1/completions", json=body).json()["choices"][0]
    r = c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse_events(r.text)
    usage = ev.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(full["logprobs"]["tokens"])
    assert "".join(e["choices"][0]["text"] for e in ev) == full["text"]
    assert ev[-1]["choices"][0]["finish_reason"] == full["finish_reason"]
    assert len(ev) > 2
    lps = [v for e in ev if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps == pytest.approx(full["logprobs"]["token_logprobs"], abs=1e-5)
    tops = [v for e in ev if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"]["top_logprobs"]]
    assert [sorted(t.values()) for t in tops] == [pytest.approx(sorted(t.values()), abs=1e-5)
                                                  for t in full["logprobs"]["top_logprobs"]]
    stop = full["text"][2:4]
    ev = sse_events(c.post("/v1/completions", json={**body, "stream": True, "stop": stop}).text)
    assert "".join(e["choices"][0]["text"] for e in ev) == full["text"][:full["text"].find(stop)]
    assert ev[-1]["choices"][0]["finish_reason"] == "stop"
    ev = sse_events(c.post("/v1/completions", json={"prompt": "def", "n": 2, "max_tokens": 3, "temperature": 0,
                                                    "stream": True}).text)
    assert {e["choices"][0]["index"] for e in ev} == {0, 1}
    ch = sse_events(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 4, "temperature": 0, "stream": True,
                                                         "logprobs": True}).text)
    assert ch[0]["choices"][0]["delta"] == {"role": "assistant"} and ch[-1]["choices"][0]["finish_reason"]
    assert sum(len(e["choices"][0]["logprobs"]["content"]) for e in ch if e["choices"][0]["logprobs"]) >= 1


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_what_was_served(served):
    c, _, _, engine, _ = served
    before = c.get("/metrics").text
    r = c.post("/v1/completions", json={"prompt": "def main(", "max_tokens": 5, "temperature": 0,
                                        "ignore_eos": True}).json()
    c.post("/v1/completions", json={"prompt": "def main(", "max_tokens": 3, "temperature": 0, "stream": True})
    c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0})
    after = c.get("/metrics")
    assert after.headers["content-type"].startswith("text/plain")
    a = after.text
    assert _metric(a, "megak3_generation_tokens_total") - _metric(before, "megak3_generation_tokens_total") == 8
    assert r["usage"]["completion_tokens"] == 5
    assert _metric(a, "megak3_time_to_first_token_seconds_count") == \
        _metric(before, "megak3_time_to_first_token_seconds_count") + 2   # streamed or not: every request
    assert _metric(a, 'megak3_requests_total{status="400"}') >= 1
    assert _metric(a, "megak3_requests_running") == 0 and _metric(a, "megak3_requests_waiting") == 0
    assert 0 < _metric(a, "megak3_cache_pages_peak") == engine.cache_stats()["peak_pages"]
    assert 0 <= _metric(a, "megak3_cache_pages_used") <= _metric(a, "megak3_cache_pages_total") == engine.cache.cfg.num_pages
    assert 0 <= _metric(a, "megak3_prefix_cache_hit_rate") <= 1
    assert c.get("/health").json() == {"status": "ok", "replicas": 1, "replicas_up": 1}
    schema = c.get("/openapi.json").json()            # the pydantic models are the published schema
    assert "/v1/chat/completions" in schema["paths"] and "ChatCompletionRequest" in schema["components"]["schemas"]


class _GatedEngine:
    """The real engine, its first ``step`` held until ``gate`` is set (later steps sleep ``delay``);
    records the prompt of every ``begin``, its handle, and the handles and tokens of every step."""

    def __init__(self, engine, delay=0.0):
        self.engine, self.gate, self.delay = engine, threading.Event(), delay
        self.begun, self.handles, self.calls, self.made = [], [], [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def begin(self, prompt, params, images=None):
        h = self.engine.begin(prompt, params, images)
        self.begun.append(list(prompt))
        self.handles.append(h)
        return h

    def step(self, handles=None):
        self.calls.append(len(handles))
        if len(self.calls) == 1:
            assert self.gate.wait(60)
        time.sleep(self.delay)
        out = self.engine.step(handles)
        self.made.append(len(out))
        return out


def _wait(cond, what, timeout=30):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.01)


def test_requests_that_arrive_together_share_one_engine_step(served):
    from fastapi.testclient import TestClient

    _, model, tok, engine, _ = served
    gated = _GatedEngine(engine)
    app = make_app(gated, "tiny")
    with TestClient(app) as c:
        prompts = [f"the quick {i}" for i in range(6)]
        got = {}

        def worker(i):
            got[i] = c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 4, "temperature": 0})

        first = threading.Thread(target=worker, args=(0,))
        first.start()
        _wait(lambda: gated.calls, "first step")
        rest = [threading.Thread(target=worker, args=(i,)) for i in range(1, 6)]
        for t in rest:
            t.start()
        _wait(lambda: app.state.client.q.qsize() == 5, "five queued")
        gated.gate.set()
        for t in [first] + rest:
            t.join(60)
        assert gated.calls[:2] == [1, 6]              # the five waiting requests joined the running one
        for i, p in enumerate(prompts):
            ref = greedy_reference(model, tok.encode(p), 4, eos=tok.eos_id)
            assert got[i].status_code == 200 and got[i].json()["choices"][0]["text"] == shown(tok, ref)


def test_concurrent_streams_share_decode_steps(served):
    """4 streams that arrive together finish in fewer engine steps than two run one after another
    (alone each takes 1 prefill step + 7 decode steps), with 4 tokens made by one step."""
    from fastapi.testclient import TestClient

    _, model, tok, engine, _ = served
    gated = _GatedEngine(engine)
    app = make_app(gated, "tiny")
    prompts = ["def main(", "class Point:", "the quick", "import os"]
    got = {}
    with TestClient(app) as c:
        def worker(i):
            got[i] = c.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 8, "temperature": 0,
                                                     "ignore_eos": True, "stream": True})

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        ts[0].start()
        _wait(lambda: gated.calls, "first step")
        for t in ts[1:]:
            t.start()
        _wait(lambda: app.state.client.q.qsize() == 3, "three queued")
        gated.gate.set()
        for t in ts:
            t.join(60)
    assert sum(gated.made) == 32 and len(gated.calls) < 16 and max(gated.made) == 4, (gated.calls, gated.made)
    for i, p in enumerate(prompts):
        text = "".join(e["choices"][0]["text"] for e in sse_events(got[i].text))
        assert text == tok.decode(greedy_reference(model, tok.encode(p), 8))


def test_an_engine_refusal_of_a_stream_is_a_400_json_before_any_event(served):
    from fastapi.testclient import TestClient

    _, model, tok, _, _ = served
    small = Engine(model, tok, num_pages=3)            # 48 tokens of pool: a 60-token request never fits
    with TestClient(make_app(small, "tiny")) as c:
        for stream in (True, False):
            r = c.post("/v1/completions", json={"prompt": "def", "max_tokens": 60, "stream": stream})
            assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
            assert "num_pages" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"prompt": "def", "max_tokens": 3, "temperature": 0, "stream": True})
        assert r.status_code == 200 and sse_events(r.text)[-1]["choices"][0]["finish_reason"]
        assert not small.live()


def _post(port, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def test_uvicorn_socket_streams_in_pieces_and_a_disconnect_aborts_the_sequence(served):
    _, model, tok, engine, _ = served
    gated = _GatedEngine(engine, delay=0.05)
    gated.gate.set()
    app = make_app(gated, "tiny")
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn_server(app)
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()

    def hang_up_after_tokens(body, tokens):
        n = len(gated.handles)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        if body.get("stream"):
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
            assert resp.readline().startswith(b"data: {")   # the first event arrives before the stream ends
        _wait(lambda: len(gated.handles) > n and len(gated.handles[n].token_ids) >= tokens, "tokens made")
        h = gated.handles[n]
        conn.sock.shutdown(2)
        conn.close()
        _wait(lambda: h.finish_reason == "abort", "aborted")   # streamed or not: the engine aborted it
        assert len(h.token_ids) < 80 and h not in engine.live() and not engine.cache.seqs

    try:
        body = {"prompt": "def", "max_tokens": 80, "temperature": 0, "ignore_eos": True}
        hang_up_after_tokens({**body, "stream": True}, 1)
        hang_up_after_tokens(body, 3)                     # a non-streamed request, mid-decode
        # a queued request whose client went away is dropped: hold one engine step, queue a second, hang up
        gated.calls.clear()
        gated.gate.clear()
        begun = len(gated.begun)
        held = threading.Thread(target=lambda: _post(port, {"prompt": "a", "max_tokens": 2}), daemon=True)
        held.start()
        _wait(lambda: gated.calls, "held step")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "b", "max_tokens": 2}).encode(),
                     headers={"Content-Type": "application/json"})
        _wait(lambda: app.state.client.q.qsize() >= 1, "queued")
        conn.sock.shutdown(2)
        conn.close()
        time.sleep(1.0)                                 # the server polls for a disconnect every 0.25 s
        gated.gate.set()
        held.join(60)
        assert gated.begun[begun:] == [tok.encode("a")]   # the hung-up request never reached the engine
        # and the server goes on serving
        r = _post(port, {"prompt": "def", "max_tokens": 3, "temperature": 0})
        assert r["choices"][0]["text"] == shown(tok, greedy_reference(model, tok.encode("def"), 3, tok.eos_id))
    finally:
        server.should_exit = True
        th.join(30)


# ------------------------------------------------------------------------------------------------ images
def _png(seed: int, size=(56, 56)) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vision_served(tmp_path_factory):
    from fastapi.testclient import TestClient

    root = tmp_path_factory.mktemp("vision")
    run, model, tok = make_tiny_run(root / "run", max_seq_len=160, **{"vision.enabled": True})
    media = root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(_png(1))
    (root / "secret.png").write_bytes(_png(2))
    os.symlink(root / "secret.png", media / "link.png")
    engine = Engine.from_pretrained(str(run))
    with TestClient(make_app(engine, "tiny", allowed_media_dir=str(media))) as client:
        yield client, model, tok, media


def _image_reference(model, tok, text, raw, n):
    from megak3.inference.media import image_slots, image_tensor

    im = image_tensor(raw, model.config)
    ids = generation_prompt(tok, [{"role": "user", "content": text, "images": ["x"]}], [image_slots(im, model.config)])
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids + out]), images=[im]).logits[0, -1].argmax())
            out.append(t)
            if t == tok.eos_id:
                break
    return out


def test_chat_images_from_data_urls_and_allowed_files(vision_served):
    c, model, tok, media = vision_served

    def ask(url):
        return c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it"}]}],
            "max_tokens": 4, "temperature": 0})

    raws = [_png(1), _png(3)]
    texts = []
    for raw in raws:   # the same text with two images: each equals the training forward with its image
        r = ask("data:image/png;base64," + base64.b64encode(raw).decode())
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["message"]["content"])
        assert texts[-1] == shown(tok, _image_reference(model, tok, "what is it", raw, 4))
    r = ask(f"file://{media / 'a.png'}")               # the same bytes as raws[0], from the allowed directory
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == texts[0]
    for url, needle in ((f"file://{media.parent / 'secret.png'}", "allowed-local-media-path"),
                        (f"file://{media / 'link.png'}", "allowed-local-media-path"),   # a symlink out of it
                        (f"file://{media / 'none.png'}", "no such"),
                        ("http://127.0.0.1/a.png", "fetches nothing"),
                        ("data:image/png;base64,@@@", "base64"),
                        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not a usable image")):
        r = ask(url)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (url, r.text)
        assert r.json()["error"]["param"].startswith("messages[0].content[0]")
    assert str(media.parent) not in json.dumps(r.json())


def test_images_refused_without_a_vision_tower_or_a_media_directory(served, vision_served):
    c = served[0]
    url = "data:image/png;base64," + base64.b64encode(_png(1)).decode()
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]})
    assert r.status_code == 400 and "vision" in r.json()["error"]["message"]
    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]})
    assert r.status_code == 400 and "--allowed-local-media-path" in r.json()["error"]["message"]


def test_serve_command_starts_and_refuses_bad_options(tmp_path, capsys):
    from megak3.inference.cli import main

    for argv, needle in ((["serve", "--checkpoint", str(tmp_path / "none"), "--port", "0"], "no such"),
                         (["serve", "--checkpoint", str(tmp_path), "--port", "70000"], "--port"),
                         (["serve", "--checkpoint", str(tmp_path), "--allowed-local-media-path",
                           str(tmp_path / "nope")], "--allowed-local-media-path")):
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
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "def", "max_tokens": 3,
                                                                 "temperature": 0}).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        r = json.loads(resp.read())
        assert resp.status == 200
        assert r["choices"][0]["text"] == shown(tok, greedy_reference(model, tok.encode("def"), 3, tok.eos_id))
        conn.request("DELETE", "/v1/completions")
        resp = conn.getresponse()
        assert resp.status == 405 and json.loads(resp.read())["error"]["message"]
    finally:
        p.terminate()
        p.wait(30)
