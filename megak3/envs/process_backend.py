"""The worker pool on local processes: each worker is a ``python -m megak3.envs.worker`` child process.

Requests are JSON lines on the child's stdin, answered in order on its stdout; a reply that does not
come within ``reply_timeout`` seconds, a broken pipe or an exited child raise :class:`WorkerDied`, which
the pool (``pool.EnvPool``) answers by starting a replacement. ``ray_backend`` wraps the same worker in a
Ray actor.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from megak3.envs.sandbox import _pdeathsig


class WorkerDied(Exception):
    """A worker stopped answering: its process ended, its pipe broke, or a reply timed out."""


def worker_command(store: str, base: str, limits: Dict, store_limits: Optional[Dict] = None) -> List[str]:
    return [sys.executable, "-m", "megak3.envs.worker", "--store", store, "--base", base,
            "--limits", json.dumps(limits), "--store-limits", json.dumps(store_limits or {})]


class _Future:
    def __init__(self, fn):
        self.result = fn


class ProcessWorker:
    """A worker child process; requests are pipelined and answered in order (stderr: ``base/worker.log``).

    The worker exits when its stdin closes, i.e. when this process ends (after the command it is running,
    at most ``wall_seconds``). No parent-death signal by default: that signal follows the *thread* that
    started the worker, and the pool may start replacements from any thread.
    """

    def __init__(self, store: str, base: str, limits: Dict, reply_timeout: float, die_with_parent: bool = False,
                 store_limits: Optional[Dict] = None):
        self.reply_timeout = reply_timeout
        os.makedirs(base, exist_ok=True)
        cmd = worker_command(store, base, limits, store_limits) + (["--die-with-parent"] if die_with_parent else [])
        with open(os.path.join(base, "worker.log"), "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         preexec_fn=_pdeathsig if die_with_parent else None,
                                         env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        self.buf = b""
        self.isolation = self.submit({"op": "info"}).result()["isolation"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def submit(self, req: Dict):
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise WorkerDied(f"worker {self.pid}: {e}") from None
        return _Future(self._next_reply)

    def _next_reply(self) -> Dict:
        fd, deadline = self.proc.stdout.fileno(), time.monotonic() + self.reply_timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.kill()
                raise WorkerDied(f"worker {self.pid}: no reply in {self.reply_timeout:g} s")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.proc.wait()
                raise WorkerDied(f"worker {self.pid} exited (status {self.proc.returncode})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
