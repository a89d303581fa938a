"""The first process of one sandboxed tool command (stdlib only; run as a script, not imported).

The worker starts it as ``unshare --net --pid --mount --ipc --uts --fork --kill-child -- python -I -S jail.py``
(or, where the host refuses namespaces, directly with ``"namespaces": false``), with SPEC in the
environment variable ``MEGAK3_JAIL_SPEC`` (not argv: ``/proc/1/cmdline`` is readable by the command,
``/proc/1/environ`` of a root process is not). SPEC is a JSON object:
``root`` (an empty host directory to build the new root on), ``work`` (the episode's directory),
``uid``/``gid`` (the unprivileged ids the command runs as), ``cgroups`` (cgroup directories to
join: pids, memory), ``rlimits`` ({name: value}), ``argv``, ``env``, ``tmp_bytes``, ``namespaces``,
``cgroup_ns`` (after joining the cgroups, enter a new cgroup namespace rooted at them, so the command's
``/proc/self/cgroup`` reads ``/`` and names neither the worker's pid nor a host cgroup path).

With namespaces it is pid 1 of a fresh pid namespace in a private mount namespace with no network
but a down loopback: it mounts a tmpfs as the new root, binds the system directories read-only and
nosuid, the episode directory read-write at ``/work``, a size-limited tmpfs at ``/tmp``, its own
``/proc`` (``hidepid=invisible``: the command sees only its own processes, not this root one whose
command line names host paths; ``/proc/stat`` replaced by a copy whose ``processes`` count, the host's
fork counter that would narrow down the worker's pid, reads 0) and a minimal ``/dev``; chroots there; then forks the command, which drops to uid/gid with
no supplementary groups, no capabilities and ``no_new_privs``, sets the rlimits and execs. This
process reaps orphans until the command exits and exits with its status; the kernel then kills
every process left in the namespace.
"""
import ctypes
import json
import os
import resource
import signal

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWCGROUP = 0x02000000
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
DEVICES = ("null", "zero", "random", "urandom")
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(src, dst, fstype, flags, data=None):
    if _libc.mount(src.encode() if src else None, dst.encode(), fstype.encode() if fstype else None,
                   ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} -> {dst}: {os.strerror(e)}")


def _bind(src, dst, readonly):
    _mount(src, dst, None, MS_BIND | MS_REC)
    if readonly:
        _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(spec):
    root = spec["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for d in SYSTEM_DIRS:
        host = "/" + d
        if os.path.islink(host):                       # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(host), os.path.join(root, d))
        elif os.path.isdir(host):
            os.mkdir(os.path.join(root, d))
            _bind(host, os.path.join(root, d), readonly=True)
    for d in ("work", "tmp", "proc", "dev"):
        os.mkdir(os.path.join(root, d))
    _bind(spec["work"], os.path.join(root, "work"), readonly=False)
    _mount("tmpfs", os.path.join(root, "tmp"), "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['tmp_bytes']},mode=1777")
    try:
        _mount("proc", os.path.join(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible")
    except OSError:                                    # kernels before 5.8 spell it 2
        _mount("proc", os.path.join(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    _mask_proc_stat(root)
    for dev in DEVICES:
        path = os.path.join(root, "dev", dev)
        open(path, "w").close()
        _bind("/dev/" + dev, path, readonly=False)
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m")
    os.chroot(root)
    os.chdir("/work")


def _mask_proc_stat(root):
    """Bind a copy of /proc/stat with ``processes 0`` over it (root's, read-only; its name in /tmp is removed)."""
    with open(os.path.join(root, "proc", "stat")) as f:
        lines = ["processes 0" if line.startswith("processes ") else line for line in f.read().split("\n")]
    copy = os.path.join(root, "tmp", ".stat")           # not the root tmpfs: it is remounted read-only later
    with open(copy, "w") as f:
        f.write("\n".join(lines))
    _bind(copy, os.path.join(root, "proc", "stat"), readonly=True)
    os.unlink(copy)


def drop_and_exec(spec):
    os.setsid()
    os.setgroups([])
    os.setresgid(spec["gid"], spec["gid"], spec["gid"])
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    for name, value in spec["rlimits"].items():
        # CPU: soft limit -> SIGXCPU (the command can tell why it stopped), hard 1 s later -> SIGKILL
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM):   # python ignores some
        signal.signal(sig, signal.SIG_DFL)
    os.execve(spec["argv"][0], spec["argv"], spec["env"])


def main():
    spec = json.loads(os.environ.pop("MEGAK3_JAIL_SPEC"))
    step = "cgroups"
    try:
        for cgroup in spec["cgroups"]:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write("0")                           # this process; children inherit the cgroup
        step = "cgroup namespace"
        if spec.get("cgroup_ns") and _libc.unshare(CLONE_NEWCGROUP) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWCGROUP)")
        step = "root"
        if spec["namespaces"]:
            build_root(spec)
        else:
            os.chdir(spec["work"])
    except Exception as e:  # noqa: BLE001 - the command sees this line: a step and strerror, no host path, no traceback
        why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else type(e).__name__
        print(f"sandbox setup failed ({step}): {why}", flush=True)
        os._exit(125)
    child = os.fork()
    if child == 0:
        try:
            drop_and_exec(spec)
        except BaseException as e:  # noqa: BLE001 - report anything, never return into the parent's code
            why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else type(e).__name__
            print(f"sandbox exec failed: {spec['argv'][0]}: {why}", flush=True)
        os._exit(126)
    while True:                                        # pid 1: reap orphans until the command ends
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(125)
        if pid == child:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
