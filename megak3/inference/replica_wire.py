"""The wire between the server and its engine replica workers: length-prefixed JSON frames over a
socket, and the encodings of requests and results (data only: no pickle in either direction, so a
worker can hand the server nothing but numbers, strings and lists).

A frame is a 4-byte big-endian length then that many bytes of UTF-8 JSON (one object). Messages,
server -> worker: ``{"id", "op": "generate" | "stream", "reqs": [request]}``, ``{"id", "op": "score",
"seqs": [[token id]], "temperature"}`` (the ``echo`` prompt scoring, megak3/inference/scoring.py), ``{"id",
"op": "cancel"}`` (a whole call), ``{"id", "op": "cancel", "i"}`` (choice ``i`` of a stream call alone);
worker -> server: ``{"op": "hello", ...engine facts}`` once, then ``{"id", "op": "result", "results":
[result]}``, ``{"id", "op": "scores", "logprobs": [[float]]}`` (``len(seq) - 1`` finite values per
sequence), ``{"id", "op": "token", "i", "t", "lp", "top"}`` per streamed token of the call's request
``i`` (a stream call carries the choices of one prompt, begun together), ``{"id", "op": "end", "i"}``
per choice, ``{"id", "op": "error", "kind": "inference" | "fault", "message"}`` (the whole call), and
``{"op": "load", "running", "waiting", "calls", "stats"}`` whenever its engine thread starts or ends a
call and on every ``cancel`` (``calls``: the calls it holds). A ``cancel`` of a call the worker no longer
holds (finished, or never received) changes nothing else.
"""
from __future__ import annotations

import base64
import json
import math
import socket
import struct
from dataclasses import asdict, fields
from typing import Optional

import torch

from .engine_client import Request, Result
from .types import Completion, InferenceError, SamplingParams

MAX_FRAME = 1 << 30
_SP_FIELDS = {f.name for f in fields(SamplingParams)}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class WireClosed(ConnectionError):
    """The peer closed the socket (or sent a frame that is not a JSON object)."""


def send(sock: socket.socket, msg: dict) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise WireClosed("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> dict:
    (n,) = struct.unpack(">I", _read_exact(sock, 4))
    if n > MAX_FRAME:
        raise WireClosed(f"a frame of {n} bytes is over the {MAX_FRAME}-byte limit")
    try:
        msg = json.loads(_read_exact(sock, n))
    except ValueError as e:
        raise WireClosed(f"a frame is not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise WireClosed("a frame is not a JSON object")
    return msg


def _tensor_out(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    name = str(t.dtype).replace("torch.", "")
    if name not in _DTYPES:
        t, name = t.float(), "float32"
    raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return {"dtype": name, "shape": list(t.shape), "data": base64.b64encode(raw.numpy().tobytes()).decode()}


def _tensor_in(d: dict) -> torch.Tensor:
    dtype = _DTYPES[d["dtype"]]
    shape = [int(x) for x in d["shape"]]
    raw = bytearray(base64.b64decode(d["data"]))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def request_out(r: Request) -> dict:
    sp = asdict(r.params)
    return {"prompt": [int(t) for t in r.prompt], "params": sp, "top_logprobs": int(r.top_logprobs),
            "images": None if r.images is None else [_tensor_out(im) for im in r.images]}


def request_in(d: dict, device: Optional[torch.device] = None) -> Request:
    sp = {k: v for k, v in d["params"].items() if k in _SP_FIELDS}
    sp["stop_token_ids"], sp["stop"] = tuple(sp.get("stop_token_ids") or ()), tuple(sp.get("stop") or ())
    params = SamplingParams(**sp)
    params.validate()
    images = d.get("images")
    if images is not None:
        images = [_tensor_in(x).to(device) if device is not None else _tensor_in(x) for x in images]
    return Request([int(t) for t in d["prompt"]], params, images, int(d.get("top_logprobs") or 0))


def result_out(r: Result) -> dict:
    return {"completion": asdict(r.completion), "top": [[[int(i), float(v)] for i, v in row] for row in r.top]}


def result_in(d: dict) -> Result:
    c = d["completion"]
    comp = Completion(prompt_ids=[int(t) for t in c["prompt_ids"]], token_ids=[int(t) for t in c["token_ids"]],
                      logprobs=[float(v) for v in c["logprobs"]], finish_reason=str(c["finish_reason"]),
                      text=str(c["text"]))
    return Result(comp, [[(int(i), float(v)) for i, v in row] for row in d.get("top") or []])


def scores_in(d: dict, seqs: list) -> list:
    """The ``scores`` message's logprobs: ``len(seq) - 1`` finite floats per sequence of ``seqs``, else ValueError."""
    rows = d["logprobs"]
    if not isinstance(rows, list) or len(rows) != len(seqs):
        raise ValueError("a scores message holds another number of sequences than the request")
    out = []
    for row, s in zip(rows, seqs):
        if (not isinstance(row, list) or len(row) != max(len(s) - 1, 0)
                or not all(isinstance(v, float) and math.isfinite(v) for v in row)):
            raise ValueError("a scores message holds a row of the wrong length or a non-finite value")
        out.append(row)
    return out


def error_out(rid: int, e: BaseException) -> dict:
    kind = "inference" if isinstance(e, InferenceError) else "fault"
    return {"id": rid, "op": "error", "kind": kind, "message": f"{type(e).__name__}: {e}" if kind == "fault"
            else str(e)}


__all__ = ["send", "recv", "WireClosed", "request_out", "request_in", "result_out", "result_in", "scores_in",
           "error_out"]
