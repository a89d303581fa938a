"""A process sandbox for one episode: its own directory, limited subprocesses, confined path tools.

Every tool command (``run``) starts ``jail.py`` (see there) under ``unshare`` when the host allows
namespaces: the command sees only the system directories (read-only), its episode directory at
``/work`` and a fresh ``/tmp``; it runs as the episode's own uid with no network and the rlimits of
``SandboxLimits``; a pids cgroup caps its process count and a memory cgroup the resident memory of
all its processes together, where the host lets them be created. Nothing outlives
a command: the pid namespace dies with it (without namespaces the worker kills what is left in the
command's cgroup and every process of the episode's uid). Output is merged stdout+stderr,
truncated to ``output_bytes``; the wall-clock limit kills the whole process group.

The path tools (``read_file``, ``write_file``, ``list_dir``) run in the worker itself (root), between
commands, on a tree the agent wrote: they never resolve a host path through it. Each starts from a
directory fd of the episode root, opened when the sandbox is made, and walks one component at a time
without following links (``fdpath``); symlinks are resolved by hand inside the episode root (an
absolute target means the sandbox's ``/work``). Paths are ``/work/...`` or relative; ``..`` above
``/work``, other absolute paths and symlinks leading outside are refused. ``read_file`` opens the
last component with ``O_NOFOLLOW | O_NONBLOCK`` and reads only a regular file; ``write_file`` writes a
temporary file under an unpredictable name (``O_EXCL | O_NOFOLLOW``, ``fchown`` to the episode uid) and
renames it over the target within the same directory fd, so it never writes through a symlink or a
hard link; missing parents are made with ``mkdirat`` + ``fchown``. Error texts name only the path the
model gave. In the worker's private mount namespace (see ``host.enter_private_mounts``) the episode
directory is its own tmpfs: a hard disk quota (``disk_bytes``, ``max_files`` inodes), and hard links to
files outside it are impossible (EXDEV).
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import secrets
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Optional, Tuple

from megak3.envs.fdpath import DIR_FLAGS, open_dir, open_dirs, remove_tree, tree_bytes
from megak3.envs.host import UNSHARE_ARGS, host_isolation

JAIL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jail.py")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
PR_SET_PDEATHSIG = 1
MNT_DETACH = 2
MAX_SYMLINKS = 40
KILL_SECONDS = 10.0          # cleanup bound: killing an episode uid's processes, then removing its cgroups


class SandboxError(Exception):
    """A tool call the sandbox refused; its message is the model's observation."""


@dataclass
class SandboxLimits:
    """Per-command and per-episode limits (all checked by ``validate``)."""
    cpu_seconds: int = 10           # RLIMIT_CPU per process (SIGXCPU at the limit)
    wall_seconds: float = 20.0      # the whole command, then SIGKILL of its process group/namespace
    memory_bytes: int = 512 << 20   # RLIMIT_AS per process, and the memory cgroup limit of the whole command
    file_bytes: int = 16 << 20      # RLIMIT_FSIZE: largest file a command may write
    disk_bytes: int = 64 << 20      # the episode directory's tmpfs size (and each command's /tmp)
    max_files: int = 20000          # inodes of that tmpfs
    max_procs: int = 64             # pids cgroup pids.max and RLIMIT_NPROC of the episode uid
    open_files: int = 256           # RLIMIT_NOFILE
    output_bytes: int = 8192        # observation text kept per tool call

    def validate(self) -> "SandboxLimits":
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"limits.{f.name}={v!r} must be a positive number")
        return self

    @classmethod
    def from_dict(cls, d: Optional[Dict]) -> "SandboxLimits":
        names = {f.name for f in fields(cls)}
        bad = sorted(set(d or {}) - names)
        if bad:
            raise ValueError(f"limits.{bad[0]}: no such field (fields: {', '.join(sorted(names))})")
        return cls(**(d or {})).validate()

    def to_dict(self) -> Dict:
        return asdict(self)


@dataclass
class CommandResult:
    exit_code: int
    output: str
    output_bytes: int               # bytes the command wrote in all (output keeps the first output_bytes)
    timed_out: bool
    seconds: float
    oom_killed: bool = False        # the command's memory cgroup killed a process


    def observation(self, limits: SandboxLimits) -> str:
        notes = []
        if self.oom_killed:
            notes.append(f"memory limit {limits.memory_bytes} bytes reached: a process was killed")
        if self.timed_out:
            notes.append(f"killed: wall-clock limit {limits.wall_seconds:g} s")
        elif self.exit_code == 128 + signal.SIGXCPU or self.exit_code == 128 + signal.SIGKILL:
            notes.append(f"killed by signal {self.exit_code - 128} (CPU-time limit {limits.cpu_seconds} s "
                         f"or memory)")
        elif self.exit_code == 128 + signal.SIGXFSZ:
            notes.append(f"killed: file-size limit {limits.file_bytes} bytes")
        elif self.exit_code > 128:
            notes.append(f"killed by signal {self.exit_code - 128}")
        head = f"[exit {self.exit_code}" + "".join(f"; {n}" for n in notes) + "]"
        text = head + ("\n" + self.output if self.output else "")
        if self.output_bytes > limits.output_bytes:
            text += f"\n[output truncated: first {limits.output_bytes} of {self.output_bytes} bytes]"
        return text


def _printable(name: str) -> str:
    """A file name as observation text: bytes that are not UTF-8 as ``\\xNN`` (never lone surrogates)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _pdeathsig():
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _libc_mount(src, dst, fstype, data):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(src.encode(), dst.encode(), fstype.encode(), ctypes.c_ulong(2 | 4), data.encode()) != 0:
        raise OSError(ctypes.get_errno(), f"mount {fstype} on {dst}")


def _proc_status(pid) -> Dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(l.split(":", 1) for l in f if ":" in l)


def _kill_uid(uid: int) -> Tuple[int, int, int]:
    """SIGKILL every live process whose real uid is ``uid`` (the episode's own; never 0).

    Returns (live processes signalled, zombies about to be reaped, stuck zombies). A zombie is dead
    already and no signal removes it, only its parent's ``wait``: one whose parent is init or dying
    (of this uid) goes soon, one whose live parent never waits (a process of another uid) stays.
    Counting zombies as live made the cleanup loop spin until its deadline and skip the cgroups."""
    assert uid != 0
    killed = reaping = stuck = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            st = _proc_status(pid)
            if int(st["Uid"].split()[0]) != uid:
                continue
            if st["State"].split()[0] not in ("Z", "X"):
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
                continue
            ppid = int(st["PPid"])
            try:
                parent_uid = int(_proc_status(ppid)["Uid"].split()[0]) if ppid > 1 else uid
            except OSError:
                parent_uid = uid                        # the parent is gone: init adopts and reaps it
            if parent_uid == uid:
                reaping += 1
            else:
                stuck += 1
        except (OSError, KeyError, IndexError, ValueError):
            continue
    return killed, reaping, stuck


def remove_stale_cgroups() -> int:
    """Remove the command cgroups of workers that no longer exist (killed mid-command); return how many."""
    iso, removed = host_isolation(), 0
    for parent in (iso.pids_cgroup, iso.memory_cgroup):
        if not parent:
            continue
        for name in os.listdir(parent):
            owner = name.split("-", 1)[0]
            path = os.path.join(parent, name)
            if not owner.isdigit() or not os.path.isdir(path) or os.path.exists(f"/proc/{owner}"):
                continue
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    for pid in f.read().split():
                        os.kill(int(pid), signal.SIGKILL)
                os.rmdir(path)
                removed += 1
            except OSError:
                pass
    return removed


class ProcessSandbox:
    """One episode's directory and the commands run in it. ``uid`` must be > 0 and unique per episode."""

    def __init__(self, workdir: str, uid: int, limits: SandboxLimits, scratch: str):
        assert uid > 0, "commands never run as root"
        self.workdir, self.uid, self.limits = os.path.abspath(workdir), uid, limits
        self.iso = host_isolation()
        self.jail_root = os.path.join(scratch, "jailroot")
        self.cgroup_seq = 0
        os.makedirs(self.jail_root, exist_ok=True)
        os.makedirs(self.workdir, exist_ok=False)
        self.quota_mount = False
        if self.iso.private_mounts:
            _libc_mount("tmpfs", self.workdir, "tmpfs",
                        f"size={limits.disk_bytes},nr_inodes={limits.max_files},mode=0700")
            self.quota_mount = True
        self.root_fd = os.open(self.workdir, DIR_FLAGS)     # every path tool starts here
        os.fchmod(self.root_fd, 0o700)
        if self.iso.is_root:
            os.fchown(self.root_fd, uid, uid)
        self.python = shutil.which("python3", path=SANDBOX_PATH) or sys.executable

    # ---- commands -------------------------------------------------------------------------------
    def shell(self, cmd: str) -> str:
        return self.run(["/bin/sh", "-c", cmd])

    def python_code(self, code: str) -> str:
        return self.run([self.python, "-c", code])

    def run(self, argv: List[str]) -> str:
        if any("\0" in a for a in argv):
            raise SandboxError("a command may not contain NUL bytes")
        res = self.run_command(argv)
        text = res.observation(self.limits)
        if not self.quota_mount:
            used = self.disk_usage()
            if used > self.limits.disk_bytes:
                text += f"\n[disk quota exceeded: {used} > {self.limits.disk_bytes} bytes; delete files]"
        return text

    def run_command(self, argv: List[str]) -> CommandResult:
        lim, ns = self.limits, self.iso.unshare is not None
        cgroups = self._make_cgroups()
        spec = {
            "root": self.jail_root, "work": self.workdir, "uid": self.uid, "gid": self.uid,
            "cgroups": list(cgroups.values()),
            "namespaces": ns, "cgroup_ns": self.iso.cgroup_ns, "tmp_bytes": lim.disk_bytes, "argv": argv,
            "env": {"PATH": SANDBOX_PATH, "HOME": "/work" if ns else self.workdir, "LANG": "C.UTF-8",
                    "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"},
            "rlimits": {"RLIMIT_CPU": int(lim.cpu_seconds), "RLIMIT_AS": int(lim.memory_bytes),
                        "RLIMIT_FSIZE": int(lim.file_bytes), "RLIMIT_NPROC": int(lim.max_procs),
                        "RLIMIT_NOFILE": int(lim.open_files), "RLIMIT_CORE": 0},
        }
        cmd = [sys.executable, "-I", "-S", JAIL]
        if ns:
            cmd = [self.iso.unshare, *UNSHARE_ARGS, "--", *cmd]
        t0 = time.monotonic()
        deadline = t0 + lim.wall_seconds
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_pdeathsig,
                                env={"PATH": SANDBOX_PATH, "MEGAK3_JAIL_SPEC": json.dumps(spec)})
        buf, total, timed_out = bytearray(), 0, False
        fd = proc.stdout.fileno()
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                ready, _, _ = select.select([fd], [], [], min(left, 1.0))
                if not ready:
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                total += len(chunk)
                if len(buf) < lim.output_bytes:
                    buf += chunk[: lim.output_bytes - len(buf)]
            if not timed_out:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            if timed_out or proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
            proc.stdout.close()
            oom = self._cleanup(cgroups, ns)
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return CommandResult(code, buf.decode("utf-8", "replace"), total, timed_out, time.monotonic() - t0, oom)

    def _make_cgroups(self) -> Dict[str, str]:
        """This command's cgroups: {"pids": dir, "memory": dir}, each where the host allows it."""
        self.cgroup_seq += 1
        name = f"{os.getpid()}-{self.uid}-{self.cgroup_seq}"
        out = {}
        for kind, parent, knobs in (("pids", self.iso.pids_cgroup, [("pids.max", self.limits.max_procs)]),
                                    ("memory", self.iso.memory_cgroup,
                                     [("memory.limit_in_bytes", self.limits.memory_bytes),
                                      ("memory.memsw.limit_in_bytes", self.limits.memory_bytes)])):
            if not parent:
                continue
            path = os.path.join(parent, name)
            try:
                os.makedirs(path, exist_ok=True)
                for knob, value in knobs:
                    if os.path.exists(os.path.join(path, knob)):
                        with open(os.path.join(path, knob), "w") as f:
                            f.write(str(int(value)))
                out[kind] = path
            except OSError:
                try:
                    self._remove_cgroup(path, time.monotonic() + 1)
                except OSError:
                    pass
        return out

    def _cleanup(self, cgroups: Dict[str, str], ns: bool) -> bool:
        """Without namespaces: SIGKILL the episode uid's live processes until none is left (a fork bomb's
        survivors fork while we scan), for at most ``KILL_SECONDS`` (then a warning). Then empty and remove
        the command's cgroups (at most ``KILL_SECONDS`` more, a warning for any left). Never raises: the
        command's result stands. Returns whether the memory cgroup's OOM killer fired."""
        if not ns and self.iso.is_root:
            deadline = time.monotonic() + KILL_SECONDS
            while True:
                live, reaping, stuck = _kill_uid(self.uid)
                if not live and not reaping:            # RLIMIT_NPROC counts zombies: wait for init's reaping
                    break
                if time.monotonic() >= deadline:
                    warnings.warn(f"sandbox uid {self.uid}: {live} processes alive and {reaping} zombies "
                                  f"unreaped after {KILL_SECONDS:g} s of SIGKILL", RuntimeWarning, stacklevel=2)
                    break
                time.sleep(0.01)
            if stuck:
                warnings.warn(f"sandbox uid {self.uid}: {stuck} zombie(s) whose parents (another uid) do not "
                              f"reap them; ignored", RuntimeWarning, stacklevel=2)
        oom = False
        if "memory" in cgroups:
            try:
                with open(os.path.join(cgroups["memory"], "memory.oom_control")) as f:
                    oom = any(l.startswith("oom_kill ") and int(l.split()[1]) > 0 for l in f)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + KILL_SECONDS
        for path in cgroups.values():
            try:
                self._remove_cgroup(path, deadline)
            except OSError as e:
                warnings.warn(f"cgroup {path} not removed: {e}", RuntimeWarning, stacklevel=2)
        return oom

    @staticmethod
    def _remove_cgroup(path: str, deadline: float):
        """Kill what is in cgroup ``path`` and remove it; tried at least once, retried while busy until
        ``deadline`` (then OSError EBUSY)."""
        while True:
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    for p in f.read().split():
                        try:
                            os.kill(int(p), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                os.rmdir(path)
                return
            except OSError as e:
                if e.errno == errno.ENOENT:
                    return
                if e.errno != errno.EBUSY or time.monotonic() >= deadline:
                    raise
                time.sleep(0.005)

    # ---- path tools -----------------------------------------------------------------------------
    def resolve(self, path: str, follow_last: bool = True) -> List[str]:
        """The components below ``/work`` that sandbox path ``path`` names, or SandboxError.

        Symlinks are resolved by hand inside the episode root (an absolute target means the sandbox's
        ``/work``), read with ``readlink`` relative to directory fds opened one component at a time
        without following anything (``fdpath``); a missing component makes the rest lexical.
        """
        if not isinstance(path, str) or "\0" in path:
            raise SandboxError("path must be a string without NUL bytes")
        if os.path.isabs(path):
            if path != "/work" and not path.startswith("/work/"):
                raise SandboxError(f"{path}: absolute paths must be under /work")
            path = path[len("/work"):]
        todo = [p for p in path.split("/") if p not in ("", ".")]
        parts: List[str] = []
        fds = [os.dup(self.root_fd)]        # fds[i]: the directory parts[:i], while that prefix exists
        links = 0
        try:
            while todo:
                comp = todo.pop(0)
                if comp == "..":
                    if not parts:
                        raise SandboxError(f"{path}: leaves /work")
                    parts.pop()
                    if len(fds) > len(parts) + 1:
                        os.close(fds.pop())
                    continue
                st = None
                if len(fds) == len(parts) + 1:
                    try:
                        st = os.stat(comp, dir_fd=fds[-1], follow_symlinks=False)
                    except FileNotFoundError:
                        pass                            # missing: the rest is lexical (write_file makes parents)
                if st is not None and stat.S_ISLNK(st.st_mode) and (todo or follow_last):
                    links += 1
                    if links > MAX_SYMLINKS:
                        raise SandboxError(f"{path}: too many symlinks")
                    target = os.readlink(comp, dir_fd=fds[-1])
                    if os.path.isabs(target):
                        if target != "/work" and not target.startswith("/work/"):
                            raise SandboxError(f"{path}: symlink to {target} leaves /work")
                        parts, target = [], target[len("/work"):]
                        while len(fds) > 1:
                            os.close(fds.pop())
                    todo = [p for p in target.split("/") if p not in ("", ".")] + todo
                    continue
                if st is not None and stat.S_ISDIR(st.st_mode) and todo:
                    fds.append(open_dir(fds[-1], comp))
                parts.append(comp)
        except OSError as e:
            raise SandboxError(f"{path}: {e.strerror}") from None
        finally:
            for fd in fds:
                os.close(fd)
        return parts

    def _dir_fd(self, parts: List[str], create: bool = False) -> int:
        """fd of the episode directory ``parts``, walked from the root fd; ``create`` makes missing ones
        (mode 0755, owned by the episode uid) with ``mkdirat`` + ``fchown``."""
        def make(parent: int, name: str):
            os.mkdir(name, 0o755, dir_fd=parent)
            if self.iso.is_root:
                fd = open_dir(parent, name)
                try:
                    os.fchown(fd, self.uid, self.uid)
                finally:
                    os.close(fd)

        return open_dirs(self.root_fd, parts, make if create else None)

    def read_file(self, path: str) -> str:
        parts = self.resolve(path)
        try:
            dfd = self._dir_fd(parts[:-1])
            try:
                fd = os.open(parts[-1] if parts else ".", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
                             | os.O_CLOEXEC, dir_fd=dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise SandboxError(f"{path}: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SandboxError(f"{path}: not a regular file")
            data = f.read(self.limits.output_bytes)
        text = data.decode("utf-8", "replace")
        if st.st_size > len(data):
            text += f"\n[file truncated: first {len(data)} of {st.st_size} bytes]"
        return text

    def write_file(self, path: str, content: str) -> str:
        data = content.encode("utf-8")
        if len(data) > self.limits.file_bytes:
            raise SandboxError(f"{path}: {len(data)} bytes > file-size limit {self.limits.file_bytes}")
        parts = self.resolve(path, follow_last=False)
        if not parts:
            raise SandboxError(f"{path}: is the working directory")
        rel, name = "/".join(parts), parts[-1]
        try:
            dfd = self._dir_fd(parts[:-1], create=True)
        except OSError as e:
            what = "not a directory" if e.errno in (errno.ENOTDIR, errno.ELOOP, errno.EEXIST) else e.strerror
            raise SandboxError(f"/work/{'/'.join(parts[:-1])}: {what}") from None
        tmp = f".megak3-write-{secrets.token_hex(12)}"   # unpredictable; O_EXCL|O_NOFOLLOW: never an existing name
        try:
            try:
                if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                    raise SandboxError(f"{path}: is a directory")
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
            try:
                with os.fdopen(fd, "wb") as f:
                    if self.iso.is_root:
                        os.fchown(f.fileno(), self.uid, self.uid)
                    f.write(data)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)   # a new inode: never writes through a link
            except OSError as e:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
                raise SandboxError(f"{path}: {e.strerror}") from None
            if not self.quota_mount and self.disk_usage() > self.limits.disk_bytes:
                os.unlink(name, dir_fd=dfd)
                raise SandboxError(f"{path}: disk quota {self.limits.disk_bytes} bytes exceeded; file not written")
        finally:
            os.close(dfd)
        return f"wrote {len(data)} bytes to /work/{rel}"

    def list_dir(self, path: str = ".") -> str:
        parts = self.resolve(path)
        try:
            dfd = self._dir_fd(parts)
        except OSError:
            raise SandboxError(f"{path}: not a directory") from None
        lines = []
        try:
            for name in sorted(os.listdir(dfd)):
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
                lines.append(f"{kind}\t{st.st_size}\t{_printable(name)}"
                             + (f" -> {_printable(os.readlink(name, dir_fd=dfd))}" if kind == "link" else ""))
        except OSError as e:
            raise SandboxError(f"{path}: {e.strerror}") from None
        finally:
            os.close(dfd)
        text = "\n".join(lines) if lines else "(empty)"
        if len(text) > self.limits.output_bytes:
            text = text[: self.limits.output_bytes] + f"\n[listing truncated: {len(lines)} entries]"
        return text

    def disk_usage(self) -> int:
        return tree_bytes(self.root_fd)

    def destroy(self):
        """Remove the episode directory (and its tmpfs)."""
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1
        if self.quota_mount:
            ctypes.CDLL(None, use_errno=True).umount2(self.workdir.encode(), MNT_DETACH)
            self.quota_mount = False
        remove_tree(self.workdir)
