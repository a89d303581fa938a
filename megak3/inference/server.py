"""An OpenAI-compatible HTTP server over :class:`megak3.inference.Engine` (FastAPI + uvicorn + pydantic).

    python -m megak3.generate serve --checkpoint runs/X --port 8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def main(", "max_tokens": 16, "temperature": 0}'
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "hi"}]}'
    curl -sN localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def", "stream": true}'                                  # server-sent events

Endpoints: ``POST /v1/completions`` (also prompt scoring: ``"echo": true, "max_tokens": 0``, service.py),
``POST /v1/chat/completions`` (``"stream": true``: ``data: {...}`` events, then ``data: [DONE]``),
``GET /v1/models`` (with the tokenizer's hash, vocabulary size and special ids), ``GET /health``, ``GET /metrics``
(Prometheus, megak3/inference/metrics.py), and FastAPI's ``/docs`` and ``/openapi.json``. The schemas are
megak3/inference/api_models.py, the request/response logic megak3/inference/service.py, and every engine call
goes through one engine thread (megak3/inference/engine_client.py) that runs the sequences of all concurrent
requests, streamed or not, in the same decode batches. With ``--replicas N`` (N > 1) or ``--ray-address``, N
engine worker processes (or Ray actors) each do that for the requests the cache-affine router sends them
(megak3/inference/replicas.py); this process then holds no weights.

Errors are JSON in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: a body that is
not a JSON object, a wrong type or value, an unknown field, a prompt of the model's context or
longer, a request the engine refuses (also a streamed one: its first event is awaited before the
headers go out): 400 (``param`` names the field); an unknown model or path: 404; a wrong method:
405; a body over 32 MiB: 413; a server fault: 500. The server keeps serving after each. A client
that disconnects, streamed or not, aborts its sequences (their pages are freed at once) or, if its
request has not reached the engine yet, drops it.

Images: chat messages may carry ``{"type": "image_url", "image_url": {"url": ...}}`` parts with a
``data:image/...;base64,`` URL, or a ``file://`` URL under the directory the operator names with
``--allowed-local-media-path`` (megak3/inference/media.py).
"""
import asyncio
import json
import socket
import time
from pathlib import Path
from typing import List, Optional

from megak3.cli import Parser, error_exit
from megak3.inference.options import add_model_args, load_engine

MAX_BODY_BYTES = 32 << 20
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None, headers=None):
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": " ".join(str(message).split()), "type": kind, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


def _field_names() -> set:
    from pydantic import BaseModel

    from . import api_models

    names = set()
    for obj in vars(api_models).values():
        if isinstance(obj, type) and issubclass(obj, BaseModel):
            names |= set(obj.model_fields)
    return names


def _param(loc, fields: set) -> str:
    """``messages[0].content`` from pydantic's loc (union-branch tags such as ``list[str]`` dropped)."""
    out, last = "", None
    for x in loc:
        if isinstance(x, int):
            out += f"[{x}]"
        elif x in fields and x != last:
            out += f".{x}" if out else x
        last = x
    return out


def validation_message(errors: list, content_type: str) -> tuple:
    """(one-line message, param) of pydantic's errors about a request body: the first error's field;
    a union's alternatives are named together (``FIELD_HINTS`` where the union is a top field)."""
    from .api_models import FIELD_HINTS, UnsupportedField

    e = max(errors, key=lambda x: len(x.get("loc", ())))   # a union: the branch that got furthest
    loc = [x for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return f"the request body is not JSON ({(e.get('ctx') or {}).get('error', e.get('msg'))})", None
    err = (e.get("ctx") or {}).get("error")
    if isinstance(err, UnsupportedField):
        return str(err), err.param
    if not loc:
        if content_type and "json" not in content_type:
            return (f"send the request body as JSON with Content-Type: application/json (got {content_type})",
                    None)
        return "the request body must be a JSON object", None
    fields = _field_names()
    param = _param(loc, fields)
    if e.get("type") == "extra_forbidden":
        param = f"{_param(loc[:-1], fields)}.{loc[-1]}".lstrip(".")
        return f"unrecognized request field {param!r}; leave it out", param
    if e.get("type") == "missing":
        return f"{param} is required", param
    if param in FIELD_HINTS or (loc[0] in FIELD_HINTS and loc[0] != "messages"):
        return f"{loc[0]} {FIELD_HINTS[loc[0]]}", str(loc[0])
    same = [x for x in errors if _param([y for y in x.get("loc", ()) if y != "body"], fields) == param]
    msgs = list(dict.fromkeys(x.get("msg", "invalid value") for x in same))
    got = e.get("input")
    shown = json.dumps(got)[:60] if isinstance(got, (str, int, float, bool, type(None))) else type(got).__name__
    return f"{param}: {' or '.join(msgs)} (got {shown})", param


class _Guard:
    """ASGI middleware: bodies over ``MAX_BODY_BYTES`` get 413 before they are read; generation
    requests are counted by status and timed to their last byte (streams included)."""

    def __init__(self, app, metrics=None):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            resp = _error(413, f"the request body must be at most {MAX_BODY_BYTES} bytes")
            return await resp(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > MAX_BODY_BYTES:
                    from .service import RequestError

                    raise RequestError(f"the request body must be at most {MAX_BODY_BYTES} bytes", status=413)
            return msg

        if self.metrics is None or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, limited_receive, send)
        t0, status = time.perf_counter(), [500]

        async def timed_send(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, limited_receive, timed_send)
        finally:
            self.metrics.requests.labels(str(status[0])).inc()
            if status[0] == 200:
                self.metrics.latency.observe(time.perf_counter() - t0)


def make_app(engine, model_name: str = "megak3", allowed_media_dir: Optional[str] = None, client=None):
    """The FastAPI application serving ``engine`` (starts its engine thread; ``app.state.client.close()``
    stops it, as the app's shutdown does). ``allowed_media_dir``: file:// images under it are read.
    ``client``: serve through this client instead (a :class:`megak3.inference.replicas.ReplicaClient`;
    ``engine`` is then None)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .api_models import ChatCompletionRequest, CompletionRequest, ErrorResponse
    from .engine_client import ClientDisconnected, EngineClient
    from .metrics import ServerMetrics
    from .service import OpenAIService, RequestError
    from .types import InferenceError

    if allowed_media_dir is not None and not Path(allowed_media_dir).is_dir():
        raise ValueError(f"--allowed-local-media-path {allowed_media_dir}: no such directory")
    if client is None:
        client = EngineClient(engine)
    metrics = ServerMetrics(lambda: client.cache_stats(), client.num_pages)
    client.metrics = metrics
    service = OpenAIService(client, model_name, allowed_media_dir, metrics)

    @asynccontextmanager
    async def lifespan(app):
        yield
        client.close()

    errors = {400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}
    app = FastAPI(title="megak3", lifespan=lifespan, responses=errors)
    app.state.client, app.state.service, app.state.metrics = client, service, metrics
    app.add_middleware(_Guard, metrics=metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = validation_message(exc.errors(), request.headers.get("content-type", ""))
        return _error(400, msg, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return _error(404, f"no such endpoint: {request.method} {request.url.path}")
        if exc.status_code == 405:
            allow = (exc.headers or {}).get("Allow", "")
            return _error(405, f"method {request.method} is not allowed on {request.url.path}; use {allow}",
                          headers=exc.headers)
        return _error(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(RequestError)
    async def _bad(request: Request, exc: RequestError):
        return _error(exc.status, str(exc), exc.param, exc.code)

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)   # nginx's "client closed request": nobody reads it

    @app.exception_handler(InferenceError)
    async def _engine_refused(request: Request, exc: InferenceError):
        return _error(400, str(exc))

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        return _error(500, f"{type(exc).__name__}: {exc}")

    def disconnected(request: Request):
        return request.is_disconnected

    async def first_event(request: Request, gen):
        """The stream's first event, awaited before any header is sent: an engine refusal is still a
        400 JSON error; a client that leaves meanwhile aborts the request (polled every 0.25 s)."""
        task = asyncio.ensure_future(gen.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientDisconnected()
        except BaseException:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})   # the generator's own cleanup (its streams abort) runs first
            await gen.aclose()
            raise

    async def sse(request, gen):
        first = await first_event(request, gen)

        async def events():
            try:
                yield f"data: {json.dumps(first)}\n\n"
                async for ev in gen:
                    yield f"data: {json.dumps(ev)}\n\n"
            except (RequestError, InferenceError) as e:   # after the headers: an error event ends the stream
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'invalid_request_error'}})}\n\n"
            except Exception as e:  # noqa: BLE001 - a fault (an engine replica that died): its error event
                err = {"message": f"{type(e).__name__}: {e}", "type": "server_error"}
                yield f"data: {json.dumps({'error': err})}\n\n"
            finally:
                await gen.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if body.stream:
            return await sse(request, service.stream(body, service.completion_requests(body), chat=False))
        return (await service.completions(body, disconnected(request))).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if body.stream:
            return await sse(request, service.stream(body, service.chat_requests(body), chat=True))
        return (await service.chat(body, disconnected(request))).model_dump()

    @app.get("/v1/models")
    async def models():
        return service.models().model_dump()

    @app.get("/health")
    async def health():
        n, up = client.num_replicas, client.replicas_up()
        if not up:
            status = "engine thread stopped" if n == 1 else "no engine replica is up"
            return JSONResponse({"status": status, "replicas": n, "replicas_up": 0}, status_code=503)
        return {"status": "ok", "replicas": n, "replicas_up": up}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=metrics.content_type)

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 = a free port); connections queue until the server accepts."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def uvicorn_server(app, log_requests: bool = False):
    import uvicorn

    return uvicorn.Server(uvicorn.Config(app, log_level="info" if log_requests else "warning",
                                         access_log=log_requests, timeout_graceful_shutdown=5))


def serve_main(argv: Optional[List[str]] = None) -> int:
    p = Parser(prog="python -m megak3.generate serve", description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--model-name", default=None, help="model id in responses (default: the checkpoint's name)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let requests' file:// image URLs read image files under DIR (default: no local files)")
    p.add_argument("--log-requests", action="store_true", help="log one line per request on stderr")
    p.add_argument("--replicas", type=int, default=1,
                   help="engine replicas, each a worker process behind the cache-affine router (default 1: "
                        "one engine in the server process)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="run the replicas as Ray actors on the Ray cluster at ADDR (auto, HOST:PORT, or local: "
                        "a Ray instance on this machine); default: worker processes here")
    p.add_argument("--checkpoint-interval", type=int, default=512,
                   help="tokens between the engines' KDA checkpoints (prefix-cache granularity; default 512)")
    a = p.parse_args(argv)
    if a.replicas < 1:
        p.error(f"--replicas {a.replicas} must be an integer >= 1 (engine replicas; 1 = one in-process engine)")
    if a.checkpoint_interval < 1 or a.checkpoint_interval % 16:
        p.error(f"--checkpoint-interval {a.checkpoint_interval} must be a positive multiple of 16 (the page size)")
    if not 0 <= a.port < 65536:
        p.error(f"--port {a.port} must lie in [0, 65535]")
    if a.allowed_local_media_path is not None and not Path(a.allowed_local_media_path).is_dir():
        p.error(f"--allowed-local-media-path {a.allowed_local_media_path}: no such directory")
    try:
        sock = bind(a.host, a.port)
        name = a.model_name or Path(a.checkpoint).resolve().name
        if a.replicas == 1 and a.ray_address is None:
            app = make_app(load_engine(a), name, a.allowed_local_media_path)
        else:
            from .options import check_checkpoint_path, check_device
            from .replicas import ReplicaClient

            check_checkpoint_path(a.checkpoint)
            check_device(a.device)
            if a.threads < 1:
                raise ValueError(f"--threads {a.threads} must be >= 1")
            client = ReplicaClient(a.checkpoint, a.replicas, device=a.device, dtype=a.dtype, threads=a.threads,
                                   checkpoint_interval=a.checkpoint_interval, ray_address=a.ray_address)
            app = make_app(None, name, a.allowed_local_media_path, client=client)
    except (ValueError, OSError) as e:
        return error_exit(p.prog, e)
    host, port = sock.getsockname()[:2]
    print(f"serving {name} on http://{host}:{port} (/v1/completions, /v1/chat/completions, /v1/models, "
          "/metrics)", flush=True)
    try:
        uvicorn_server(app, a.log_requests).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


__all__ = ["make_app", "serve_main", "bind", "uvicorn_server", "validation_message", "MAX_BODY_BYTES"]
