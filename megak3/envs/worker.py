"""An environment worker process: serves ``SandboxEnv`` episodes over JSON lines on stdin/stdout.

``python -m megak3.envs.worker --store DIR --base DIR [--limits JSON] [--store-limits JSON]``. At start
it enters a private mount namespace (so per-episode tmpfs quotas vanish with it, even on SIGKILL) and
prints the host's isolation line (``host.HostIsolation.describe``) on stderr. Each request is one JSON object with
``op`` (reset, step, snapshot, restore, fork, close, digest, info) and the op's fields; each reply
is ``{"ok": true, ...}`` or ``{"ok": false, "error": msg}``: a failing request never stops the worker.
``reset``/``step`` with ``"snapshot": true`` also snapshot the episode after the op (``SandboxEnv.save``)
and return its id; a tree the store refuses gets no id and a note in the observation (the step's reply
is still ``ok``: the model's text never makes a request fail). With ``"store_full": true`` only a
snapshot that needs no new file contents is taken.
The worker exits when stdin closes or its parent dies.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from typing import Dict, Optional

from megak3.envs.env import SandboxEnv
from megak3.envs.host import enter_private_mounts, host_isolation
from megak3.envs.sandbox import SandboxLimits, remove_stale_cgroups
from megak3.envs.snapshot import SnapshotStore, StoreLimits
from megak3.envs.toolcall import ToolCall


class WorkerServer:
    def __init__(self, store: str, base: str, limits: Dict, store_limits: Optional[Dict] = None):
        self.store = SnapshotStore(store, StoreLimits.from_dict(store_limits))
        self.base = base
        self.limits = SandboxLimits.from_dict(limits)
        self.envs: Dict[str, SandboxEnv] = {}
        os.makedirs(base, exist_ok=True)

    def env(self, eid: str) -> SandboxEnv:
        if eid not in self.envs:
            raise KeyError(f"episode {eid!r} is not on this worker")
        return self.envs[eid]

    def _new(self, eid: str) -> SandboxEnv:
        if eid in self.envs:
            self.envs.pop(eid).close()
        self.envs[eid] = SandboxEnv(eid, self.store, self.base, self.limits)
        return self.envs[eid]

    def handle(self, req: Dict) -> Dict:
        op, eid = req.get("op"), req.get("episode")
        if op == "info":
            return {"pid": os.getpid(), "isolation": host_isolation().describe(), "episodes": sorted(self.envs)}
        if op == "reset":
            env = self._new(eid)
            out = {"observation": env.reset(req["task"])}
        elif op == "step":
            env = self.env(eid)
            action = req["action"]
            if isinstance(action, dict):
                action = ToolCall(action.get("name"), action.get("arguments"))
            r = env.step(action)
            out = {"observation": r.observation, "done": r.done, "reward": r.reward, "info": r.info}
        elif op == "snapshot":
            env = self.env(eid)
            out = {"snap": env.snapshot()}
        elif op == "restore":
            env = self.envs.get(eid) or self._new(eid)
            env.restore(req["snap"])
            out = {}
        elif op == "fork":
            if req["new_episode"] in self.envs:
                raise ValueError(f"episode {req['new_episode']!r} already exists")
            src = self.env(eid)
            self.envs[req["new_episode"]] = src.fork(req.get("snap"), req["new_episode"])
            env = self.envs[req["new_episode"]]
            out = {}
        elif op == "close":
            self.envs.pop(eid).close() if eid in self.envs else None
            return {}
        elif op == "digest":
            env = self.env(eid)
            return {"digest": env.digest(req.get("mtimes", True)), "state": env.state, "uid": env.sandbox.uid}
        else:
            raise ValueError(f"unknown op {op!r}")
        if req.get("snapshot") and op in ("reset", "step"):
            snap, note = env.save(bool(req.get("store_full")))
            if note:
                out["observation"] += "\n" + note
                out.setdefault("info", {})["snapshot"] = note
            if snap:
                out["snap"] = snap
        if "snap" in out:
            s = env.last_stats
            out["snap_stats"] = {"seconds": s.seconds, "bytes_written": s.bytes_written, "files_hashed": s.files_hashed}
        out["state"] = dict(env.state)
        return out

    def close(self):
        for env in self.envs.values():
            env.close()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="megak3.envs.worker")
    ap.add_argument("--store", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--limits", default="{}")
    ap.add_argument("--store-limits", default="{}")
    ap.add_argument("--die-with-parent", action="store_true", help="SIGKILL when the parent thread ends")
    args = ap.parse_args(argv)
    try:
        limits = SandboxLimits.from_dict(json.loads(args.limits)).to_dict()
    except ValueError as e:                                       # also bad JSON (JSONDecodeError)
        print(f"megak3.envs.worker: error: --limits: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        store_limits = StoreLimits.from_dict(json.loads(args.store_limits)).to_dict()
    except (ValueError, TypeError) as e:
        print(f"megak3.envs.worker: error: --store-limits: {e}", file=sys.stderr)
        sys.exit(2)
    if args.die_with_parent:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)    # PR_SET_PDEATHSIG
    enter_private_mounts()
    remove_stale_cgroups()
    print(host_isolation().describe(), file=sys.stderr, flush=True)
    proto_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                                                 # stray prints go to stderr, not the protocol
    server = WorkerServer(args.store, args.base, limits, store_limits)
    try:
        for line in sys.stdin:
            try:
                reply = {"ok": True, **server.handle(json.loads(line))}
            except Exception as e:  # noqa: BLE001 - one bad request must not stop the worker
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            proto_out.write(json.dumps(reply) + "\n")
    finally:
        server.close()


if __name__ == "__main__":
    main()
