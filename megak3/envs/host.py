"""What containment this host allows, detected once per process by trying it.

``host_isolation()`` runs a throw-away command under ``unshare --net --pid --mount --ipc --uts``, one
under ``unshare --cgroup``, and tries to create a pids cgroup and a memory cgroup (v1: below this process's own memory cgroup);
``describe()`` is the one line every worker prints at start-up. Nothing here is assumed: a
capability is used only if its probe succeeded. ``MEGAK3_ENVS_NO_NAMESPACES=1`` skips the namespaces
even where they work (the mode a host without them gets; tests use it).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 16384, 1 << 18
UNSHARE_ARGS = ("--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child")
PIDS_CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")   # cgroup v1, then v2
CGROUP_DIR = "megak3_envs"


@dataclass(frozen=True)
class HostIsolation:
    unshare: Optional[str]          # path of unshare(1) when net+pid+mount+ipc+uts namespaces work
    cgroup_ns: bool                 # cgroup namespaces work (jail.py enters one after joining its cgroups)
    pids_cgroup: Optional[str]      # parent directory for per-command pids cgroups
    memory_cgroup: Optional[str]    # parent directory for per-command memory cgroups
    private_mounts: bool            # this process has its own mount namespace (per-episode tmpfs quotas)
    is_root: bool

    def describe(self) -> str:
        cg_ns = "+cgroup" if self.cgroup_ns else ""
        ns = f"namespaces net+pid+mount+ipc+uts{cg_ns} (no network, private mounts/pids/IPC, chroot)" if self.unshare \
            else "NO namespaces (unshare unavailable or disabled: commands see the host filesystem and network)"
        cg = f"pids cgroup {self.pids_cgroup}" if self.pids_cgroup else \
             "no pids cgroup (process count: RLIMIT_NPROC of a per-episode uid)"
        mem = f"memory cgroup {self.memory_cgroup}" if self.memory_cgroup else \
              "no memory cgroup (memory: RLIMIT_AS per process only)"
        disk = "per-episode tmpfs disk quota" if self.private_mounts else \
               "no tmpfs quota (disk use checked after each command)"
        who = "root -> per-episode uid" if self.is_root else "not root: commands keep this uid"
        return f"megak3.envs isolation: {ns}; {cg}; {mem}; {disk}; {who}"


def _probe_unshare() -> Optional[str]:
    exe = shutil.which("unshare")
    if exe is None or os.geteuid() != 0 or os.environ.get("MEGAK3_ENVS_NO_NAMESPACES") == "1":
        return None
    try:
        r = subprocess.run([exe, *UNSHARE_ARGS, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return exe if r.returncode == 0 else None


def _probe_cgroup_ns() -> bool:
    exe = shutil.which("unshare")
    if exe is None or os.geteuid() != 0:
        return False
    try:
        return subprocess.run([exe, "--cgroup", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _probe_cgroup(roots, knob: str, value: str) -> Optional[str]:
    """The first ``root/megak3_envs`` under which a child cgroup can be made and ``knob`` written."""
    for root in roots:
        parent = os.path.join(root, CGROUP_DIR)
        probe = os.path.join(parent, f"probe-{os.getpid()}")
        try:
            os.makedirs(probe, exist_ok=True)
            with open(os.path.join(probe, knob), "w") as f:
                f.write(value)
            return parent
        except OSError:
            continue
        finally:
            try:
                os.rmdir(probe)
            except OSError:
                pass
    return None


def _own_memory_cgroup() -> list:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "memory" in controllers.split(","):
                    return [os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"))]
    except OSError:
        pass
    return []


_private_mounts = False


def enter_private_mounts() -> bool:
    """Give this (single-threaded) process its own mount namespace; mounts it makes die with it."""
    global _private_mounts
    if _private_mounts:
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if os.geteuid() != 0 or libc.unshare(CLONE_NEWNS) != 0:
        return False
    if libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None) != 0:
        return False
    _private_mounts = True
    host_isolation.cache_clear()
    return True


@lru_cache(maxsize=1)
def host_isolation() -> HostIsolation:
    root = os.geteuid() == 0
    return HostIsolation(unshare=_probe_unshare(), cgroup_ns=_probe_cgroup_ns(),
                         pids_cgroup=_probe_cgroup(PIDS_CGROUP_ROOTS, "pids.max", "8") if root else None,
                         memory_cgroup=_probe_cgroup(_own_memory_cgroup(), "memory.limit_in_bytes", str(64 << 20))
                         if root else None,
                         private_mounts=_private_mounts, is_root=root)
