"""The environment interface through the worker pool: snapshot/restore/fork, kill -9 recovery,
checkpoint across a pool restart, and the task families' rewards."""
import csv
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from megak3.envs import EnvError, EnvPool, ToolCall, make_task
from megak3.envs.host import host_isolation
from megak3.envs.tasks import FIXBUG

LEDGER = {"family": "ledger", "seed": 7, "max_turns": 50}
SUM_CSVS = ("import csv, glob\nitem = {item!r}\nprint(sum(int(r['qty']) * int(r['unit_price']) "
            "for p in glob.glob('/work/data/*/*.csv') for r in csv.DictReader(open(p)) if r['item'] == item))")


def sh(cmd):
    return ToolCall("shell", {"cmd": cmd})


@pytest.fixture(scope="module")
def pool():
    with EnvPool(2, limits={"wall_seconds": 20}) as p:
        yield p


def test_snapshot_restore_and_fork(pool):
    pool.reset("e", LEDGER)
    pool.step("e", sh("mkdir -p out/deep && echo one > out/a.txt && chmod 600 out/a.txt && ln -s out/a.txt l"))
    pool.step("e", ToolCall("write_file", {"path": "notes.md", "content": "# notes\n"}))
    snap, digest, state = pool.snapshot("e"), pool.digest("e"), pool.state("e")
    assert state["turn"] == 2
    pool.step("e", sh("rm -rf out data/*/jan.csv; echo changed >> notes.md; chmod 700 README.txt; "
                      "mkdir l2; rm l; ln -s notes.md l; head -c 3000 /dev/urandom > rnd"))
    pool.step("e", ToolCall("write_file", {"path": "out", "content": "now a file"}))
    assert pool.digest("e") != digest and pool.state("e")["turn"] == 4
    pool.restore("e", snap)
    assert pool.digest("e") == digest and pool.state("e") == state
    # fork: a second episode from the same snapshot; the two evolve independently
    pool.fork("e", "f", snap)
    assert pool.digest("f") == digest and pool.state("f") == {**state, "episode_id": "f"}
    pool.step("f", sh("echo f-only > f.txt"))
    assert pool.digest("e") == digest
    obs = pool.step("e", sh("cat f.txt; echo e-only > e.txt; cat out/a.txt")).observation
    assert "No such file" in obs and "one" in obs
    assert "No such file" in pool.step("f", sh("cat e.txt")).observation
    assert pool.state("f")["turn"] == 4 and pool.state("e")["turn"] == 3


def test_kill_9_resumes_from_last_snapshot(pool):
    steps = [sh("echo a > a.txt"), ToolCall("write_file", {"path": "b/c.txt", "content": "bc"}), sh("cp a.txt d.txt")]
    for eid in ("k", "ref"):
        pool.reset(eid, LEDGER)
        for s in steps:
            pool.step(eid, s)
    digest, state = pool.digest("k"), pool.state("k")
    dead = pool.worker_pid("k")
    os.kill(dead, signal.SIGKILL)                                  # worker dies between steps
    assert pool.digest("k") == digest and pool.state("k") == state  # resumed elsewhere, identical
    assert pool.events[-1].kind == "worker_died" and "k" in pool.events[-1].moved
    assert pool.worker_pid("k") != dead
    # ... and during a command: the interrupted step is re-run from the last snapshot
    slow = sh("sleep 1; echo done >> marker; cat a.txt")
    result = {}
    t = threading.Thread(target=lambda: result.update(r=pool.step("k", slow)))
    t.start()
    time.sleep(0.4)
    dead = pool.worker_pid("k")
    os.kill(dead, signal.SIGKILL)
    t.join(60)
    cg = host_isolation().pids_cgroup
    assert not cg or not [d for d in os.listdir(cg) if d.startswith(f"{dead}-")]    # its command's cgroup
    ref = pool.step("ref", slow)
    assert result["r"].observation == ref.observation == "[exit 0]\na\n"
    assert pool.digest("k", mtimes=False) == pool.digest("ref", mtimes=False)   # marker written once
    assert {**pool.state("k"), "episode_id": "ref"} == pool.state("ref")
    assert len(pool.events) == 2


def test_checkpoint_survives_a_pool_restart(tmp_path):
    store = str(tmp_path / "store")
    task = make_task(LEDGER)
    with EnvPool(2, store_dir=store) as a:
        for eid in ("p", "q"):
            a.reset(eid, LEDGER)
            a.step(eid, sh(f"echo {eid} > mine.txt"))
        a.step("q", ToolCall("list_dir", {"path": "data"}))
        assert a.gc() > 0                                          # earlier snapshots go; the last ones stay
        ckpt = a.checkpoint()
        before = {eid: (a.digest(eid), a.state(eid)) for eid in ("p", "q")}
    assert set(ckpt["episodes"]) == {"p", "q"}
    with EnvPool.from_checkpoint(ckpt, num_workers=1) as b:
        assert {eid: (b.digest(eid), b.state(eid)) for eid in ("p", "q")} == before
        out = b.step("p", ToolCall("python", {"code": SUM_CSVS.format(item=item_of(task))}))
        assert out.observation == f"[exit 0]\n{task.answer}\n"
        r = b.step("p", ToolCall("submit", {"answer": task.answer}))
        assert r.done and r.reward == 1.0 and b.state("p")["turn"] == 3


def item_of(task):
    return task.prompt.split("item '")[1].split("'")[0]


def ledger_total(task):
    """Independent reference: the total from the generated files, parsed here."""
    item = item_of(task)
    return sum(int(r["qty"]) * int(r["unit_price"]) for path, text in task.files.items() if path.endswith(".csv")
               for r in csv.DictReader(io.StringIO(text)) if r["item"] == item)


def test_tasks_are_deterministic_and_verifiable(pool):
    for family in ("ledger", "fixbug"):
        a, b = make_task({"family": family, "seed": 3}), make_task({"family": family, "seed": 3})
        assert (a.files, a.prompt, a.answer) == (b.files, b.prompt, b.answer)
        assert len({tuple(sorted(make_task({"family": family, "seed": s}).files.items())) for s in range(6)}) > 1
    for seed in range(5):
        t = make_task({"family": "ledger", "seed": seed})
        assert t.answer == str(ledger_total(t))
    with pytest.raises(ValueError, match="task spec"):
        make_task({"family": "chess", "seed": 1})

    # ledger: several tool calls, then fork before submitting a right and a wrong answer
    task = make_task(LEDGER)
    pool.reset("L", LEDGER)
    assert "dir" in pool.step("L", ToolCall("list_dir", {"path": "data"})).observation
    out = pool.step("L", ToolCall("python", {"code": SUM_CSVS.format(item=item_of(task))})).observation
    answer = out.split("\n")[1]
    assert answer == str(ledger_total(task))
    pool.fork("L", "L-wrong")
    right = pool.step("L", f"The total is {answer}. " + ToolCall("submit", {"answer": answer}).to_text())
    wrong = pool.step("L-wrong", ToolCall("submit", {"answer": str(int(answer) + 1)}))
    assert (right.done, right.reward, wrong.done, wrong.reward) == (True, 1.0, True, 0.0)
    assert pool.step("L", sh("ls")).observation == "error: the episode is over"

    # fixbug: the tests fail, the fix makes them pass; editing the test instead scores 0
    spec = {"family": "fixbug", "seed": 11}
    fb = make_task(spec)
    name = next(n for n in FIXBUG if f"def {n}(" in fb.files["program.py"])
    for eid, action, reward in (("fix", ToolCall("write_file", {"path": "program.py", "content": FIXBUG[name][0]}), 1.0),
                                ("cheat", ToolCall("write_file", {"path": "test_program.py", "content": "print('ok')\n"}),
                                 0.0),
                                ("idle", ToolCall("list_dir", {}), 0.0)):
        pool.reset(eid, spec)
        assert pool.step(eid, sh("python3 test_program.py")).observation.startswith("[exit 1]")
        pool.step(eid, action)
        r = pool.step(eid, ToolCall("submit", {"answer": "done"}))
        assert (r.done, r.reward) == (True, reward), eid
    # the turn limit ends an episode with reward 0
    pool.reset("short", {**spec, "max_turns": 2})
    pool.step("short", sh("true"))
    r = pool.step("short", sh("true"))
    assert r.done and r.reward == 0.0 and "turn limit 2" in r.observation


def test_bad_input_is_refused_before_work(pool, tmp_path):
    with pytest.raises(ValueError, match=r"limits.cpu_seconds=0 must be a positive number"):
        EnvPool(1, limits={"cpu_seconds": 0})
    with pytest.raises(ValueError, match=r"limits.cpu_secs: no such field"):
        EnvPool(1, limits={"cpu_secs": 1})
    with pytest.raises(ValueError, match=r"backend='slurm' must be 'process' or 'ray'"):
        EnvPool(1, backend="slurm")
    with pytest.raises(ValueError, match=r"^store_limits.gc_bytes=0 must be a positive integer$"):
        EnvPool(1, store_limits={"gc_bytes": 0})
    r = subprocess.run([sys.executable, "-m", "megak3.envs.worker", "--store", str(tmp_path), "--base",
                        str(tmp_path), "--store-limits", '{"keep_last": 0}'], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr == \
        "megak3.envs.worker: error: --store-limits: store_limits.keep_last=0 must be a positive integer\n"
    r = subprocess.run([sys.executable, "-m", "megak3.envs.worker", "--store", str(tmp_path), "--base",
                        str(tmp_path), "--limits", '{"wall_seconds": -1}'], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr == \
        "megak3.envs.worker: error: --limits: limits.wall_seconds=-1 must be a positive number\n"
    with pytest.raises(EnvError, match="task spec"):
        pool.reset("bad", {"family": "ledger"})
    with pytest.raises(EnvError, match="not in this pool"):
        pool.step("bad", ToolCall("list_dir", {}))
    pool.reset("ok", {"family": "ledger", "seed": 1})
    with pytest.raises(EnvError, match="no snapshot"):
        pool.restore("ok", "0" * 20)
    assert pool.step("ok", ToolCall("shell", {"cmd": "echo fine"})).observation == "[exit 0]\nfine\n"


def test_sandbox_uids_are_unique_on_the_host():
    """Two live sandboxes never share a uid, even when their ids hash alike; a closed claim comes free."""
    from megak3.envs.env import claim_uid
    u1, fd1 = claim_uid("same-id")
    u2, fd2 = claim_uid("same-id")
    assert u1 != u2 and min(u1, u2) >= 100000
    os.close(fd1)
    u3, fd3 = claim_uid("same-id")
    assert u3 == u1
    os.close(fd2)
    os.close(fd3)


def ledger_policy(transcripts):
    """A scripted agent: list the data, sum it with a script, submit what the script printed."""
    out = {}
    for eid, ts in transcripts.items():
        turn = sum(1 for role, _ in ts if role == "model")
        item = ts[0][1].split("item '")[1].split("'")[0]
        if turn == 0:
            out[eid] = ToolCall("list_dir", {"path": "data"}).to_text()
        elif turn == 1:
            out[eid] = "Summing with a script. " + ToolCall("python", {"code": SUM_CSVS.format(item=item)}).to_text()
        else:
            out[eid] = ToolCall("submit", {"answer": ts[-1][1].split("\n")[1]}).to_text()
    return out


def test_partial_rollouts_pause_and_resume_across_a_restart(tmp_path):
    import json

    from megak3.envs.driver import EpisodeDriver
    tasks = {f"r{s}": {"family": "ledger", "seed": s} for s in range(3)}
    with EnvPool(2, store_dir=str(tmp_path / "store")) as pool:
        drv = EpisodeDriver(pool)
        for eid, t in tasks.items():
            drv.start(eid, t)
        assert drv.run(ledger_policy, max_turns=2) == {}                    # iteration 1: all paused
        assert drv.unfinished() == sorted(tasks)
        sd = json.loads(json.dumps(drv.state_dict()))                       # what the RL checkpoint holds
        before = {e: (pool.digest(e), pool.state(e)) for e in tasks}
    drv2 = EpisodeDriver.from_state_dict(sd, num_workers=1)                 # iteration 2, after a restart
    with drv2.pool:
        assert {e: (drv2.pool.digest(e), drv2.pool.state(e)) for e in tasks} == before
        done = drv2.run(ledger_policy, max_turns=5)
        assert sorted(done) == sorted(tasks) and all(r.reward == 1.0 for r in done.values())
        for eid, t in tasks.items():
            assert drv2.transcripts[eid][-2][1] == ToolCall("submit", {"answer": make_task(t).answer}).to_text()
            assert len(drv2.transcripts[eid]) == 7                          # prompt + 3 x (model, env)


CANARY = b"canary: the host side must never write here\n"
PLANT = """import os
T, P = {targets!r}, sorted(set({pids!r}) | {{(ns_last + k) % pid_max for k in range(1, {ahead})}} - set(range(300)))
for d in ('', 'sub'):
    os.makedirs(d or '.', exist_ok=True)
    for p in (P if d == '' else {pids!r}):
        for i, n in enumerate(('.megak3-restore-%d', '.megak3-write-%d')):
            os.symlink(T[(p + i) % len(T)], os.path.join(d, n % p))
    open(os.path.join(d, 'x'), 'w').write('PWNED')
os.symlink(T[0], 'dirlink')
print(len(P))
"""


def fingerprints(paths):
    out = {}
    for p in paths:
        st = os.lstat(p)
        with open(p, "rb") as f:
            out[p] = (f.read(), st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns)
    return out


def test_planted_links_never_redirect_restore_fork_recovery_or_checkpoint(tmp_path):
    """The issue's attack: the agent's own tool calls plant symlinks to host files at the worker's
    restore/write temp names (for the workers' pids and the pids coming next); then every host-side
    path that restores a tree runs. Canaries: root-owned files outside the episode, one in the store."""
    store, base = tmp_path / "store", tmp_path / "base"
    store.mkdir()
    canaries = [str(tmp_path / "canary"), str(store / "canary")]
    for p in canaries:
        with open(p, "wb") as f:
            f.write(CANARY)
        os.chmod(p, 0o600)
    before = fingerprints(canaries)
    with open("/proc/sys/kernel/ns_last_pid") as f, open("/proc/sys/kernel/pid_max") as g:
        ns_last, pid_max = int(f.read()), int(g.read())
    pool = EnvPool(2, store_dir=str(store), base_dir=str(base))
    try:
        pool.reset("a", LEDGER)
        pool.reset("victim", LEDGER)
        victim = pool.digest("victim")
        pids = [w.pid for w in pool.workers]
        ahead = 5000
        code = PLANT.format(targets=canaries, pids=pids, ahead=ahead).replace("ns_last", str(ns_last)) \
            .replace("pid_max", str(pid_max))
        out = pool.step("a", ToolCall("python", {"code": code})).observation
        assert out.startswith("[exit 0]"), out
        planted = set(pids) | {(ns_last + k) % pid_max for k in range(1, ahead)}
        snap, digest = pool.last_snap["a"], pool.digest("a")
        change = sh("echo changed > x; echo changed > sub/x; rm dirlink; mkdir dirlink")

        def check(what):
            assert fingerprints(canaries) == before, f"{what}: a host file outside the episode changed"

        pool.step("a", change)
        try:
            pool.restore("a", snap)
        finally:
            check("EnvPool.restore")
        assert pool.digest("a") == digest
        pool.step("a", change)
        try:
            pool.fork("a", "b", snap)
        finally:
            check("EnvPool.fork")
        assert pool.digest("b") == digest
        pool.restore("a", snap)
        os.kill(pool.worker_pid("a"), signal.SIGKILL)
        try:
            assert pool.digest("a") == digest                         # recovered on the other worker
        finally:
            check("dead-worker recovery")
        assert pool.events[-1].moved and not pool.events[-1].failed
        ckpt = pool.checkpoint()
    finally:
        pool.shutdown()
    with EnvPool.from_checkpoint(ckpt, num_workers=2, base_dir=str(base)) as again:
        assert any(w.pid in planted for w in again.workers), "the new workers' pids were not planted"
        try:
            assert again.digest("a") == digest and again.digest("victim") == victim
        finally:
            check("EnvPool.from_checkpoint")
        assert again.lost == {} and again.events == []


def test_deep_paths_and_refused_snapshots_leave_the_episode_usable(tmp_path):
    with EnvPool(1, store_dir=str(tmp_path / "store"), store_limits={"episode_bytes": 4 << 20}) as pool:
        pool.reset("e", LEDGER)
        first = pool.last_snap["e"]
        wedge = "import os\nfor i in range(20): os.mkdir('d'*250); os.chdir('d'*250)\nprint('deep')"
        obs = [pool.step("e", ToolCall("python", {"code": wedge})).observation]
        assert obs[0] == "[exit 0]\ndeep\n" and pool.last_snap["e"] != first       # stored, deep as it is
        deep, digest = pool.last_snap["e"], pool.digest("e")
        obs.append(pool.step("e", sh("echo hi")).observation)
        assert obs[-1] == "[exit 0]\nhi\n"
        pool.fork("e", "f", deep)
        assert pool.digest("f") == digest
        saved = pool.last_snap["e"]
        # over the snapshot quota: the step answers, says it is not saved, and the last save stays
        obs.append(pool.step("e", sh("head -c 5000000 /dev/zero > big && echo wrote")).observation)
        assert obs[-1].startswith("[exit 0]\nwrote\n\n[not saved: /work holds more than 4194304 bytes")
        assert pool.last_snap["e"] == saved
        obs.append(pool.step("e", sh("rm big; mkfifo pipe; echo ok")).observation)
        assert obs[-1].startswith("[exit 0]\nok\n\n[not saved: 1 fifo/socket/device entries (/work/pipe)")
        assert pool.last_snap["e"] != saved
        pool.restore("e", first)
        assert pool.state("e")["turn"] == 0
        obs.append(pool.step("e", sh("ls")).observation)
        assert obs[-1].startswith("[exit 0]\n") and "README" in obs[-1]
        for text in obs:
            assert str(tmp_path) not in text and pool.base_dir not in text


def test_the_driver_ends_a_failed_episode_and_carries_on(tmp_path):
    """An episode lost for infrastructure reasons (its snapshot gone when its worker died) ends with
    reward 0; the other episode of the batch finishes normally."""
    from megak3.envs.driver import ENV_FAILED, EpisodeDriver
    tasks = {"ok": {"family": "ledger", "seed": 1}, "gone": {"family": "ledger", "seed": 2}}
    with EnvPool(1, store_dir=str(tmp_path / "store")) as pool:
        drv = EpisodeDriver(pool)
        for eid, t in tasks.items():
            drv.start(eid, t)
        assert drv.run(ledger_policy, max_turns=1) == {}
        os.unlink(os.path.join(pool.store_dir, "snapshots", pool.last_snap["gone"] + ".json"))
        os.kill(pool.workers[0].pid, signal.SIGKILL)
        done = drv.run(ledger_policy, max_turns=5)
        assert sorted(done) == ["gone", "ok"] and done["ok"].reward == 1.0
        assert (done["gone"].observation, done["gone"].reward, done["gone"].info["error"]) == \
            (ENV_FAILED, 0.0, "environment")
        assert "gone" in pool.events[-1].failed and "gone" in pool.lost
        drv.forget("gone")
        assert "gone" not in pool.lost


def test_the_pool_collects_its_store(tmp_path):
    """Turns that each rewrite a 1 MB file: the pool's own gc keeps the store near its live size; past
    pool_bytes a turn needing new contents is not saved, one that deletes files is (and frees)."""
    lim = {"gc_bytes": 3 << 20, "keep_last": 2, "pool_bytes": 6 << 20}
    with EnvPool(1, store_dir=str(tmp_path / "store"), store_limits=lim) as pool:
        pool.reset("e", LEDGER)
        pinned = pool.snapshot("e")
        sizes = []
        for i in range(12):
            pool.step("e", ToolCall("write_file", {"path": "blob", "content": f"{i:08d}" * (1 << 17)}))
            sizes.append(pool.store.disk_bytes())
        assert max(sizes) < (2 + 3 + 1.2) * (1 << 20) < 12 << 20       # live + gc_bytes + one turn
        assert pool.store.has(pinned) and pool.state("e")["turn"] == 12
        for k in range(3):                                                # 7.5 MB of new contents
            obs = pool.step("e", sh(f"head -c 2500000 /dev/urandom > r{k}; echo ok")).observation
        assert obs == "[exit 0]\nok\n" and pool.store_full
        saved = pool.last_snap["e"]
        obs = pool.step("e", sh("head -c 1000 /dev/urandom > r3; echo ok")).observation
        assert obs.startswith("[exit 0]\nok\n\n[not saved: the environment's snapshot store is full")
        assert pool.last_snap["e"] == saved
        obs = pool.step("e", sh("rm r*; echo ok")).observation                # needs no new contents: saved
        assert obs == "[exit 0]\nok\n" and pool.last_snap["e"] != saved and not pool.store_full


def test_a_full_disk_does_not_wedge_restore():
    """Rewriting a file in place needs room for its copy; on a full episode tmpfs the worker restores
    into a fresh directory instead."""
    with EnvPool(1, limits={"disk_bytes": 8 << 20}) as pool:
        pool.reset("e", LEDGER)
        pool.step("e", sh("head -c 3500000 /dev/urandom > a; head -c 3500000 /dev/urandom > b"))
        snap, digest = pool.last_snap["e"], pool.digest("e")
        obs = pool.step("e", sh("head -c 3500000 /dev/urandom > a; head -c 3500000 /dev/urandom > b")).observation
        assert obs.startswith("[exit 0]"), obs
        pool.restore("e", snap)
        assert pool.digest("e") == digest and pool.events == []
        assert pool.step("e", sh("echo ok")).observation == "[exit 0]\nok\n"
