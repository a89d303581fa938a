"""Malformed requests, generated: every request field of completions and chat completions with every
JSON type it does not take and the values just outside its range, empty and malformed messages and
content parts, bodies that are not JSON objects, unknown routes, wrong methods, oversize prompts and
bodies. Each one must get a 4xx with OpenAI's JSON error (``param`` naming the field where there is
one), streamed or not, and the server must answer a greedy request correctly afterwards."""
import json

import pytest

from megak3.inference import Engine
from megak3.inference.server import MAX_BODY_BYTES, make_app
from test_generate_cli import greedy_reference, make_tiny_run

# one value of every JSON type; a field's wrong types are those outside its own kinds
SAMPLES = {"str": "yes", "int": 1, "float": 0.5, "bool": True, "list": [1], "dict": {"a": 1}, "null": None}
INT, FLOAT, BOOL, STR = ("int", "null"), ("int", "float", "null"), ("bool", "null"), ("str", "null")
COMMON = {
    "model": (STR, ["gpt-9"]),
    "max_tokens": (INT, [0, -1, 2.0]),
    "temperature": (FLOAT, [-0.01, 2.5, float("inf")]),
    "top_p": (FLOAT, [0, 1.01, -1]),
    "top_k": (INT, [-1]),
    "seed": (INT, [-1, 2 ** 63]),
    "stop": (("str", "null"), ["", [""], ["a"] * 5, [1]]),
    "n": (INT, [0, 17]),
    "stream": (BOOL, []),
    "stream_options": (("dict", "null"), [{"include_usage": 1}, {"foo": True}]),
    "presence_penalty": (FLOAT, [0.5, 3]),
    "frequency_penalty": (FLOAT, [-0.5, -3]),
    "logit_bias": (("dict", "null"), [{"5": 1.0}, {"5": "x"}]),
    "user": (STR, []),
    "ignore_eos": (BOOL, []),
}
COMPLETION = {**COMMON, "prompt": (("str", "list"), [[], [[]], [-1], [True], ["a", 1], [[1], "a"], [99999]]),
              "logprobs": (INT, [-1, 6]), "echo": (BOOL, [True]), "suffix": (STR, ["tail"]),
              "best_of": (INT, [0, 2, 17])}
CHAT = {**COMMON, "messages": (("list",), [[], [1], ["hi"]]), "max_completion_tokens": (INT, [0]),
        "logprobs": (BOOL, []), "top_logprobs": (INT, [-1, 21])}
LIST_OK = {"prompt", "stop", "messages"}   # fields where [1] is a valid list (checked through bad values)


def bad_bodies(fields, base):
    """(body, field) of every wrong type and out-of-range value of every field."""
    for name, (kinds, values) in fields.items():
        for kind, v in SAMPLES.items():
            if kind in kinds or (kind == "null" and name in base):
                continue
            if kind == "int" and "float" in kinds:
                continue
            if kind == "list" and name in LIST_OK:
                continue
            yield {**base, name: v}, name
        for v in values:
            yield {**base, name: v}, name
    yield {k: v for k, v in base.items() if k not in ("prompt", "messages")}, next(iter(base))
    yield {**base, "unknown_field": 1}, "unknown_field"
    yield {**base, "stream_options": {"include_usage": True}}, "stream_options"   # only with stream=true


MESSAGES = [
    [{"role": "user"}], [{"content": "hi"}], [{"role": "bot", "content": "hi"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": None}], [{"role": "user", "content": []}],
    [{"role": "user", "content": [{"type": "video", "video": "x"}]}],
    [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "text", "text": 1}]}],
    [{"role": "user", "content": [{"type": "image_url"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ""}}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                                       "detail": "max"}}]}],
    [{"role": "user", "content": "hi", "extra": 1}],
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from fastapi.testclient import TestClient

    run, model, tok = make_tiny_run(tmp_path_factory.mktemp("run"))
    with TestClient(make_app(Engine.from_pretrained(str(run)), "tiny"), raise_server_exceptions=False) as c:
        yield c, model, tok


def check_error(r, status=(400,), param=None, what=""):
    assert r.status_code in status, (what, r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), (what, r.headers["content-type"])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["message"] and "\n" not in err["message"], (what, err)
    if param is not None:
        assert (err["param"] or "").startswith(param), (what, err)
    return err


def still_serving(c, model, tok):
    r = c.post("/v1/completions", json={"prompt": "def", "max_tokens": 3, "temperature": 0})
    ref = greedy_reference(model, tok.encode("def"), 3, eos=tok.eos_id)
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == tok.decode(ref[:-1] if ref[-1] == tok.eos_id else ref)


def test_every_field_with_every_wrong_type_and_range(client):
    c, model, tok = client
    n = 0
    for path, fields, base in (("/v1/completions", COMPLETION, {"prompt": "x", "max_tokens": 1}),
                               ("/v1/chat/completions", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 1})):
        for body, name in bad_bodies(fields, base):
            for stream in (False, True):
                b = {**body, "stream": True} if stream and name not in ("stream", "stream_options") else body
                if stream and b is body:
                    continue
                what = f"{path} {json.dumps(b)[:120]}"
                status = (404,) if b.get("model") == "gpt-9" else (400,)
                r = c.post(path, content=json.dumps(b), headers={"content-type": "application/json"})  # inf too
                check_error(r, status, name if name in b else None, what)
                n += 1
        for msgs in MESSAGES:
            check_error(c.post(path.replace("/completions", "/chat/completions") if "chat" not in path else path,
                               json={"messages": msgs}), param="messages", what=json.dumps(msgs))
            n += 1
    assert n > 200
    still_serving(c, model, tok)


def test_echo_scoring_bodies_are_refused_or_answered(client):
    """The echo scoring path (``echo: true, max_tokens: 0``) over generated prompts and field mixes: every
    one is a checked answer (one logprob per token, the first null, finite <= 0) or a 400 JSON error; the
    server serves normally afterwards."""
    import math
    import random

    c, model, tok = client
    V, rng = model.config.vocab_size, random.Random(5)
    prompts = [[], [[]], [-1], [V], [2 ** 70], [True], [1.5], ["a", 1], [[1, 2], [V + 1]],
               [1] * (model.config.max_seq_len + 2)]
    extras = [{}, {"n": 2}, {"stream": True}, {"top_p": 0.5}, {"top_k": 3}, {"logprobs": 2}, {"max_tokens": 1},
              {"temperature": -1}, {"temperature": 3}, {"logprobs": None}]
    answered = refused = 0
    for _ in range(120):
        p = rng.choice(prompts) if rng.random() < 0.5 else [rng.randrange(V) for _ in range(rng.randint(1, 9))]
        body = {"prompt": p, "echo": True, "max_tokens": 0, "logprobs": 0,
                **(rng.choice(extras) if rng.random() < 0.5 else {})}
        r = c.post("/v1/completions", json=body)
        if r.status_code == 200:
            answered += 1
            rows = [p] if p and isinstance(p[0], int) else p
            for ch in r.json()["choices"]:
                lp = (ch["logprobs"] or {}).get("token_logprobs")
                if lp is None:
                    continue
                assert len(lp) == len(rows[ch["index"]]) and lp[0] is None, body
                assert all(isinstance(v, float) and math.isfinite(v) and v <= 1e-4 for v in lp[1:]), body
        else:
            refused += 1
            check_error(r, what=json.dumps(body)[:120])
    assert answered > 10 and refused > 10, (answered, refused)
    still_serving(c, model, tok)


def test_bodies_routes_methods_and_oversize(client):
    c, model, tok = client
    for raw, ctype in ((b"{not json", "application/json"), (b"[1, 2]", "application/json"),
                       (b'"prompt"', "application/json"), (b"", "application/json"), (b"null", "application/json"),
                       (b'{"prompt": "x"}', "text/plain"), (b"\xff\xfe", "application/json")):
        for path in ("/v1/completions", "/v1/chat/completions"):
            check_error(c.post(path, content=raw, headers={"content-type": ctype}), what=raw)
    check_error(c.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES + 1),
                       headers={"content-type": "application/json"}), (413,))
    for method, path in (("GET", "/v1/nothing"), ("POST", "/v2/completions"), ("POST", "/v1/completion"),
                         ("GET", "/"), ("DELETE", "/v1/models/tiny")):
        check_error(c.request(method, path, json={"prompt": "x"}), (404,), what=path)
    for method, path in (("GET", "/v1/completions"), ("PUT", "/v1/completions"), ("DELETE", "/v1/completions"),
                         ("PATCH", "/v1/chat/completions"), ("GET", "/v1/chat/completions"),
                         ("POST", "/v1/models"), ("POST", "/health"), ("PUT", "/metrics")):
        r = c.request(method, path, json={"prompt": "x"})
        check_error(r, (405,), what=f"{method} {path}")
        assert r.headers.get("allow")
    long_text = "the quick brown fox " * 60
    assert len(tok.encode(long_text)) >= 96
    for path, body in (("/v1/completions", {"prompt": long_text}),
                       ("/v1/completions", {"prompt": list(range(4, 100))}),
                       ("/v1/completions", {"prompt": ["ok", long_text], "stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}],
                                                 "stream": True})):
        err = check_error(c.post(path, json=body), param="prompt" if "prompt" in body else "messages")
        assert "context" in err["message"]
    # a prompt that fits leaves room; max_tokens beyond the context is clamped, not refused
    r = c.post("/v1/completions", json={"prompt": list(range(4, 94)), "max_tokens": 50, "temperature": 0,
                                        "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 96 - 90
    still_serving(c, model, tok)


class _FaultyEngine:
    """The real engine whose next step raises a server-side error once."""

    def __init__(self, engine):
        self.engine, self.fail = engine, True

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self, handles=None):
        if self.fail:
            self.fail = False
            raise RuntimeError("simulated fault")
        return self.engine.step(handles)


def test_a_server_fault_is_a_json_500_and_the_server_goes_on(tmp_path):
    from fastapi.testclient import TestClient

    run, model, tok = make_tiny_run(tmp_path / "run")
    with TestClient(make_app(_FaultyEngine(Engine.from_pretrained(str(run))), "tiny"),
                    raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"prompt": "def", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "simulated fault" in r.json()["error"]["message"]
        still_serving(c, model, tok)
