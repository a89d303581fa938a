"""Adversarial trees: whatever the agent builds, the root worker's host side acts on nothing outside the episode.

Seeded random trees are built INSIDE the jail by the agent's own tools (one shell call builds a
round of cases, each in its own directory ``c<seed>``): symlinks named like every file name the host
side uses in an episode's tree (restore and write temporaries with the workers' real pids,
store-like names), pointing at canary files of the host (owned by root and by another uid, one in
the snapshot store's own directory, one in the pool's base directory), at not-yet-existing names
next to them, and at another episode's directory; hard links, FIFOs, trees deeper than PATH_MAX with
names of up to NAME_MAX bytes, modes 000 and 4755. Then:

* ``test_path_tools_on_adversarial_trees``: read_file / write_file / list_dir through those trees;
  each answer is checked against what the agent's own commands see, and no answer names a host path;
* ``test_snapshot_restore_on_adversarial_trees``: snapshot, mutate (files replaced by links to the
  canaries, directories by links to host directories, FIFOs at temp names, modes changed), restore,
  fork, recover (kill -9 of the episode's worker), and at the end checkpoint-restore in a new pool;
  after each op the restored tree must equal the snapshot (the host's ``tree_digest`` and a
  per-case digest the agent computes itself), and every canary must be unchanged.

After every op: no canary's bytes, mode, owner or mtime changed, no new name appeared beside them,
and the other episode's tree is unchanged. A failing case prints its round seed and case seeds; rerun
one round with ``MEGAK3_ADV_SEED=<round seed> MEGAK3_ADV_CASES=<cases per round>``. CI runs
``MEGAK3_ADV_CASES`` cases (default 500 for the restore side, 200 for the path tools); set it higher
for a longer run. Needs root (per-episode uids).
"""
import hashlib
import inspect
import json
import os
import random
import re
import shlex
import signal
import stat
import time

import pytest

from megak3.envs import EnvPool, ToolCall
from megak3.envs import snapshot as snapshot_module

CASES = int(os.environ.get("MEGAK3_ADV_CASES", "500"))
SEED = int(os.environ.get("MEGAK3_ADV_SEED", "0"))
PER_ROUND = min(50, CASES)
OTHER_UID = 4242
LIMITS = {"wall_seconds": 10, "disk_bytes": 32 << 20, "max_files": 40000, "output_bytes": 65536}
TASK = {"family": "ledger", "seed": 0, "max_turns": 100000}
# the known-vulnerable restore (issue 34): a fixed temp name beside each file, written through with copyfile
RESTORE_FOLLOWS_TEMP_NAME = ".megak3-restore-{os.getpid()}" in inspect.getsource(snapshot_module)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="per-episode uids need root")


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("adv-pool"))
    with EnvPool(2, base_dir=base, limits=LIMITS, snapshot_every_step=False, reply_timeout=120) as p:
        yield p


class Host:
    """Canary files on the host and the other episode; ``check()`` asserts nothing of them changed."""

    def __init__(self, pool, tmp_path, tag):
        self.pool, self.tag = pool, tag
        self.canary_dir = str(tmp_path / "canaries")
        os.mkdir(self.canary_dir)
        self.files = [os.path.join(self.canary_dir, "root.txt"), os.path.join(self.canary_dir, "other-uid.txt"),
                      os.path.join(pool.store_dir, f"canary-{tag}.txt"), os.path.join(pool.base_dir, f"canary-{tag}.txt")]
        for i, path in enumerate(self.files):
            with open(path, "w") as f:
                f.write(f"canary {i} {tag}\n")
        os.chown(self.files[1], OTHER_UID, OTHER_UID)
        os.chmod(self.files[1], 0o600)
        self.dirs = [self.canary_dir, pool.store_dir, pool.base_dir]
        self.victim = f"victim-{tag}"
        pool.reset(self.victim, TASK)
        pool.step(self.victim, ToolCall("write_file", {"path": "secret.txt", "content": "s3cret"}))
        pool.snapshot(self.victim)
        self.before = self.state()

    def targets(self):
        """Host paths a planted link may point at (never a real system file: the old code writes through them)."""
        victim = [os.path.join(self.pool.base_dir, f"w{g}", self.victim, n)
                  for g in range(1, self.pool.generation + 1) for n in ("secret.txt", "pwned")]
        return self.files + [os.path.join(d, f"pwned-{self.tag}") for d in self.dirs] + self.dirs + victim

    def state(self):
        out = {}
        for path in self.files:
            st = os.lstat(path)
            with open(path, "rb") as f:
                out[path] = (hashlib.sha256(f.read()).hexdigest(), st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns)
        for d in self.dirs:
            out[d] = sorted(n for n in os.listdir(d) if n.startswith(("pwned", "canary")))
        out["victim"] = self.pool.digest(self.victim)
        return out

    def check(self, what):
        now = self.state()
        changed = {k: (self.before[k], now[k]) for k in self.before if self.before[k] != now[k]}
        assert not changed, f"{what}: host files outside the episode changed: {changed}"


def host_names(pool):
    """Every file name the host side uses or used inside an episode's tree: the old pid-named temporaries for
    the pids the workers have now, names shaped like today's random ones, the store's and worker's names."""
    pids = [w.pid for w in pool.workers]
    names = [f".megak3-restore-{p}" for p in pids] + [f".megak3-write-{p}" for p in pids]
    guessed = [".megak3-restore-0123456789abcdef", ".megak3-write-0123456789abcdef01234567", ".x.tmp-0123456789abcdef"]
    return names + guessed + ["objects", "snapshots", "store", ".scratch", "jailroot", "worker.log", "w1", "w2"]


def q(s):
    return shlex.quote(s)


def build_case(rng, seed, names, targets):
    """Shell lines that build case ``c<seed>`` (run from the episode's directory, never naming /work: in the
    weak mode a command's /work is the host's); returns (lines, facts for the path-tool checks).
    A tree deeper than PATH_MAX is built by ``DEEP`` (python: dash's ``cd`` stops at PATH_MAX) before the
    case's ``chmod`` lines run."""
    d = f"c{seed}"
    lines = [f"mkdir -p {d}/s0/s1", f"(cd -P {d} || exit 1"]    # a subshell per case; -P: see tool_help
    files = {}
    for i in range(rng.randint(2, 6)):
        path = rng.choice(["", "s0/", "s0/s1/"]) + f"f{i}"
        files[path] = "".join(rng.choice("abcdef0123456789\n") for _ in range(rng.randint(0, 300)))
        lines.append(f"printf %s {q(files[path])} > {path}")
    for sub in ("", "s0/", "s0/s1/"):                               # links at the host side's names
        for name in rng.sample(names, rng.randint(1, 4)):
            lines.append(f"ln -sfn {q(rng.choice(targets))} {sub}{name}")
    if rng.random() < 0.5:
        lines.append("ln -s ../../.. up; ln -s /work/s0 abs-in; ln -s s0/s1 rel-in; ln -s nowhere dangling")
    if rng.random() < 0.5:
        src = rng.choice(sorted(files))
        lines.append(f"ln {src} hard{seed}")
        files[f"hard{seed}"] = files[src]
    deep = deep_spec = None
    if rng.random() < 0.35:                                         # deeper than PATH_MAX
        name = "d" * rng.choice([60, 200, 255])
        depth = 4200 // len(name) + rng.randint(1, 4)
        deep = "/".join([name] * depth)
        leaf = f"leaf {seed}"
        deep_spec = (d, name, depth, leaf, rng.choice(targets), rng.choice(names))
        files[f"{deep}/leaf"] = leaf
    modes = []
    if rng.random() < 0.4:
        f = rng.choice(sorted(files))
        mode = rng.choice(["000", "4755", "2755", "1777", "600"])
        lines.append(f"chmod {mode} {f}")
        modes.append((f, mode))
    if rng.random() < 0.2:
        lines.append("mkdir locked && echo in > locked/x && chmod 000 locked")
    lines.append(")")
    return lines, {"dir": d, "files": files, "deep": deep, "deep_spec": deep_spec, "modes": modes}


# (case dir, name, depth, leaf text, link target, link name) per deep case; chdir by one relative name at a time
DEEP = """
import os, sys
for d, name, depth, leaf, target, link in {specs!r}:
    fd = os.open(".", os.O_RDONLY)
    os.chdir(d)
    for i in range(depth):
        os.mkdir(name)
        os.chdir(name)
    with open("leaf", "w") as f:
        f.write(leaf)
    os.symlink(target, link)
    os.fchdir(fd)
    os.close(fd)
"""


def mutate_case(rng, fact, names, targets):
    """Shell lines changing case ``fact`` between a snapshot and its restore."""
    d, files = fact["dir"], sorted(fact["files"])
    lines = [f"(cd -P {d} || exit 1"]
    for _ in range(rng.randint(1, 4)):      # writes never open a FIFO an earlier op made (they would block)
        f = rng.choice(files)
        op = rng.randrange(8)
        if op == 0:
            lines.append(f"[ -p {q(f)} ] || echo changed >> {q(f)}")
        elif op == 1:
            lines.append(f"rm -f {q(f)}; ln -s {q(rng.choice(targets))} {q(f)}")
        elif op == 2:
            lines.append(f"rm -rf s0/s1; ln -s {q(rng.choice(targets[-6:]))} s0/s1")
        elif op == 3:
            lines.append(f"chmod 000 {q(f)}; echo x > new{rng.randrange(9)}")
        elif op == 4:
            lines.append(f"rm -f {q(f)}; mkfifo {q(f)}")
        elif op == 5:
            n = rng.choice([n for n in names if n.startswith(".megak3-write")] + ["fifo"])
            lines.append(f"rm -rf s0/{q(n)}; mkfifo s0/{q(n)}")
        elif op == 6:
            lines.append(f"rm -f {q(f)}; mkdir -p {q(f)}/{q(rng.choice(names))}")
        else:
            lines.append(f"rm -f {q(f)}; ln {q(rng.choice(files))} {q(f)} 2>/dev/null; "
                         f"[ -p {q(f)} ] || echo rewritten >> {q(f)}")
    lines.append(")")
    return lines


# the agent's own view: one sha256 per case over every entry's path, kind, mode, mtime and bytes/target
# (FIFOs and sockets are not part of a snapshot; what the agent cannot read counts as 'unreadable')
CASE_DIGESTS = r'''
import hashlib, json, os, stat
out = {}
for case in sorted(n for n in os.listdir(".") if n.startswith("c")):
    h = hashlib.sha256()
    for top, dirs, files, dfd in os.fwalk(case, follow_symlinks=False):
        dirs.sort()
        for name in sorted(dirs + files) + ([] if top != case else ["."]):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
                continue
            h.update(f"{top}/{name}\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode)}\0{st.st_mtime_ns}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(name, dir_fd=dfd).encode())
            elif stat.S_ISREG(st.st_mode):
                try:
                    with open(os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd), "rb") as f:
                        h.update(hashlib.sha256(f.read()).digest())
                except OSError:
                    h.update(b"unreadable")
    out[case] = h.hexdigest()
print(json.dumps(out))
'''


def run(pool, eid, name, **args):
    return pool.step(eid, ToolCall(name, args)).observation


def case_digests(pool, eid):
    out = run(pool, eid, "python", code=CASE_DIGESTS)
    assert out.startswith("[exit 0]\n"), out[:2000]
    return json.loads(out.split("\n", 1)[1])


def build_round(pool, eid, host, rng, seeds):
    names, targets = host_names(pool), host.targets()
    script, chmods, facts = ["chmod -R u+rwx c* 2>/dev/null; rm -rf c*"], [], []
    for s in seeds:
        lines, fact = build_case(random.Random(s), s, names, targets)
        script += [l for l in lines if not l.startswith("chmod ")]
        chmods += [f"chmod {l[6:].split(' ', 1)[0]} {fact['dir']}/{l[6:].split(' ', 1)[1]}"
                   for l in lines if l.startswith("chmod ")]
        facts.append(fact)
    specs = [f["deep_spec"] for f in facts if f["deep_spec"]]
    if specs:
        script.append(f"python3 -c {q(DEEP.format(specs=specs))} || echo DEEP-FAILED")
    out = run(pool, eid, "shell", cmd="\n".join(script + chmods) + "\necho built")
    assert out.endswith("built\n") and "DEEP-FAILED" not in out, out[:3000]
    return facts


def round_seeds(r):
    rng = random.Random(f"{SEED}-{r}")
    return rng, [rng.randrange(1 << 30) for _ in range(PER_ROUND)]


def _report(what, r, seeds):
    return f"{what} (round {r}: rerun with MEGAK3_ADV_SEED={SEED} and round seeds {seeds})"


def test_path_tools_on_adversarial_trees(pool, tmp_path):
    """read_file / write_file / list_dir answer like the agent's own commands, never name a host path,
    and never touch the host, on trees full of planted names, outward links and paths beyond PATH_MAX."""
    host = Host(pool, tmp_path, "tools")
    eid, t0, done = "tools", time.monotonic(), 0
    pool.reset(eid, TASK)
    own = re.compile(re.escape(pool.base_dir) + r"/w\d+/(" + eid + r"|\.scratch)")     # its own host path
    cases = max(CASES * 2 // 5, 1)
    for r in range((cases + PER_ROUND - 1) // PER_ROUND):
        rng, seeds = round_seeds(r)
        facts = build_round(pool, eid, host, rng, seeds)
        writes = {}
        for fact in facts:
            d, files = fact["dir"], fact["files"]
            path = rng.choice(sorted(files))
            ops = [("read_file", {"path": f"{d}/{path}"}), ("list_dir", {"path": f"{d}/{os.path.dirname(path)}"}),
                   ("read_file", {"path": f"/work/{d}/{rng.choice(host_names(pool))}"}),
                   ("write_file", {"path": f"{d}/{rng.choice(host_names(pool))}", "content": f"w{r}"}),
                   ("write_file", {"path": f"{d}/s0/new/{os.path.basename(path)}", "content": "n"}),
                   ("read_file", {"path": f"{d}/rel-in/../s1/../../s0/s1/.."}), ("list_dir", {"path": f"{d}/up"})]
            if fact["deep"]:
                ops += [("read_file", {"path": f"{d}/{fact['deep']}/leaf"}), ("list_dir", {"path": f"{d}/{fact['deep']}"}),
                        ("write_file", {"path": f"{d}/{fact['deep']}/w.txt", "content": "deep"})]
            name, args = rng.choice(ops)
            obs = run(pool, eid, name, **args)
            assert not own.search(obs), _report(f"{name}({args}) answered with a host path: {obs[:500]}", r, seeds)
            if name == "read_file" and args["path"] == f"{d}/{path}" and not any(m in ("000",) for _, m in fact["modes"]):
                assert obs == files[path], _report(f"read_file {path}: {obs[:300]!r}", r, seeds)
            if name == "list_dir" and fact["deep"] and args["path"].endswith(fact["deep"]):
                assert "file\t" in obs and "\tleaf" in obs, _report(f"list_dir deep: {obs[:300]}", r, seeds)
            if name == "write_file" and obs.startswith("wrote "):
                writes[obs.split(" to /work/", 1)[1]] = args["content"]
        # the agent's own commands see exactly what write_file said it wrote (deep ones read back by the tool)
        for rel, content in sorted(writes.items()):
            if len(rel) > 3000:
                assert run(pool, eid, "read_file", path=rel) == content, _report(f"deep write {rel[:80]}", r, seeds)
        shallow = sorted(k for k in writes if len(k) <= 3000)
        if shallow:
            out = run(pool, eid, "shell", cmd="; ".join(f"printf '%s|' \"$(cat {q(k)})\"" for k in shallow))
            assert out == "[exit 0]\n" + "".join(f"{writes[k]}|" for k in shallow), _report(f"writes: {out[:500]}", r, seeds)
        host.check(_report("path tools", r, seeds))
        done += len(seeds)
    print(f"\nadversarial path tools: {done} cases in {time.monotonic() - t0:.1f} s (MEGAK3_ADV_SEED={SEED})")
    pool.close(eid)


@pytest.mark.xfail(RESTORE_FOLLOWS_TEMP_NAME, strict=True,
                   reason="SnapshotStore.restore writes through a fixed temp name the agent can plant "
                          "(issue 34 part A: fixed on branch w26snap)")
def test_snapshot_restore_on_adversarial_trees(pool, tmp_path):
    host = Host(pool, tmp_path, "restore")
    eid, t0, done, ops = "attacker", time.monotonic(), 0, 0
    pool.reset(eid, TASK)
    rounds = (CASES + PER_ROUND - 1) // PER_ROUND
    for r in range(rounds):
        rng, seeds = round_seeds(r)
        facts = build_round(pool, eid, host, rng, seeds)
        want = case_digests(pool, eid)
        snap, digest = pool.snapshot(eid), pool.digest(eid)
        mutate = sum((mutate_case(random.Random(s + 1), f, host_names(pool), host.targets())
                      for s, f in zip(seeds, facts)), [])
        run(pool, eid, "shell", cmd="\n".join(mutate))
        host.check(_report("mutate", r, seeds))

        def expect_restored(e, what):
            if pool.digest(e) != digest:
                got = case_digests(pool, e)
                bad = [s for s in seeds if got.get(f"c{s}") != want[f"c{s}"]]
                raise AssertionError(_report(f"{what}: the tree differs from the snapshot in cases {bad}", r, seeds))
            host.check(_report(what, r, seeds))

        pool.restore(eid, snap)
        expect_restored(eid, "restore")
        assert case_digests(pool, eid) == want, _report("restore: the agent's own digests differ", r, seeds)
        pool.fork(eid, "fork", snap)
        expect_restored("fork", "fork")
        pool.close("fork")
        ops += 4
        if r % 4 == 1:                                         # recovery: kill -9, restored elsewhere
            run(pool, eid, "shell", cmd="\n".join(mutate))
            os.kill(pool.worker_pid(eid), signal.SIGKILL)
            expect_restored(eid, "recover")
            ops += 1
        done += len(seeds)
    with EnvPool.from_checkpoint(pool.checkpoint(), num_workers=1, base_dir=str(tmp_path / "ckpt"),
                                 limits=LIMITS, snapshot_every_step=False) as again:
        assert again.digest(eid) == digest
    host.check("checkpoint-restore")
    print(f"\nadversarial snapshot/restore: {done} cases, {ops} ops in {time.monotonic() - t0:.1f} s "
          f"(MEGAK3_ADV_SEED={SEED})")
    pool.close(eid)


@pytest.mark.xfail(RESTORE_FOLLOWS_TEMP_NAME, strict=True,
                   reason="SnapshotStore.restore writes through a fixed temp name the agent can plant "
                          "(issue 34 part A: fixed on branch w26snap)")
def test_the_restore_temp_name_attack(pool, tmp_path):
    """The issue's attack, as written: links at ``.megak3-restore-<worker pid>`` to host canaries beside a
    file that a restore rewrites, triggered by restore, fork, recovery and checkpoint-restore."""
    host = Host(pool, tmp_path, "temp-name")
    eid = "temp-name"
    pool.reset(eid, TASK)
    plant = "; ".join(f"ln -sf {q(t)} .megak3-restore-{w.pid}; ln -sf {q(t)} sub/.megak3-restore-{w.pid}"
                      for w, t in zip(pool.workers, host.files[1:3]))
    run(pool, eid, "shell", cmd=f"mkdir sub; echo agent-bytes > sub/f; echo agent-bytes > f; {plant}")
    snap, digest = pool.snapshot(eid), pool.digest(eid)
    run(pool, eid, "shell", cmd="echo changed > f; echo changed > sub/f")

    def attempt(what, op, e):
        try:
            op()
            assert pool.digest(e) == digest, what
        finally:
            host.check(what)                       # first: the old restore raised only after writing through

    attempt("restore", lambda: pool.restore(eid, snap), eid)
    attempt("fork", lambda: pool.fork(eid, "temp-fork", snap), "temp-fork")
    attempt("recover", lambda: os.kill(pool.worker_pid(eid), signal.SIGKILL), eid)
    with EnvPool.from_checkpoint({"store": pool.store_dir, "episodes": {eid: snap}}, num_workers=1,
                                 base_dir=str(tmp_path / "ckpt"), limits=LIMITS, snapshot_every_step=False) as again:
        attempt("checkpoint-restore", lambda: None, eid)
        assert again.digest(eid) == digest
    for e in (eid, "temp-fork"):
        pool.close(e)
