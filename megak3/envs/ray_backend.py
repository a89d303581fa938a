"""The worker pool on Ray: each worker is a Ray actor that owns one ``megak3.envs.worker`` process.

Ray places the actors (one CPU each by default) on whatever cluster ``ray.init`` joined; the pool's
recovery logic is the same as for local processes (``pool.EnvPool``). When this process has not
initialised Ray, ``RayWorker`` starts a local one bound to loopback (``127.0.0.1``) with the CPUs of
this machine, no dashboard. The actor's worker process exits when the actor's pipe closes, i.e. when
the actor dies.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from megak3.envs.process_backend import ProcessWorker, WorkerDied


def ensure_ray(num_cpus: int = None):
    if not ray.is_initialized():
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 _node_ip_address="127.0.0.1", configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})


@ray.remote(num_cpus=1, max_restarts=0)
class EnvWorkerActor:
    def __init__(self, store: str, base: str, limits: Dict, reply_timeout: float, store_limits: Optional[Dict] = None):
        self.worker = ProcessWorker(store, base, limits, reply_timeout, store_limits=store_limits)

    def call(self, req: Dict) -> Dict:
        try:
            return self.worker.submit(req).result()
        except WorkerDied:                       # the worker process died: let this actor die with it
            os._exit(1)

    def describe(self):
        return {"actor_pid": os.getpid(), "worker_pid": self.worker.pid, "isolation": self.worker.isolation}


class _RayFuture:
    def __init__(self, ref, timeout):
        self.ref, self.timeout = ref, timeout

    def result(self) -> Dict:
        try:
            return ray.get(self.ref, timeout=self.timeout)
        except (RayActorError, GetTimeoutError) as e:
            raise WorkerDied(f"ray worker: {type(e).__name__}") from None


class RayWorker:
    def __init__(self, store: str, base: str, limits: Dict, reply_timeout: float, store_limits: Optional[Dict] = None):
        ensure_ray()
        self.reply_timeout = reply_timeout
        self.actor = EnvWorkerActor.remote(store, base, limits, reply_timeout, store_limits)
        d = ray.get(self.actor.describe.remote(), timeout=reply_timeout)
        self.pid, self.worker_pid, self.isolation = d["actor_pid"], d["worker_pid"], d["isolation"]

    def submit(self, req: Dict) -> _RayFuture:
        return _RayFuture(self.actor.call.remote(req), self.reply_timeout)

    def kill(self):
        ray.kill(self.actor, no_restart=True)

    def close(self):
        ray.kill(self.actor, no_restart=True)
