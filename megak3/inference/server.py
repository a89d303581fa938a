"""An HTTP server in the OpenAI completions / chat-completions format over :class:`megak3.inference.Engine`.

    python -m megak3.generate serve --checkpoint runs/X --port 8000
    curl -s localhost:8000/v1/completions -d '{"prompt": "def main(", "max_tokens": 16, "temperature": 0}'
    curl -s localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "hi"}]}'
    curl -sN localhost:8000/v1/completions -d '{"prompt": "def", "stream": true}'     # server-sent events

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (stdlib
``ThreadingHTTPServer``: one thread per connection). Requests are collected by one batching thread:
whatever arrived while the engine was busy goes into the next ``Engine.generate`` call together
(continuous batching inside the engine), and every request gets its own results back. A streamed
request (``"stream": true``, one prompt) runs ``Engine.stream`` and sends each piece of text as it
is produced (``data: {...}`` events, then ``data: [DONE]``); text that could still become a stop
string is held back until it cannot.

Request fields: ``prompt`` (a string, a list of strings, a list of token ids or a list of such
lists; completions), ``messages`` (chat: ``[{"role", "content"}]``), ``max_tokens`` (chat also
``max_completion_tokens``; default 16), ``temperature`` (default 1.0, as OpenAI; 0 = greedy),
``top_p``, ``top_k`` (an extension; 0 = off), ``seed`` (prompt ``i`` of a request uses ``seed + i``),
``stop`` (a string or a list), ``logprobs`` (completions: an integer, returns each chosen token's log
probability, ``top_logprobs`` is null; chat: ``true``, ``top_logprobs`` empty), ``n`` (only 1),
``stream``, ``model`` (when given, the served model's id). Fields that would change the result
but are not implemented (``echo``, ``best_of`` > 1, non-zero ``presence_penalty`` /
``frequency_penalty``, a non-empty ``logit_bias``) are refused; other fields are ignored.

Chat messages are rendered with megak3's chat template, the one SFT trains on
(megak3/data/chat.py: ``<|bos|>role\\n content <|eos|>`` per message from the tokenizer's reserved
ids, then the open ``<|bos|>assistant\\n`` header); roles are system, user, assistant or tool.

Bad requests (malformed JSON, a wrong type or value, a prompt that leaves no room in the context)
get HTTP 400 with ``{"error": {"message", "type": "invalid_request_error", "param", "code"}}``, an
unknown model 404, an unknown path 404; the server goes on serving.
"""
from __future__ import annotations

import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from megak3.cli import Parser, error_exit
from megak3.inference.options import add_model_args, load_engine

MAX_BODY_BYTES = 32 << 20
_REFUSED = (("echo", lambda v: bool(v), "echo is not supported"),
            ("best_of", lambda v: v not in (None, 1), "best_of must be 1"),
            ("presence_penalty", lambda v: v not in (None, 0, 0.0), "presence_penalty is not supported (use 0)"),
            ("frequency_penalty", lambda v: v not in (None, 0, 0.0), "frequency_penalty is not supported (use 0)"),
            ("logit_bias", lambda v: bool(v), "logit_bias is not supported"))


class RequestError(ValueError):
    """A bad request: HTTP ``status`` with a one-line message naming ``param``."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class _Batcher:
    """One thread that owns the engine: it takes every queued job, runs them in one ``generate`` call
    (or one ``stream``), and hands each job its results."""

    def __init__(self, engine):
        self.engine = engine
        self.q: "queue.Queue" = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="megak3-batcher", daemon=True)
        self.thread.start()

    def generate(self, prompts: List[List[int]], params: list) -> list:
        job = {"kind": "generate", "prompts": prompts, "params": params, "done": threading.Event()}
        self.q.put(job)
        job["done"].wait()
        if "error" in job:
            raise job["error"]
        return job["result"]

    def stream(self, prompt: List[int], params) -> Iterator[Tuple[int, float]]:
        """Tokens as the engine produces them (the batcher runs nothing else meanwhile)."""
        out: "queue.Queue" = queue.Queue()
        self.q.put({"kind": "stream", "prompt": prompt, "params": params, "out": out})
        while True:
            item = out.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _loop(self):
        while True:
            jobs = [self.q.get()]
            while True:
                try:
                    jobs.append(self.q.get_nowait())
                except queue.Empty:
                    break
            gen = [j for j in jobs if j["kind"] == "generate"]
            if gen:
                self._run_generate(gen)
            for j in jobs:
                if j["kind"] == "stream":
                    try:
                        for item in self.engine.stream(j["prompt"], j["params"]):
                            j["out"].put(item)
                    except BaseException as e:  # noqa: BLE001 - handed to the request's thread
                        j["out"].put(e)
                    j["out"].put(None)

    def _run_generate(self, jobs):
        prompts = [p for j in jobs for p in j["prompts"]]
        params = [sp for j in jobs for sp in j["params"]]
        try:
            res = self.engine.generate(prompts, params)
        except BaseException:  # noqa: BLE001 - one job's failure must not fail its batch mates
            if len(jobs) > 1:
                for j in jobs:
                    self._run_generate([j])
                return
            res = None
            jobs[0]["error"] = sys.exc_info()[1]
        k = 0
        for j in jobs:
            if res is not None:
                j["result"] = res[k:k + len(j["prompts"])]
                k += len(j["prompts"])
            j["done"].set()


class Service:
    """OpenAI request bodies -> engine calls -> OpenAI response bodies (no HTTP here)."""

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.batcher = _Batcher(engine)
        self.created = int(time.time())

    # ---- parsing ----------------------------------------------------------------------------------
    def _prompts(self, body) -> List[List[int]]:
        p = body.get("prompt")
        tok = self.engine.tokenizer
        if isinstance(p, str):
            texts = [p]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            texts = p
        elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            texts = None
            ids = [p]
        elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x) for x in p):
            texts = None
            ids = p
        else:
            raise RequestError("prompt must be a string, a list of strings, a list of token ids or a list of "
                               "token-id lists (non-empty)", "prompt")
        if texts is not None:
            ids = [tok.encode(t) or [tok.eos_id] for t in texts]
        vocab = tok.vocab_size
        for i, x in enumerate(ids):
            if any(not 0 <= t < vocab for t in x):
                raise RequestError(f"prompt {i}: token ids must lie in [0, {vocab})", "prompt")
            if len(x) >= self.engine.max_context:
                raise RequestError(f"prompt {i} has {len(x)} tokens; the model's context is "
                                   f"{self.engine.max_context} tokens: shorten the prompt", "prompt")
        return ids

    def _params(self, body, n_prompts: int, chat: bool) -> list:
        from megak3.inference import SamplingParams

        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(f"model {model!r} does not exist; this server serves {self.model_name!r}", "model",
                               status=404)
        for field, bad, msg in _REFUSED:
            if bad(body.get(field)):
                raise RequestError(msg, field)
        if body.get("n", 1) != 1:
            raise RequestError("n must be 1", "n")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16)) if chat else body.get(
            "max_tokens", 16)
        stop = body.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)):
            raise RequestError("stop must be a string or a list of strings", "stop")
        seed = body.get("seed")
        kw = dict(max_tokens=max_tokens, temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
                  top_k=body.get("top_k", 0), seed=seed, stop=tuple(stop))
        for k in ("temperature", "top_p", "top_k", "max_tokens"):
            if kw[k] is None:
                kw.pop(k)
        out = []
        for i in range(n_prompts):
            sp = SamplingParams(**kw)
            if isinstance(seed, int) and not isinstance(seed, bool):
                sp = replace(sp, seed=seed + i)
            try:
                sp.validate()
            except ValueError as e:
                param = str(e).split("=", 1)[0].removeprefix("sampling.")
                raise RequestError(str(e).replace("sampling.", "", 1), param) from None
            out.append(sp)
        return out

    # ---- responses --------------------------------------------------------------------------------
    def _logprobs(self, c, kind):
        dec = self.engine.tokenizer.decode
        toks = [dec([t]) for t in c.token_ids]
        if kind == "chat":
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                                for s, lp in zip(toks, c.logprobs)]}
        offs, pos = [], 0
        for s in toks:
            offs.append(pos)
            pos += len(s)
        return {"tokens": toks, "token_logprobs": list(c.logprobs), "top_logprobs": None, "text_offset": offs}

    @staticmethod
    def _usage(results) -> dict:
        p = sum(len(c.prompt_ids) for c in results)
        g = sum(len(c.token_ids) for c in results)
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "megak3", "max_model_len": self.engine.max_context}]}

    def completions(self, body) -> dict:
        prompts = self._prompts(body if isinstance(body, dict) else {})
        params = self._params(body, len(prompts), chat=False)
        res = self.batcher.generate(prompts, params)
        want = body.get("logprobs")
        choices = [{"index": i, "text": c.text, "finish_reason": c.finish_reason,
                    "logprobs": self._logprobs(c, "completion") if want is not None and want is not False else None}
                   for i, c in enumerate(res)]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self._usage(res)}

    def chat_prompt(self, body) -> List[List[int]]:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        from megak3.data.chat import ChatFormatError, generation_prompt

        try:
            ids = generation_prompt(self.engine.tokenizer, body.get("messages"))
        except ChatFormatError as e:
            raise RequestError(str(e), "messages") from None
        return self._prompts({"prompt": [ids]})

    def chat(self, body) -> dict:
        prompts = self.chat_prompt(body)
        params = self._params(body, 1, chat=True)
        c = self.batcher.generate(prompts, params)[0]
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                  "logprobs": self._logprobs(c, "chat") if body.get("logprobs") else None}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice], "usage": self._usage([c])}

    def stream_events(self, body, chat: bool) -> Iterator[dict]:
        """Validate, then yield the SSE chunks of one streamed completion (the generator validates
        before its first chunk: the caller pulls once before sending headers)."""
        prompts = self.chat_prompt(body) if chat else self._prompts(body if isinstance(body, dict) else {})
        if len(prompts) != 1:
            raise RequestError("stream=true takes one prompt", "prompt")
        sp = self._params(body, 1, chat=chat)[0]
        yield {}  # validated: the handler sends the headers now
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text, finish):
            if chat:
                ch = {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
            else:
                ch = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name, "choices": [ch]}

        if chat:
            yield {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name,
                   "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
        for text, finish in stream_text(self.engine, self.batcher.stream(prompts[0], sp), sp):
            yield chunk(text, finish)


def stream_text(engine, tokens: Iterator[Tuple[int, float]], sp) -> Iterator[Tuple[str, Optional[str]]]:
    """(text piece, None) as tokens arrive, then ("" or the rest, finish_reason). Text is released only
    when no stop string can still begin in it and it does not end inside a multi-byte character; a
    stop string ends the stream with the text before it; eos / a stop token is not shown."""
    tok = engine.tokenizer
    stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {tok.eos_id})
    hold = max((len(s) for s in sp.stop), default=1) - 1
    ids, sent, finish = [], 0, "length"
    for t, _ in tokens:
        if t in stops:
            finish = "stop"
            break
        ids.append(t)
        text = tok.decode(ids)
        cut = min((text.find(s) for s in sp.stop if s in text), default=-1)
        if cut >= 0:
            if cut > sent:
                yield text[sent:cut], None
            yield "", "stop"
            return
        safe = len(text) - hold
        while safe > sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe > sent:
            yield text[sent:safe], None
            sent = safe
    text = tok.decode(ids)
    cut = min((text.find(s) for s in sp.stop if s in text), default=-1)
    if cut >= 0:
        text, finish = text[:cut], "stop"
    yield text[sent:] if len(text) > sent else "", finish


class _Handler(BaseHTTPRequestHandler):
    service: Service = None  # set by make_server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: one line per request only with --log-requests
        if getattr(self.server, "log_requests", False):
            super().log_message(fmt, *args)

    def _send_json(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: RequestError) -> None:
        kind = "invalid_request_error" if e.status == 400 else "not_found_error"
        self._send_json(e.status, {"error": {"message": " ".join(str(e).split()), "type": kind, "param": e.param,
                                             "code": None}})

    def do_GET(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/models":
            self._send_json(200, self.service.models())
        elif path in ("/health", "/v1/health"):
            self._send_json(200, {"status": "ok"})
        else:
            self._error(RequestError(f"no such endpoint: GET {path}", status=404))

    def do_POST(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_BODY_BYTES:
            self.close_connection = True
            return self._error(RequestError(f"Content-Length must be a size up to {MAX_BODY_BYTES} bytes"))
        raw = self.rfile.read(n)
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return self._error(RequestError(f"no such endpoint: POST {path}", status=404))
        chat = path == "/v1/chat/completions"
        try:
            try:
                body = json.loads(raw or b"null")
            except ValueError as e:
                raise RequestError(f"the request body is not JSON ({e})") from None
            if not isinstance(body, dict):
                raise RequestError("the request body must be a JSON object")
            if body.get("stream"):
                return self._stream(body, chat)
            self._send_json(200, self.service.chat(body) if chat else self.service.completions(body))
        except RequestError as e:
            self._error(e)
        except ValueError as e:  # InferenceError from the engine: the request's fault
            self._error(RequestError(str(e)))
        except Exception as e:  # noqa: BLE001 - a server fault: 500, and the server goes on
            self._send_json(500, {"error": {"message": f"{type(e).__name__}: {' '.join(str(e).split())}",
                                            "type": "server_error", "param": None, "code": None}})

    def _stream(self, body, chat):
        events = self.service.stream_events(body, chat)
        next(events)  # validates (RequestError propagates before any header)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            try:
                for ev in events:
                    self.wfile.write(f"data: {json.dumps(ev)}\n\n".encode())
                    self.wfile.flush()
            except ValueError as e:  # an engine error after the headers: an error event ends the stream
                self.wfile.write(f"data: {json.dumps({'error': {'message': ' '.join(str(e).split())}})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:  # the client went away; the engine finishes the request on its own
            events.close()


def make_server(engine, host: str = "127.0.0.1", port: int = 0, model_name: str = "megak3",
                log_requests: bool = False) -> ThreadingHTTPServer:
    """A ready (not yet serving) server; port 0 picks a free port (``server.server_address[1]``)."""
    handler = type("Handler", (_Handler,), {"service": Service(engine, model_name)})
    srv = ThreadingHTTPServer((host, port), handler)
    srv.daemon_threads = True
    srv.log_requests = log_requests
    return srv


def serve_main(argv: Optional[List[str]] = None) -> int:
    p = Parser(prog="python -m megak3.generate serve", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--model-name", default=None, help="model id in responses (default: the checkpoint's name)")
    p.add_argument("--log-requests", action="store_true", help="log one line per request on stderr")
    a = p.parse_args(argv)
    if not 0 <= a.port < 65536:
        p.error(f"--port {a.port} must lie in [0, 65535]")
    try:
        engine = load_engine(a)
        name = a.model_name or Path(a.checkpoint).resolve().name
        srv = make_server(engine, a.host, a.port, name, a.log_requests)
    except (ValueError, OSError) as e:
        return error_exit(p.prog, e)
    host, port = srv.server_address[:2]
    print(f"serving {name} on http://{host}:{port} (/v1/completions, /v1/chat/completions, /v1/models)", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0
