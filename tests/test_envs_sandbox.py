"""Containment: escapes and exhaustion are stopped and reported; the worker and the host are unharmed.

One worker process serves every episode of this module (small limits: 1 s CPU, 3 s wall, 256 MB
address space, 4 MB files, 8 MB disk, 16 processes). Each test checks the observation names what
stopped the command, that the worker did not restart, and that nothing of the episode is left on
the host (processes of its uid, its pids cgroup, files outside its directory).
"""
import os
import socket
import sys

import pytest

from megak3.envs import EnvPool, ToolCall
from megak3.envs.host import host_isolation

LIMITS = {"cpu_seconds": 1, "wall_seconds": 3, "memory_bytes": 256 << 20, "file_bytes": 4 << 20,
          "disk_bytes": 8 << 20, "max_procs": 16, "output_bytes": 2000}
TASK = {"family": "ledger", "seed": 0, "max_turns": 100}


@pytest.fixture(scope="module")
def pool():
    with EnvPool(1, limits=LIMITS) as p:
        p.pid0 = p.workers[0].pid
        yield p


@pytest.fixture(scope="module")
def namespaces(pool):
    if "namespaces net+pid+mount+ipc+uts" not in pool.isolation:
        pytest.skip(f"host refuses namespaces: {pool.isolation}")


def call(pool, eid, name, **args):
    return pool.step(eid, ToolCall(name, args)).observation


def uid_processes(uid):
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                if any(l.startswith("Uid:") and int(l.split()[1]) == uid for l in f):
                    out.append(pid)
        except OSError:
            pass
    return out


def assert_unharmed(pool, eid):
    assert pool.events == [] and pool.workers[0].pid == pool.pid0, "the worker restarted"
    assert uid_processes(pool.uid(eid)) == []
    for cg in (host_isolation().pids_cgroup, host_isolation().memory_cgroup):
        if cg:
            assert [d for d in os.listdir(cg) if d.startswith(f"{pool.pid0}-")] == []
    assert call(pool, eid, "shell", cmd="echo alive") == "[exit 0]\nalive\n"


def test_isolation_is_stated(pool):
    assert pool.isolation.startswith("megak3.envs isolation: ") and "\n" not in pool.isolation


def test_path_escapes_are_refused(pool, namespaces, tmp_path):
    eid = "escape"
    pool.reset(eid, TASK)
    canary = tmp_path / "canary.txt"
    canary.write_text("host")
    for path in ("../../etc/passwd", "..", "a/../../x"):
        assert "leaves /work" in call(pool, eid, "read_file", path=path)
    assert "absolute paths must be under /work" in call(pool, eid, "read_file", path="/etc/passwd")
    assert "absolute paths must be under /work" in call(pool, eid, "write_file", path=str(canary), content="x")
    assert "leaves /work" in call(pool, eid, "write_file", path="/work/../evil", content="x")
    out = call(pool, eid, "shell", cmd="ln -s /etc etc_link; ln -s .. up; ln -s /work/README.txt abs; "
                                        "ln -s loop loop; ln /etc/hostname hard || echo HARDLINK-REFUSED")
    assert "HARDLINK-REFUSED" in out                               # another filesystem: EXDEV
    assert "symlink to /etc leaves /work" in call(pool, eid, "read_file", path="etc_link/passwd")
    assert "leaves /work" in call(pool, eid, "list_dir", path="up")
    assert "too many symlinks" in call(pool, eid, "read_file", path="loop")
    assert call(pool, eid, "read_file", path="abs").startswith("Sales ledgers")   # /work/... target stays inside
    # commands: the host's files are not there, and the system directories are read-only
    out = call(pool, eid, "shell", cmd=f"cat {canary}; echo pwned > {canary}; echo x > /etc/megak3_pwned; "
                                        "touch /usr/megak3_pwned; ls /")
    assert "No such file" in out and "Read-only file system" in out
    assert canary.read_text() == "host"
    assert not os.path.exists("/etc/megak3_pwned") and not os.path.exists("/usr/megak3_pwned")
    assert "uid=0" not in call(pool, eid, "shell", cmd="id")
    assert_unharmed(pool, eid)


def test_other_episodes_are_invisible(pool, namespaces):
    pool.reset("victim", TASK)
    pool.reset("thief", TASK)
    call(pool, "victim", "write_file", path="secret.txt", content="s3cret-token")
    host_path = os.path.join(pool.base_dir, "w1", "victim", "secret.txt")
    out = call(pool, "thief", "shell", cmd=f"cat /work/../victim/secret.txt {host_path}; "
                                            "find / -path /usr -prune -o -path /proc -prune -o -name secret.txt -print; "
                                            "grep -rs s3cret-token /work /tmp /etc /dev; echo done")
    assert "s3cret-token" not in out and out.rstrip().endswith("done")
    assert "leaves /work" in call(pool, "thief", "read_file", path="../victim/secret.txt")
    assert call(pool, "victim", "read_file", path="secret.txt") == "s3cret-token"
    assert_unharmed(pool, "thief")


def test_exhaustion_is_stopped_and_reported(pool, namespaces):
    eid = "hog"
    pool.reset(eid, TASK)
    fork_bomb = ("import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError as e:\n"
                 "        print('fork refused:', e.strerror, flush=True)\n        time.sleep(5)\n")
    out = call(pool, eid, "python", code=fork_bomb)
    assert "killed: wall-clock limit 3 s" in out and "fork refused: Resource temporarily unavailable" in out
    assert_unharmed(pool, eid)

    assert "MemoryError" in call(pool, eid, "python", code="x = bytearray(1 << 30)")
    out = call(pool, eid, "python", code="x = bytearray(100 << 20); print(len(x))")
    assert out == f"[exit 0]\n{100 << 20}\n"                       # within the limit: fine
    # 4 processes x 100 MB, each under RLIMIT_AS: the command's memory cgroup (256 MB) kills some
    hogs = ("import os, time\nfor i in range(4):\n    if os.fork() == 0:\n        x = bytearray(100 << 20)\n"
            "        time.sleep(1)\n        os._exit(0)\nprint(sorted(os.wait()[1] for i in range(4)))\n")
    out = call(pool, eid, "python", code=hogs)
    if host_isolation().memory_cgroup:
        assert "memory limit 268435456 bytes reached" in out and "9]" in out    # SIGKILLed children

    out = call(pool, eid, "shell", cmd="head -c 6000000 /dev/zero > big")
    assert "file-size limit" in out
    out = call(pool, eid, "shell", cmd="for i in 1 2 3 4; do head -c 3000000 /dev/zero > f$i || echo FULL; done")
    assert "No space left on device" in out and "FULL" in out
    assert call(pool, eid, "shell", cmd="rm -f f1 f2 f3 f4 big; echo ok").endswith("ok\n")
    assert "No space left" in call(pool, eid, "write_file", path="w.bin", content="z" * (3 << 20)) + \
        call(pool, eid, "write_file", path="w2.bin", content="z" * (3 << 20)) + \
        call(pool, eid, "write_file", path="w3.bin", content="z" * (3 << 20))

    assert "wall-clock limit 3 s" in call(pool, eid, "shell", cmd="sleep 100")
    out = call(pool, eid, "shell", cmd="head -c 100000 /dev/zero | tr '\\0' y")
    assert out.endswith("[output truncated: first 2000 of 100000 bytes]") and len(out) < 2200
    # a background process does not outlive its command
    assert call(pool, eid, "shell", cmd="(sleep 100 &) ; echo started").endswith("started\n")
    assert_unharmed(pool, eid)


def test_cpu_limit(namespaces):
    """Its own pool with a long wall-clock limit: on a busy machine 1 CPU-second may take seconds."""
    with EnvPool(1, limits={**LIMITS, "wall_seconds": 30}) as p:
        p.reset("spin", TASK)
        out = call(p, "spin", "python", code="while True: pass")
        assert out.startswith("[exit 152; killed by signal 24 (CPU-time limit 1 s")   # SIGXCPU
        assert uid_processes(p.uid("spin")) == []


def test_no_network(pool, namespaces):
    eid = "net"
    pool.reset(eid, TASK)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    out = call(pool, eid, "python", code=f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
                                         f"s.connect(('127.0.0.1', {port}))\nprint('CONNECTED')")
    assert "CONNECTED" not in out and ("Network is unreachable" in out or "Connection refused" in out)
    with pytest.raises(socket.timeout):
        srv.accept()
    srv.close()
    assert_unharmed(pool, eid)


def test_malformed_calls_keep_the_worker(pool):
    eid = "junk"
    pool.reset(eid, TASK)
    for text in ("no call", "<tool_call>{</tool_call>", '<tool_call>{"name": "nope"}</tool_call>',
                 '<tool_call>{"name": "read_file", "arguments": {"path": "missing.txt"}}</tool_call>',
                 '<tool_call>{"name": "shell", "arguments": {"cmd": "echo \\u0000"}}</tool_call>',
                 '<tool_call>{"name": "write_file", "arguments": {"path": "a", "content": "\\udcff"}}</tool_call>',
                 '<tool_call>{"name": "read_file", "arguments": {"path": "README.txt/x"}}</tool_call>'):
        r = pool.step(eid, text)
        assert r.observation.startswith("error: ") and not r.done
    assert pool.events == []


def test_rlimits_only_mode(monkeypatch):
    """Where namespaces are refused: the start-up line says so; the per-episode uid, rlimits, the pids
    cgroup, the tmpfs quota and killing the uid's processes after each command still hold."""
    if os.geteuid() != 0:
        pytest.skip("per-episode uids, cgroups and tmpfs quotas need root")
    monkeypatch.setenv("MEGAK3_ENVS_NO_NAMESPACES", "1")
    with EnvPool(1, limits=LIMITS) as p:
        assert "NO namespaces" in p.isolation
        for eid in ("victim", "thief"):
            obs = p.reset(eid, TASK)
        # the help tells the truth: commands start in the episode's directory; /work there is the host's
        assert "the file tools call it /work" in obs and "/work and /tmp are not yours" in obs and "network" not in obs
        assert call(p, "thief", "shell", cmd="pwd; head -c 13 README.txt") == \
            f"[exit 0]\n{os.path.join(p.base_dir, 'w1', 'thief')}\nSales ledgers"
        call(p, "victim", "write_file", path="secret.txt", content="s3cret-token")
        victim_dir = os.path.join(p.base_dir, "w1", "victim")
        out = call(p, "thief", "shell", cmd=f"id -u; cat {victim_dir}/secret.txt; ls {victim_dir}")
        assert out.split("\n")[1] == str(p.uid("thief")) and "Permission denied" in out
        assert "s3cret-token" not in out
        assert "leaves /work" in call(p, "thief", "read_file", path="../victim/secret.txt")
        fork_bomb = ("import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError as e:\n"
                     "        print('fork refused:', e.strerror, flush=True)\n        time.sleep(5)\n")
        assert "fork refused: Resource temporarily unavailable" in call(p, "thief", "python", code=fork_bomb)
        assert call(p, "thief", "shell", cmd="(setsid sleep 100 &) ; echo started").endswith("started\n")
        assert uid_processes(p.uid("thief")) == []
        out = call(p, "thief", "shell", cmd="for i in 1 2 3 4; do head -c 3000000 /dev/zero > f$i || echo FULL; done")
        assert "No space left on device" in out
        assert p.events == []


def test_the_agent_cannot_learn_the_worker_pid(pool, namespaces):
    """No cgroup path, fork count, root process or host path inside the jail names the worker (issue 34)."""
    eid = "pid-hunt"
    pool.reset(eid, TASK)
    out = call(pool, eid, "shell", cmd="cat /proc/self/cgroup; grep ^processes /proc/stat; ls /proc | grep '^[0-9]'; "
                                        "cat /proc/1/cmdline /proc/1/environ; cat /proc/self/mountinfo; env; "
                                        "cat /proc/loadavg /proc/sys/kernel/ns_last_pid")
    cgroup_lines = [l for l in out.split("\n") if l[:1].isdigit() and l.count(":") >= 2]
    assert cgroup_lines and all(l.endswith(":/") for l in cgroup_lines), out      # a cgroup namespace
    assert "\nprocesses 0\n" in out                                               # the host's fork counter
    assert "No such file or directory" in out                                     # /proc/1 (root) is hidden
    for leak in (f"{pool.pid0}-", pool.base_dir, "jail.py", "megak3_envs", sys.executable):
        assert leak not in out, leak
    assert int(out.split("\n")[-2]) < 100                                         # pids of its own namespace


def test_zombies_do_not_stall_cleanup(monkeypatch, tmp_path):
    """A zombie of the episode uid that its parent never reaps (here: this test process) used to make the
    weak mode's kill loop spin its whole 10 s and then skip removing the command's cgroups."""
    if os.geteuid() != 0:
        pytest.skip("per-episode uids and cgroups need root")
    import time

    from megak3.envs.sandbox import ProcessSandbox, SandboxLimits
    monkeypatch.setenv("MEGAK3_ENVS_NO_NAMESPACES", "1")
    host_isolation.cache_clear()
    uid = 123321
    zombie = os.fork()
    if zombie == 0:
        os.setresuid(uid, uid, uid)
        os._exit(0)
    try:
        sb = ProcessSandbox(str(tmp_path / "ep"), uid, SandboxLimits(wall_seconds=5), scratch=str(tmp_path / "s"))
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match="1 zombie"):
            assert sb.shell("echo hi; pwd") == f"[exit 0]\nhi\n{tmp_path / 'ep'}\n"    # weak mode: cwd = the episode
        assert time.monotonic() - t0 < 5
        for cg in (host_isolation().pids_cgroup, host_isolation().memory_cgroup):
            if cg:
                assert [d for d in os.listdir(cg) if d.startswith(f"{os.getpid()}-{uid}-")] == []
        sb.destroy()
    finally:
        os.waitpid(zombie, 0)
        host_isolation.cache_clear()


def test_fd_walks_never_follow_links_and_need_no_recursion(tmp_path):
    """remove_tree/tree_bytes of a tree 3000 deep (past the recursion and the fd limit) full of links to
    a directory outside: the outside is untouched, the tree is gone."""
    from megak3.envs.fdpath import remove_tree, tree_bytes
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    root = tmp_path / "tree"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        d = fd
        for i in range(3000):
            os.symlink(str(outside), "out", dir_fd=d)
            os.symlink("../" * 3 + "outside/keep.txt", "rel", dir_fd=d)
            os.mkdir("d", dir_fd=d)
            nd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=d)
            if d != fd:
                os.close(d)
            d = nd
        with open(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d), "wb") as f:
            f.write(b"x" * 5000)
        os.close(d)
        assert tree_bytes(fd) >= 5000
    finally:
        os.close(fd)
    remove_tree(str(root))
    assert not root.exists() and (outside / "keep.txt").read_text() == "keep"
    remove_tree(str(root))                                         # gone already: nothing to do
