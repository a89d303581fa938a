"""Load test of the OpenAI server: N concurrent clients x M requests, then every request again alone.

    python tools/bench_serve.py --checkpoint runs/X --clients 32 --requests 4     # starts the server itself
    python tools/bench_serve.py --url http://127.0.0.1:8000 --clients 8 --requests 2
    python tools/bench_serve.py --checkpoint runs/X --replicas 2 --checkpoint-interval 16   # 1 vs 2 replicas

Without ``--url`` the server is started as ``python -m megak3.generate serve --checkpoint X --port 0``
on 127.0.0.1 (a free port) and stopped at the end; ``--url`` must be on 127.0.0.1 / localhost.

Workload (fixed by ``--seed``): request ``r`` is a greedy completion (temperature 0, ignore_eos)
of one of ``--prefixes`` shared prefixes of ``--prefix-words`` words plus a suffix of 1 ..
``--suffix-words`` words of its own, with ``max_tokens`` drawn from ``--min-tokens`` ..
``--max-tokens``; every ``--stream-every``-th request is streamed (its time to first token is
when the first text event arrives). Clients send their requests back to back; none starts after
``--duration`` seconds, and each has an HTTP timeout.

Printed: for the concurrent phase, requests/s, generated tokens/s, TTFT p50/p99 (streamed
requests), latency p50/p99 (all), errors; the same for the baseline (every request alone, one at a
time, non-streamed) and the ratio concurrent / alone; how many outputs equal the same request
alone; the server's peak RSS (when it was started here) and peak cache pages in use (the server's
``megak3_cache_pages_peak``: since the server started) and its prefix-cache hit rate and hit tokens.

``--replicas N`` (N > 1, with ``--checkpoint``): after the above on a one-engine server (the
baseline), the same concurrent phase runs against a ``serve --replicas N`` server started with the
same options; printed: its requests/s and generated tokens/s, the ratio N replicas / 1 replica,
its outputs equal to the lone runs, and the engines' prefix-cache hit rate and hit tokens beside
the router's expected (routed) hit tokens. Exit status 0 when there were no errors and every output equals its lone run, else 1;
bad arguments: one line, exit 2.
"""
import http.client
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from megak3.cli import Parser, error_exit  # noqa: E402

WORDS = ("the quick brown fox jumps over lazy dog def main return class point self value list sum len "
         "for in if else while import from data model token cache page prefix stream batch").split()
LOCAL = ("127.0.0.1", "localhost")


def workload(a):
    """[(body, streamed)] of every request, in the order clients take them."""
    rnd = random.Random(a.seed)
    prefixes = [" ".join(rnd.choice(WORDS) for _ in range(a.prefix_words)) for _ in range(a.prefixes)]
    out = []
    for r in range(a.clients * a.requests):
        suffix = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(1, a.suffix_words)))
        body = {"prompt": f"{rnd.choice(prefixes)} {suffix}", "max_tokens": rnd.randint(a.min_tokens, a.max_tokens),
                "temperature": 0, "ignore_eos": True}
        out.append((body, a.stream_every > 0 and r % a.stream_every == a.stream_every - 1))
    return out


def call(host, port, body, stream, timeout):
    """(text, completion tokens, finish reason, ttft or None, latency) of one request; raises on errors."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": stream,
                                                                 **({"stream_options": {"include_usage": True}}
                                                                    if stream else {})}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        if not stream:
            r = json.loads(resp.read())
            ch = r["choices"][0]
            return ch["text"], r["usage"]["completion_tokens"], ch["finish_reason"], None, time.perf_counter() - t0
        text, ttft, finish, ntok = [], None, None, 0
        while True:
            line = resp.readline()
            if not line:
                raise RuntimeError("stream ended without [DONE]")
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"error event: {ev['error']}")
            if ev.get("usage") and not ev["choices"]:
                ntok = ev["usage"]["completion_tokens"]
                continue
            ch = ev["choices"][0]
            if ttft is None:
                ttft = time.perf_counter() - t0
            text.append(ch["text"])
            finish = ch["finish_reason"] or finish
        return "".join(text), ntok, finish, ttft, time.perf_counter() - t0
    finally:
        conn.close()


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Sampler:
    """``megak3_cache_pages_peak`` from /metrics and the peak RSS of ``pid``, read once at the end."""

    def __init__(self, host, port, pid=None):
        self.host, self.port, self.pid = host, port, pid
        self.pages, self.pool, self.hit_rate, self.hit_tokens, self.routed = 0.0, 0.0, 0.0, 0.0, 0.0

    def sample(self):
        try:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
            conn.close()
        except OSError:
            return
        for name, attr in (("megak3_cache_pages_peak", "pages"), ("megak3_cache_pages_total", "pool"),
                           ("megak3_prefix_cache_hit_rate", "hit_rate"),
                           ("megak3_prefix_cache_hit_tokens_total", "hit_tokens")):
            m = re.search(rf"^{name} (\S+)$", text, re.M)
            if m:
                setattr(self, attr, max(getattr(self, attr), float(m.group(1))))
        self.routed = sum(float(x) for x in re.findall(r"^megak3_replica_routed_prefix_hit_tokens_total\S* (\S+)$",
                                                        text, re.M))

    def peak_rss_mib(self):
        if self.pid is None:
            return None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None


def run_phase(host, port, reqs, clients, duration, timeout):
    """Results per request index (None where not sent) and the phase's wall seconds."""
    results = [None] * len(reqs)
    nxt = iter(range(len(reqs)))
    lock = threading.Lock()
    t_end = time.perf_counter() + duration

    def client():
        while time.perf_counter() < t_end:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            body, stream = reqs[i]
            try:
                results[i] = call(host, port, body, stream, timeout)
            except Exception as e:  # noqa: BLE001 - counted and shown
                results[i] = e

    t0 = time.perf_counter()
    ts = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(duration + timeout + 5)
    return results, time.perf_counter() - t0


def summary(name, results, seconds):
    ok = [r for r in results if isinstance(r, tuple)]
    errors = [r for r in results if isinstance(r, BaseException)]
    toks = sum(r[1] for r in ok)
    ttft = [r[3] for r in ok if r[3] is not None]
    lat = [r[4] for r in ok]
    print(f"{name}: {len(ok) + len(errors)} requests in {seconds:.2f} s: {len(ok) / seconds:.2f} requests/s, "
          f"{toks / seconds:.1f} generated tokens/s, errors {len(errors)}")
    print(f"  TTFT p50 {pct(ttft, 50):.3f} s p99 {pct(ttft, 99):.3f} s ({len(ttft)} streamed); "
          f"latency p50 {pct(lat, 50):.3f} s p99 {pct(lat, 99):.3f} s")
    for e in errors[:3]:
        print(f"  error: {type(e).__name__}: {str(e)[:200]}")
    return len(ok) / seconds, len(errors)


def start_server(a, replicas=1):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "megak3.generate", "serve", "--checkpoint", a.checkpoint,
                          "--port", "0", "--host", "127.0.0.1", "--model-name", "bench", "--threads", str(a.threads),
                          "--replicas", str(replicas), "--checkpoint-interval", str(a.checkpoint_interval)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    box = {}
    reader = threading.Thread(target=lambda: box.setdefault("line", p.stdout.readline()), daemon=True)
    reader.start()
    reader.join(a.start_timeout)
    line = box.get("line", "")
    m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    if not m:
        p.kill()
        err = p.stderr.read()[-400:] if p.poll() is not None else "no 'serving' line in time"
        raise RuntimeError(f"the server did not start: {err.strip()}")
    return p, int(m.group(1))


def replicated_phase(a, reqs, sent, alone, rps1) -> bool:
    """The concurrent phase again on a ``--replicas N`` server; True when it had no errors and every
    output equals its lone run."""
    try:
        server, port = start_server(a, a.replicas)
    except RuntimeError as e:
        print(f"{a.replicas} replicas: {e}")
        return False
    try:
        conc, secs = run_phase("127.0.0.1", port, reqs, a.clients, a.duration, a.timeout)
        rps, errors = summary(f"concurrent, {a.replicas} replicas", conc, secs)
        print(f"{a.replicas} replicas / 1 engine: {rps / rps1 if rps1 else float('nan'):.2f}x requests/s")
        equal = sum(1 for i, r in zip(sent, alone) if isinstance(conc[i], tuple) and isinstance(r, tuple)
                    and conc[i][:3] == r[:3])
        print(f"outputs equal to the same request alone ({a.replicas} replicas): {equal}/{len(reqs)}")
        s = Sampler("127.0.0.1", port)
        s.sample()
        print(f"{a.replicas} replicas: prefix-cache hit rate {s.hit_rate:.2f}, hit tokens {s.hit_tokens:.0f} "
              f"(routed: {s.routed:.0f} expected by the router)")
        return errors == 0 and equal == len(reqs)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def main(argv=None) -> int:
    p = Parser(prog="tools/bench_serve.py", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="start a server on this checkpoint (127.0.0.1, a free port)")
    src.add_argument("--url", help="a running server on 127.0.0.1, e.g. http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--prefixes", type=int, default=4, help="shared prefixes")
    p.add_argument("--prefix-words", type=int, default=12)
    p.add_argument("--suffix-words", type=int, default=6)
    p.add_argument("--min-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stream-every", type=int, default=2, help="stream every k-th request (0 = none)")
    p.add_argument("--duration", type=float, default=600.0, help="no request starts after this many seconds")
    p.add_argument("--timeout", type=float, default=300.0, help="HTTP timeout per request, seconds")
    p.add_argument("--threads", type=int, default=1, help="the started server's torch threads")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=1,
                   help="also run the concurrent phase on a server with this many engine replicas (needs --checkpoint)")
    p.add_argument("--checkpoint-interval", type=int, default=512, help="the started servers' KDA checkpoint interval")
    a = p.parse_args(argv)
    if a.replicas < 1 or (a.replicas > 1 and not a.checkpoint):
        p.error(f"--replicas {a.replicas} must be >= 1, and above 1 it needs --checkpoint "
                "(the servers are started here)")
    for name in ("clients", "requests", "prefixes", "prefix_words", "suffix_words", "min_tokens", "threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    if a.max_tokens < a.min_tokens:
        p.error(f"--max-tokens {a.max_tokens} must be >= --min-tokens {a.min_tokens}")
    if a.stream_every < 0 or a.duration <= 0 or a.timeout <= 0:
        p.error("--stream-every must be >= 0, --duration and --timeout > 0")
    server = None
    try:
        if a.url:
            u = urlparse(a.url)
            if u.scheme != "http" or u.hostname not in LOCAL or not u.port:
                raise ValueError(f"--url {a.url}: give http://127.0.0.1:PORT (this benchmark only talks to this "
                                 "machine)")
            host, port = "127.0.0.1", u.port
        else:
            if not Path(a.checkpoint).exists():
                raise ValueError(f"--checkpoint {a.checkpoint}: no such file or directory")
            server, port = start_server(a)
            host = "127.0.0.1"
    except (ValueError, RuntimeError) as e:
        return error_exit(p.prog, e)
    try:
        reqs = workload(a)
        sampler = Sampler(host, port, server.pid if server else None)
        print(f"bench_serve: {a.clients} clients x {a.requests} requests, {a.prefixes} shared prefixes, "
              f"max_tokens {a.min_tokens}-{a.max_tokens}, streamed: {f'1 in {a.stream_every}' if a.stream_every else 'none'}")
        conc, secs = run_phase(host, port, reqs, a.clients, a.duration, a.timeout)
        rps, errors = summary("concurrent", conc, secs)
        sent = [i for i, r in enumerate(conc) if r is not None]
        alone_reqs = [(reqs[i][0], False) for i in sent]
        alone, secs1 = run_phase(host, port, alone_reqs, 1, a.duration, a.timeout)
        rps1, errors1 = summary("alone (baseline: one at a time, not streamed)", alone, secs1)
        print(f"concurrent / alone: {rps / rps1 if rps1 else float('nan'):.2f}x requests/s")
        equal = sum(1 for i, r in zip(sent, alone) if isinstance(conc[i], tuple) and isinstance(r, tuple)
                    and conc[i][:3] == r[:3])
        print(f"outputs equal to the same request alone: {equal}/{len(reqs)}")
        sampler.sample()
        rss = sampler.peak_rss_mib()
        print(f"peak server RSS: {f'{rss:.1f} MiB' if rss is not None else 'n/a (--url)'}; "
              f"peak cache pages in use: {sampler.pages:.0f} / {sampler.pool:.0f}; prefix-cache hit rate "
              f"{sampler.hit_rate:.2f}, hit tokens {sampler.hit_tokens:.0f}")
        ok = errors == 0 and errors1 == 0 and equal == len(reqs)
        if a.replicas > 1:
            ok = replicated_phase(a, reqs, sent, alone, rps) and ok
        return 0 if ok else 1
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    sys.exit(main())
