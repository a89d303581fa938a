"""MOPD teachers served over HTTP (``rl.mopd_teachers=add=http://HOST:PORT``, megak3/posttrain/teacher_client.py)
and the server's prompt scoring they use (``echo`` with ``max_tokens: 0``, megak3/inference/scoring.py).

- the echo logprobs equal the training forward's token logprobs (tempered and not), through one engine and
  through two replica workers;
- RL with the teacher by URL (one engine, and 2 replica workers) equals RL with the same teacher by path over
  2 updates: MOPD loss, grad norm and KL to the teacher, with one scoring request per micro-batch;
- a served teacher of another tokenizer, and an unreachable URL: one line, exit 2, before any rollout;
- malformed answers (wrong lengths, NaN, a positive logprob, duplicate indexes) are a TeacherError naming the
  teacher, in the update too; 5xx answers are retried a bounded number of times."""
import http.server
import json
import shutil
import socket
import threading
import time
from dataclasses import asdict

import pytest
import torch

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.data.config import DataConfig
from megak3.data.tokenizer import train_bpe_tokenizer
from megak3.inference import Engine
from megak3.inference.server import bind, make_app, uvicorn_server
from megak3.job.config import JobConfig, TrainConfig
from megak3.optim.config import OptimConfig
from megak3.posttrain.rl import RLConfig, RLRunner
from megak3.posttrain.teacher_client import ServedTeacher, TeacherError
from test_generate_cli import make_tiny_run

ENGINE = {"page_size": 8, "num_pages": 128, "prefill_chunk": 8}
CONTEXT = 256   # the RL command's default data.seq_len


class Served:
    """A uvicorn server of ``app`` on a free loopback port, in a thread."""

    def __init__(self, app):
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn_server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("mopd_served")
    student, _, tok = make_tiny_run(root / "student", seed=0, max_seq_len=CONTEXT)
    # the same tokenizer (trained on the same text), other weights
    teacher, tmodel, _ = make_tiny_run(root / "teacher", seed=1, max_seq_len=CONTEXT)
    srv = Served(make_app(Engine.from_pretrained(str(teacher)), "teacher"))
    yield type("Env", (), dict(root=root, student=student, teacher=teacher, tmodel=tmodel, tok=tok, srv=srv))
    srv.close()


def runner(tok, **kw):
    kw = {"prompts": 2, "group_size": 2, "max_tokens": 4, "seed": 4, "micro_batch_size": 3, **kw}
    cfg = load_model_config("k3_tiny", **{**SMALL_MODEL, "vocab_size": tok.vocab_size, "max_seq_len": CONTEXT})
    job = JobConfig(model=cfg, data=DataConfig(vocab_size=tok.vocab_size), optim=OptimConfig(lr=3e-3, warmup_steps=0),
                    train=TrainConfig(max_steps=8, global_batch_size=1, micro_batch_size=1, seed=2)).validate()
    return RLRunner(job, RLConfig(**kw), tok, engine_options=ENGINE)


def post(url, body):
    import urllib.request

    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=120) as r:
        return json.loads(r.read())


def reference(model, seq, T):
    """The training forward's token logprobs of ``seq[1:]`` at temperature T (0: untempered)."""
    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]])).logits[0].float()
    logits = logits / T if T > 0 else logits
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


SEQS = [[1, 40, 41, 42, 7, 9, 250, 3], [1, 17], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def check_echo(resp, model, T):
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert resp["usage"] == {"prompt_tokens": 25, "completion_tokens": 0, "total_tokens": 25}
    for s, ch in zip(SEQS, resp["choices"]):
        lp = ch["logprobs"]["token_logprobs"]
        assert len(lp) == len(s) and lp[0] is None and ch["finish_reason"] == "length"
        err = (torch.tensor(lp[1:], dtype=torch.float64) - reference(model, s, T).double()).abs().max()
        assert err <= 1e-5, (T, float(err))


def test_echo_logprobs_equal_the_training_forward(env):
    for T in (1.0, 0.7, 0):
        check_echo(post(env.srv.url, {"prompt": SEQS, "echo": True, "max_tokens": 0, "logprobs": 0,
                                      "temperature": T}), env.tmodel, T)
    card = json.loads(__import__("urllib.request").request.build_opener(
        __import__("urllib.request").request.ProxyHandler({})).open(env.srv.url + "/v1/models").read())["data"][0]
    assert card["tokenizer_sha256"] == env.tok.sha256() and card["vocab_size"] == env.tok.vocab_size
    assert card["special_ids"] == env.tok.special_ids()
    text = post(env.srv.url, {"prompt": "def main(", "echo": True, "max_tokens": 0})["choices"][0]
    assert text["text"] == "def main(" and text["logprobs"] is None


@pytest.fixture(scope="module")
def replicated(env):
    """The teacher served by 2 replica worker processes (``serve --replicas 2``)."""
    from megak3.inference.replicas import ReplicaClient

    srv = Served(make_app(None, "teacher", client=ReplicaClient(str(env.teacher), 2, start_timeout=300)))
    yield srv
    srv.close()


def test_echo_through_two_replica_workers(env, replicated):
    for T in (1.0, 0.7):
        check_echo(post(replicated.url, {"prompt": SEQS, "echo": True, "max_tokens": 0, "logprobs": 0,
                                         "temperature": T}), env.tmodel, T)


def test_served_teacher_equals_the_teacher_by_path_over_two_updates(env, replicated):
    recs = {}
    for how, where in (("path", str(env.teacher)), ("url", env.srv.url), ("url, 2 replicas", replicated.url)):
        r = runner(env.tok, temperature=0.7, mopd_teachers=f"add={where}")
        recs[how] = [r.iteration() for _ in range(2)]
        if how != "path":
            served = r.teachers[0]
            assert isinstance(served, ServedTeacher)
            # 4 rows per update, micro-batches of 3: two scoring requests per update
            assert served.requests == 4
    for how in ("url", "url, 2 replicas"):
        for a, b in zip(recs["path"], recs[how]):
            print(f"path vs {how}: " + ", ".join(f"{k} {a[k]:.6f} {b[k]:.6f} (|diff| {abs(a[k] - b[k]):.1e})"
                                                 for k in ("loss", "grad_norm", "kl_add")))
            assert a["teacher_rows"] == b["teacher_rows"] == 4
            for k in ("loss", "grad_norm", "kl_add"):
                assert abs(a[k] - b[k]) <= 1e-5, (how, k, a[k], b[k])
            assert abs(a["kl_add"]) > 1e-3       # the teacher differs from the student: the check has teeth


def test_other_tokenizer_or_unreachable_url_is_one_line_exit_2(env, monkeypatch, capsys):
    from megak3.posttrain import rl as rlmod
    from megak3.posttrain.__main__ import main

    other = env.root / "other_tok"
    shutil.copytree(env.teacher, other)
    train_bpe_tokenizer(["an unrelated corpus of words, words and more words. " * 40], 300, other / "tokenizer.json")
    bad = Served(make_app(Engine.from_pretrained(str(other)), "other"))
    with socket.socket() as s:           # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(rlmod.PartialRollouts, "run", lambda *a, **k: pytest.fail("a rollout ran"))
    try:
        for url, why in ((bad.url, "another tokenizer"), (dead, "is unreachable")):
            with pytest.raises(ValueError, match=why):
                runner(env.tok, mopd_teachers=f"add={url}", mopd_retries=0)
            assert main(["--init-from", str(env.student), "--eval-prompts", "1", f"rl.mopd_teachers=add={url}",
                         "rl.mopd_retries=0", "rl.mopd_timeout_s=10"]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and why in err and url in err, err
    finally:
        bad.close()


class Fake(http.server.BaseHTTPRequestHandler):
    """A teacher server that answers /v1/models like megak3 and /v1/completions with ``answers`` in turn."""
    card, answers = {}, []

    def do_GET(self):
        self._send(200, json.dumps({"object": "list", "data": [self.card]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        status, body = Fake.answers.pop(0)
        if status == 0:          # too slow: answers after the client's timeout
            time.sleep(1.0)
            status = 200
        self._send(status, body.encode())

    def _send(self, status, raw):
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
        except (BrokenPipeError, ConnectionResetError):   # the client gave up (timeout)
            pass

    def log_message(self, *a):
        pass


def echo_body(rows):
    return json.dumps({"choices": [{"index": k, "text": "", "logprobs": {"token_logprobs": r}}
                                   for k, r in enumerate(rows)]})


def test_malformed_answers_are_errors_naming_the_teacher(env):
    Fake.card = {"id": "fake", "vocab_size": env.tok.vocab_size, "tokenizer_sha256": env.tok.sha256(),
                 "special_ids": env.tok.special_ids()}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    t = ServedTeacher(url, "teacher add=" + url, retries=0)
    seqs = [[1, 2, 3], [4, 5]]
    try:
        Fake.answers = [(200, echo_body([[None, -1.0, -2.0], [None, -0.5]]))]
        assert t.score(seqs) == [[-1.0, -2.0], [-0.5]]
        cases = {"2 token logprobs for its 3 tokens": echo_body([[None, -1.0], [None, -0.5]]),
                 "1 choices for 2 rows": echo_body([[None, -1.0, -2.0]]),
                 "not strict JSON": echo_body([[None, -1.0, -2.0], [None, -0.5]]).replace("-0.5", "NaN"),
                 "not a finite log-probability": echo_body([[None, -1.0, 2.0], [None, -0.5]]),
                 "first token's logprob must be null": echo_body([[-1.0, -1.0, -2.0], [None, -0.5]]),
                 "once each": json.dumps({"choices": [{"index": 0,
                                                       "logprobs": {"token_logprobs": [None, -1, -2]}}] * 2}),
                 "not a finite": echo_body([[None, True, -2.0], [None, -0.5]])}
        for why, body in cases.items():
            Fake.answers = [(200, body)]
            with pytest.raises(TeacherError, match=why) as e:
                t.score(seqs)
            assert str(e.value).startswith("teacher add=" + url) and "\n" not in str(e.value)
        Fake.answers = [(500, "{}")]
        with pytest.raises(TeacherError, match="answered 500: .* after 1 tries"):
            t.score(seqs)
        Fake.answers = [(503, "{}"), (200, echo_body([[None, -1.0, -2.0], [None, -0.5]]))]
        assert ServedTeacher(url, "t", retries=1).score(seqs)[1] == [-0.5]      # retried once
        good = echo_body([[None, -1.0, -2.0], [None, -0.5]])
        Fake.answers = [(0, good), (0, good)]
        t0 = time.time()
        with pytest.raises(TeacherError, match=r"did not answer \(TimeoutError.* after 2 tries \(timeout 0.3 s each"):
            ServedTeacher(url, "t", timeout_s=0.3, retries=1).score(seqs)
        assert time.time() - t0 < 2.5      # bounded: 2 x 0.3 s + a 0.5 s pause
        # in an RL update: the wrong-length answer fails the update with the teacher's name, one line
        r = runner(env.tok, mopd_teachers=f"add={url}", mopd_retries=0)
        Fake.answers = [(200, echo_body([[None]] * 3))] * 4
        with pytest.raises(TeacherError, match=f"rl.mopd_teachers: teacher add={url}: a malformed scoring answer"):
            r.iteration()
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_scoring_answers_from_a_generator_are_checked_or_refused():
    """Seeded adversarial answers (valid echo answers with one node replaced or deleted, and random JSON):
    each is either accepted with one finite logprob <= 0 per scored token or refused with TeacherError,
    never another exception (a 400-digit integer logprob was an OverflowError)."""
    import copy
    import json
    import math
    import random

    from megak3.posttrain.teacher_client import ServedTeacher, TeacherError, _no_constant

    t = ServedTeacher("http://127.0.0.1:1", "add")
    rng = random.Random(11)
    atoms = [None, True, False, 0, -1, 1, 10 ** 400, -10 ** 400, 1e308, -0.0, -1.5, 0.5, "x", "", [], {}, [None]]

    def value(d=0):
        r = rng.random()
        if d > 3 or r < 0.5:
            return rng.choice(atoms)
        if r < 0.75:
            return [value(d + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(["choices", "index", "logprobs", "token_logprobs"]): value(d + 1)
                for _ in range(rng.randint(0, 3))}

    def mutate(o):
        paths = []

        def walk(x, p):
            paths.append(p)
            for k in (x if isinstance(x, dict) else range(len(x)) if isinstance(x, list) else ()):
                walk(x[k], p + [k])
        walk(o, [])
        p = rng.choice(paths)
        if not p:
            return value()
        cur = o
        for k in p[:-1]:
            cur = cur[k]
        if rng.random() < 0.6:
            cur[p[-1]] = value()
        else:
            del cur[p[-1]]
        return o

    accepted = refused = 0
    for _ in range(3000):
        seqs = [[1] * rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
        ok = {"choices": [{"index": k, "logprobs": {"token_logprobs": [None] + [-0.5] * (len(s) - 1)}}
                          for k, s in enumerate(seqs)]}
        got = mutate(copy.deepcopy(ok)) if rng.random() < 0.8 else value()
        if rng.random() < 0.3:
            got = json.loads(json.dumps(got), parse_constant=_no_constant)
        try:
            out = t.parse(got, seqs)
        except TeacherError:
            refused += 1
            continue
        accepted += 1
        assert [len(r) for r in out] == [max(len(s) - 1, 0) for s in seqs]
        assert all(isinstance(v, float) and math.isfinite(v) and v <= 1e-4 for r in out for v in r)
    assert accepted > 30 and refused > 1000, (accepted, refused)   # both sides exercised (62 and 2938)
