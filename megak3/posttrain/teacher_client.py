"""A MOPD teacher served over HTTP: ``rl.mopd_teachers=add=http://HOST:PORT`` instead of a checkpoint path.

The URL is a megak3 server (``python -m megak3.generate serve --checkpoint TEACHER``, one engine or
``--replicas N`` / ``--ray-address``: megak3/inference/server.py), so the teacher's weights live in the
server's processes, not in every trainer rank. Two requests, both OpenAI-shaped:

- ``GET /v1/models`` once at start: the model card's ``vocab_size``, ``tokenizer_sha256`` and
  ``special_ids`` (megak3's extensions) are checked against the student like a loaded teacher's
  (megak3/posttrain/mopd.py); an unreachable server or a card without them is refused there.
- ``POST /v1/completions`` with ``{"prompt": [[ids], ...], "echo": true, "max_tokens": 0, "logprobs": 0,
  "temperature": T}`` per micro-batch and teacher: every row of the teacher (prompt + response token ids)
  in one request; the answer's ``token_logprobs`` are the teacher's logprobs of each token after the first,
  at the trainer's temperature (``rl.temperature``; 0: untempered), computed by the server with the
  training forward (megak3/inference/scoring.py), at the server's ``--dtype`` (a teacher by path runs in
  the trainer's autocast). The request is the standard one (vLLM accepts it too), but only a megak3 server
  passes the start check.

The answer is untrusted: it is read up to a size bound, parsed as strict JSON (no NaN / Infinity), and
must hold exactly one choice per row (indexes 0 .. n-1 once each), each with one logprob per token, the
first null and the others finite numbers <= 0; otherwise :class:`TeacherError` names the teacher and what
was wrong. Connection errors, timeouts and 5xx / 429 answers are retried ``retries`` times (0.5 s, 1 s,
2 s, ... apart); every request waits at most ``timeout_s``.
"""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import List

import torch

MAX_BODY = 256 << 20
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # straight to the teacher, no proxy


class TeacherError(ValueError):
    """A served teacher that cannot be used (one line, naming it); a ValueError, so the CLI exits 2."""


def is_url(s: str) -> bool:
    return s.startswith(("http://", "https://"))


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class ServedTeacher:
    """The client of one served teacher (module docstring). ``name``: how errors call it."""

    def __init__(self, url: str, name: str, temperature: float = 1.0, timeout_s: float = 120.0, retries: int = 2):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
            raise TeacherError(f"{name}: {url!r} must be http://HOST:PORT (an OpenAI-compatible megak3 server)")
        try:
            u.port
        except ValueError:
            raise TeacherError(f"{name}: {url!r} has a bad port; use http://HOST:PORT") from None
        if not 0 <= temperature <= 2:
            raise TeacherError(f"{name}: rl.temperature={temperature} is outside a server's temperature range "
                               "[0, 2]; use a teacher by path")
        self.base = url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.name, self.temperature, self.timeout_s, self.retries = name, float(temperature), timeout_s, retries
        self.requests = 0
        """scoring requests made (one per micro-batch with rows of this teacher)"""

    # ---------------------------------------------------------------------------------------- HTTP
    def _http(self, method: str, path: str, body=None, limit: int = MAX_BODY) -> object:
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            req = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
            try:
                with _DIRECT.open(req, timeout=self.timeout_s) as resp:
                    raw = resp.read(limit + 1)
                break
            except urllib.error.HTTPError as e:
                msg = _error_message(e)
                if e.code < 500 and e.code != 429:   # the server refused the request: no retry helps
                    raise TeacherError(f"{self.name}: {method} {path} answered {e.code}: {msg}") from None
                last = f"answered {e.code}: {msg}"
            except (urllib.error.URLError, OSError) as e:   # refused, unreachable, timed out, reset
                reason = getattr(e, "reason", e)
                what = "did not answer" if isinstance(reason, TimeoutError) else "is unreachable"
                last = f"{what} ({type(reason).__name__}: {reason})"
        else:
            raise TeacherError(f"{self.name} {last} after {self.retries + 1} tries (timeout {self.timeout_s:g} s "
                               "each); start it with python -m megak3.generate serve --checkpoint TEACHER "
                               "--port PORT, or raise rl.mopd_timeout_s / rl.mopd_retries") from None
        if len(raw) > limit:
            raise TeacherError(f"{self.name}: the answer to {method} {path} is over {limit} bytes")
        try:
            return json.loads(raw, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise TeacherError(f"{self.name}: the answer to {method} {path} is not strict JSON "
                               f"({' '.join(str(e).split())[:120]})") from None

    # ------------------------------------------------------------------------------------ start check
    def facts(self) -> dict:
        """``{"vocab_size", "tokenizer_sha256", "special_ids"}`` of the served model (its model card)."""
        got = self._http("GET", "/v1/models", limit=1 << 20)
        try:
            card = got["data"][0]
            out = {"vocab_size": card["vocab_size"], "tokenizer_sha256": card["tokenizer_sha256"],
                   "special_ids": card["special_ids"]}
        except (KeyError, IndexError, TypeError):
            raise TeacherError(f"{self.name}: its GET /v1/models names no vocab_size, tokenizer_sha256 and "
                               "special_ids (serve the teacher with python -m megak3.generate serve)") from None
        ok = (_is_int(out["vocab_size"]) and isinstance(out["tokenizer_sha256"], str)
              and isinstance(out["special_ids"], dict) and all(_is_int(v) for v in out["special_ids"].values()))
        if not ok:
            raise TeacherError(f"{self.name}: its GET /v1/models has a vocab_size, tokenizer_sha256 or special_ids "
                               "of the wrong type")
        return out

    # ---------------------------------------------------------------------------------------- scoring
    def score(self, seqs: List[List[int]]) -> List[List[float]]:
        """``len(s) - 1`` teacher logprobs per sequence ``s`` (one request, every sequence)."""
        body = {"prompt": [[int(t) for t in s] for s in seqs], "echo": True, "max_tokens": 0, "logprobs": 0,
                "temperature": self.temperature}
        self.requests += 1
        got = self._http("POST", "/v1/completions", body, limit=MAX_BODY)
        return self.parse(got, seqs)

    def parse(self, got, seqs: List[List[int]]) -> List[List[float]]:
        """The checked logprobs of an echo answer ``got`` to ``seqs`` (module docstring), else TeacherError."""
        def bad(why):
            return TeacherError(f"{self.name}: a malformed scoring answer: {why}")

        choices = got.get("choices") if isinstance(got, dict) else None
        if not isinstance(choices, list) or len(choices) != len(seqs):
            n = len(choices) if isinstance(choices, list) else "no"
            raise bad(f"{n} choices for {len(seqs)} rows")
        out: List = [None] * len(seqs)
        for ch in choices:
            k = ch.get("index") if isinstance(ch, dict) else None
            if not _is_int(k) or not 0 <= k < len(seqs) or out[k] is not None:
                raise bad(f"choice index {k!r} is not one of 0..{len(seqs) - 1} once each")
            lp = ch.get("logprobs")
            vals = lp.get("token_logprobs") if isinstance(lp, dict) else None
            if not isinstance(vals, list) or len(vals) != len(seqs[k]):
                n = len(vals) if isinstance(vals, list) else "no"
                raise bad(f"row {k} has {n} token logprobs for its {len(seqs[k])} tokens")
            if vals and vals[0] is not None:
                raise bad(f"row {k}: the first token's logprob must be null")
            row = [_finite_float(v) for v in vals[1:]]
            for v, f in zip(vals[1:], row):
                if f is None or f > 1e-4:
                    raise bad(f"row {k} holds {str(v)[:40]}, not a finite log-probability <= 0")
            out[k] = row
        return out

    def logprobs(self, batch: dict) -> torch.Tensor:
        """[B, T] teacher logprobs of ``batch``'s targets (megak3/posttrain/update.py's response_batch rows:
        each row's tokens are its ``input_ids`` where ``real`` then its last target); 0 at padding."""
        ids, tgt, real = batch["input_ids"], batch["targets"], batch["real"]
        lens = [int(x) for x in real.sum(1)]
        seqs = [ids[b, :L].tolist() + [int(tgt[b, L - 1])] if L else [] for b, L in enumerate(lens)]
        rows = [i for i, s in enumerate(seqs) if s]
        out = torch.zeros(ids.shape, dtype=torch.float32)
        for i, lp in zip(rows, self.score([seqs[i] for i in rows]) if rows else []):
            out[i, :lens[i]] = torch.tensor(lp, dtype=torch.float32)
        return out.to(ids.device)


def _finite_float(v):
    """``v`` as a finite float, or None: not a JSON number (bools are not), not finite, or an integer too
    large for a float (JSON allows any)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _error_message(e) -> str:
    """The ``error.message`` of an OpenAI error answer (or its first 200 characters), one line."""
    try:
        raw = e.read(1 << 16)
        msg = json.loads(raw)["error"]["message"]
        msg = msg if isinstance(msg, str) else raw.decode(errors="replace")
    except Exception:  # noqa: BLE001 - whatever the body is, it is only shown
        msg = str(e.reason)
    return " ".join(str(msg).split())[:200]


__all__ = ["ServedTeacher", "TeacherError", "is_url"]
