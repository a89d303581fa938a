"""The environment interface the rollout loop calls, and its sandbox implementation.

``Environment``: ``reset(task) -> observation``; ``step(text or ToolCall) -> StepResult(observation,
done, reward, info)``; ``snapshot() -> id``; ``restore(id)``; ``fork(id, episode_id) -> Environment``;
``close()``. ``SandboxEnv`` runs each episode in a ``ProcessSandbox`` and snapshots it into a shared
``SnapshotStore``. Episode state (task spec, turn, done, reward) is a small JSON dict stored inside
every snapshot, so a snapshot id alone brings an episode back, on any worker that sees the store.
Model text is read with ``toolcall.parse_tool_call``; a malformed call, a refused path or a failed
command is the next observation (it uses a turn), never an exception out of ``step``; error text
names sandbox paths (``/work/...``), never the host's. ``save()`` is the snapshot taken after a
step: a tree the store refuses (``snapshot.SnapshotRefused``: over ``StoreLimits``) or cannot read is
not saved, and the note it returns goes into the observation; the episode goes on, and its last
saved snapshot stays its restore point.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple, Union

from megak3.envs.host import host_isolation
from megak3.envs.sandbox import ProcessSandbox, SandboxError, SandboxLimits, remove_tree
from megak3.envs.snapshot import SnapshotRefused, SnapshotStats, SnapshotStore, TreeCache, tree_digest
from megak3.envs.tasks import make_task
from megak3.envs.toolcall import TOOLS, ToolCall, ToolCallError, parse_tool_call

UID_BASE, UID_SPAN = 100000, 800000


@dataclass
class StepResult:
    observation: str
    done: bool
    reward: float
    info: Dict[str, Any] = field(default_factory=dict)


class Environment(ABC):
    @abstractmethod
    def reset(self, task) -> str: ...

    @abstractmethod
    def step(self, action: Union[str, ToolCall]) -> StepResult: ...

    @abstractmethod
    def snapshot(self) -> str: ...

    @abstractmethod
    def restore(self, snap_id: str) -> None: ...

    @abstractmethod
    def fork(self, snap_id: Optional[str], episode_id: str) -> "Environment": ...

    @abstractmethod
    def close(self) -> None: ...


def uid_lock_dir() -> str:
    """Host-wide directory of uid claims (``/run/megak3-envs-uids``, else under the temp directory)."""
    for d in ("/run/megak3-envs-uids", os.path.join(tempfile.gettempdir(), "megak3-envs-uids")):
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            return d
        except OSError:
            continue
    raise OSError("no writable directory for uid claims")


def claim_uid(episode_id: str) -> Tuple[int, int]:
    """An unprivileged uid no other live sandbox on this host holds: (uid, fd of its claim).

    The claim is an exclusive ``flock`` on ``uid_lock_dir()/<uid>``, held while the fd is open; the
    kernel drops it when the holder exits, even on SIGKILL, so a dead worker's uids come free by
    themselves. The search starts at a hash of the episode id, so an episode usually gets the same uid.
    """
    d = uid_lock_dir()
    start = int(hashlib.sha256(episode_id.encode()).hexdigest()[:12], 16)
    for k in range(UID_SPAN):
        uid = UID_BASE + (start + k) % UID_SPAN
        fd = os.open(os.path.join(d, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise OSError(f"all {UID_SPAN} sandbox uids are in use")


def _reason(e: BaseException) -> str:
    """An error's text without the host paths an ``OSError`` carries."""
    if isinstance(e, OSError):
        return e.strerror or type(e).__name__
    return str(e)


def _sandbox_path(rel: str) -> str:
    """``/work/<rel>`` as printable text (undecodable bytes as ``\\xNN``)."""
    return "/work/" + os.fsencode(rel).decode("utf-8", "backslashreplace")


def tool_help() -> str:
    """The tool text of the first observation, true to this host's mode (``host.host_isolation``)."""
    namespaces = host_isolation().unshare is not None
    names = ", ".join(f"{n}({', '.join(list(req) + list(opt))})" for n, (req, opt) in TOOLS.items())
    head = f'Call one tool per turn as <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>. Tools: {names}. '
    if namespaces:
        return head + ("Files live in /work and only /work is kept between calls; /tmp is fresh each call, no "
                       "process outlives its call, and there is no network.")
    return head + ("Your files live in your working directory, the only place kept between calls; the file tools "
                   "call it /work. Commands start in it but see the host's filesystem, where /work and /tmp are "
                   "not yours and your directory's absolute path is closed to you: use relative paths (in sh, "
                   "cd -P). No process outlives its call.")


class SandboxEnv(Environment):
    """One episode in a process sandbox under ``base_dir/<episode_id>``."""

    def __init__(self, episode_id: str, store: SnapshotStore, base_dir: str, limits: Optional[SandboxLimits] = None):
        if not episode_id or "/" in episode_id or episode_id.startswith("."):
            raise ValueError(f"episode_id={episode_id!r} must be a non-empty name without '/'")
        self.episode_id, self.store, self.base_dir = episode_id, store, base_dir
        self.limits = (limits or SandboxLimits()).validate()
        self.sandbox: Optional[ProcessSandbox] = None
        self.uid_claim: Optional[Tuple[int, int]] = None     # (uid, fd holding its flock)
        self.cache = TreeCache()
        self.task = None
        self.state: Dict[str, Any] = {}
        self.last_stats: Optional[SnapshotStats] = None

    # ---- sandbox lifetime -----------------------------------------------------------------------
    def _fresh_sandbox(self) -> ProcessSandbox:
        if self.sandbox is not None:
            self.sandbox.destroy()
        workdir = os.path.join(self.base_dir, self.episode_id)
        if os.path.lexists(workdir):               # left by a killed worker on a shared base_dir
            remove_tree(workdir)
        if self.uid_claim is None:
            self.uid_claim = claim_uid(self.episode_id)
        self.sandbox = ProcessSandbox(workdir, self.uid_claim[0], self.limits,
                                      scratch=os.path.join(self.base_dir, ".scratch"))
        self.cache = TreeCache()
        return self.sandbox

    # ---- interface ------------------------------------------------------------------------------
    def reset(self, task) -> str:
        self.task = make_task(task)
        sb = self._fresh_sandbox()
        for path, content in sorted(self.task.files.items()):
            sb.write_file(path, content)
        self.state = {"episode_id": self.episode_id, "task": self.task.spec, "turn": 0, "done": False,
                      "reward": 0.0}
        return f"{self.task.prompt}\n{tool_help()}"

    def step(self, action) -> StepResult:
        if self.sandbox is None or self.task is None:
            return StepResult("error: no episode; call reset first", True, 0.0, {"error": "no episode"})
        st = self.state
        if st["done"]:
            return StepResult("error: the episode is over", True, st["reward"], {"error": "done"})
        st["turn"] += 1
        call = parse_tool_call(action)
        info: Dict[str, Any] = {"turn": st["turn"]}
        if isinstance(call, ToolCallError):
            obs, info["error"] = f"error: {call.message}", "malformed"
        elif call.name == "submit":
            try:
                st["reward"] = float(self.task.score(call.arguments["answer"], self.sandbox))
            except (OSError, SandboxError) as e:       # the scorer could not run: a failed submission
                st["reward"], info["error"] = 0.0, f"score failed: {_reason(e)}"
            st["done"] = True
            obs = f"submitted; reward {st['reward']:g}"
        else:
            info["tool"] = call.name
            try:
                obs = self._call_tool(call)
            except SandboxError as e:
                obs, info["error"] = f"error: {e}", "refused"
            except (OSError, ValueError) as e:        # e.g. a NUL byte in a command, unencodable text
                obs, info["error"] = f"error: {type(e).__name__}: {_reason(e)}", "failed"
        if not st["done"] and st["turn"] >= self.task.max_turns:
            st["done"] = True
            obs += f"\n[turn limit {self.task.max_turns} reached; episode over]"
        return StepResult(obs, st["done"], st["reward"], info)

    def _call_tool(self, call: ToolCall) -> str:
        sb, a = self.sandbox, call.arguments
        if call.name == "shell":
            return sb.shell(a["cmd"])
        if call.name == "python":
            return sb.python_code(a["code"])
        if call.name == "read_file":
            return sb.read_file(a["path"])
        if call.name == "write_file":
            return sb.write_file(a["path"], a["content"])
        if call.name == "list_dir":
            return sb.list_dir(a["path"])
        raise SandboxError(f"tool {call.name!r} is not served by this environment")

    def snapshot(self, new_bytes: Optional[int] = None) -> str:
        if self.sandbox is None:
            raise RuntimeError(f"episode {self.episode_id}: nothing to snapshot before reset")
        snap_id, self.last_stats = self.store.snapshot(self.sandbox.workdir, self.cache, dict(self.state), new_bytes)
        return snap_id

    def save(self, store_full: bool = False) -> Tuple[Optional[str], str]:
        """The snapshot after a step: (id or None, note for the observation or ""); never raises.
        ``store_full``: only a snapshot that needs no new file contents in the store is taken."""
        try:
            snap_id = self.snapshot(0 if store_full else None)
        except (SnapshotRefused, OSError) as e:       # OSError: e.g. an unreadable file when not root
            why = str(e) if isinstance(e, SnapshotRefused) else f"the snapshot failed: {_reason(e)}"
            return None, f"[not saved: {why}. Until a turn is saved, a restore of this episode goes back to " \
                         f"its last saved turn]"
        skipped = self.last_stats.skipped
        if not skipped:
            return snap_id, ""
        names = ", ".join(_sandbox_path(r) for r in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        return snap_id, f"[not saved: {len(skipped)} fifo/socket/device entries ({names}); snapshots keep only " \
                        f"files, directories and symlinks]"

    def restore(self, snap_id: str) -> None:
        self.store.manifest(snap_id)                   # unknown id: KeyError before touching the tree
        if self.sandbox is None:
            self._fresh_sandbox()
        try:
            state, self.last_stats = self.store.restore(snap_id, self.sandbox.workdir, self.cache, self._owner())
        except OSError:                                # the tree could not be made over in place: start empty
            self._fresh_sandbox()
            state, self.last_stats = self.store.restore(snap_id, self.sandbox.workdir, self.cache, self._owner())
        self.state = {**state, "episode_id": self.episode_id}
        self.task = make_task(state["task"])

    def _owner(self) -> Optional[int]:
        """The uid restored entries get: the episode's (only root can give files away)."""
        return self.sandbox.uid if self.sandbox.iso.is_root else None

    def fork(self, snap_id: Optional[str], episode_id: str) -> "SandboxEnv":
        """A new, independent episode ``episode_id`` starting from ``snap_id`` (default: a fresh snapshot)."""
        snap_id = snap_id or self.snapshot()
        other = SandboxEnv(episode_id, self.store, self.base_dir, self.limits)
        other.restore(snap_id)
        return other

    def digest(self, mtimes: bool = True) -> str:
        """sha256 of the tree (paths, kinds, modes, mtimes unless ``mtimes=False``, bytes) — for checks."""
        return tree_digest(self.sandbox.workdir, mtimes)

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.destroy()
            self.sandbox = None
        if self.uid_claim is not None:
            os.close(self.uid_claim[1])
            self.uid_claim = None
