"""The pipeline engine under NCCL's point-to-point rules (issue 24, finding 1), on CPU.

parallel/nccl_semantics.py replaces torch.distributed's isend / irecv / batch_isend_irecv for
threaded ranks: a send completes only when its receive is posted, groups complete as a whole, and
(the strict model) all of a rank's point-to-point shares one stream. Under it:

* the engine runs every schedule (afab, 1f1b, interleaved_1f1b with vp 2, zb_h1) with batched p2p
  on and off at pp 2 and 4 on k3_tiny, with the loss and every gradient equal to one process;
* the engine's message plan replays without deadlock for many more (schedule, pp, m, vp);
* the post order of 8d54860 (recorded from that engine: tests/data/pipeline_posts_8d54860.json,
  ``python tests/test_pipeline_nccl.py --record FILE 8d54860`` in a checkout of 8d54860 with
  parallel/nccl_semantics.py copied in) deadlocks for 1f1b,
  interleaved_1f1b and zb_h1 and completes for afab, and a live replay of it is stopped by the
  wait's timeout, so the check can fail.
"""
import json
import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from megak3.model.k3 import build_model
from megak3.ops import weight_grad
from parallel.nccl_semantics import NcclP2P, P2PModel, replay

from parallel.pipeline import Action, PipelineEngine, build_schedule, keep_stage, rank_chunks
from parallel.pipeline import engine  # message_plan, tag_name (absent at 8d54860: looked up when used)
from parallel.pipeline.schedules import splits_weight_grad
from parallel.testing import run_threaded
from tests.test_pipeline import _cfg, _micro_batches, _reference  # the one-process reference, shared

SCHEDS = ("afab", "1f1b", "interleaved_1f1b", "zb_h1")
RECORDED = os.path.join(os.path.dirname(__file__), "data", "pipeline_posts_8d54860.json")
RTOL, ATOL = 1e-5, 1e-9


class _PerThread(list):
    """weight_grad's stack of active stores, one per thread: threaded ranks each capture their own
    (the module keeps one list per process, right for process ranks)."""

    _tls = threading.local()

    def _mine(self):
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def append(self, x):
        self._mine().append(x)

    def remove(self, x):
        self._mine().remove(x)

    def __getitem__(self, i):
        return self._mine()[i]

    def __len__(self):
        return len(self._mine())

    def __bool__(self):
        return bool(self._mine())


@pytest.fixture
def thread_stores(monkeypatch):
    monkeypatch.setattr(weight_grad, "_ACTIVE", _PerThread())


def _names(V):
    """Tag -> message name for the fabric's reports (the engine's tag_name; absent at 8d54860)."""
    name = getattr(engine, "tag_name", None)
    return (lambda t: name(t, V)) if name else None


def _engine_cases(cases, m, timeout_s=60.0):
    """fn(group) for run_threaded: every case (schedule, batch_p2p) on this rank."""
    def fn(group):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        cfg, out = _cfg(), {}
        for schedule, batch in cases:
            vp = 2 if schedule == "interleaved_1f1b" else 1
            model = build_model(cfg, seed=4)
            mine = rank_chunks(cfg, world, rank, vp, allow_split_blocks=True)
            keep_stage(model, mine, rank == 0, rank == world - 1)
            eng = PipelineEngine(model, mine, group, schedule=schedule, batch_p2p=batch, timeout_s=timeout_s)
            mbs, n = _micro_batches(m)
            loss, _ = eng.train_step(mbs, n)
            eval_loss, eval_tokens = eng.forward_only(mbs)  # the evaluation schedule, same weights
            out[(schedule, batch)] = (float(loss), {k: p.grad.clone() for k, p in model.named_parameters()
                                                    if p.grad is not None}, eval_loss, eval_tokens)
        return out
    return fn


@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_completes_under_nccl_semantics(pp, thread_stores):
    """k3_tiny, m = 4, vp = 2 for interleaved_1f1b; blocks split where pp * vp needs it; then
    forward_only (evaluation) over the same micro-batches."""
    m, cases = 4, [(s, b) for s in SCHEDS for b in (False, True)]
    with NcclP2P(pp, tag_name=_names(2 * pp)):
        res = run_threaded(pp, _engine_cases(cases, m), timeout=240)
    ref_loss, ref_grads = _reference(m)
    n = _micro_batches(m)[1]
    for case in cases:
        seen = set()
        for rank, by_case in enumerate(res):
            loss, grads, eval_loss, eval_tokens = by_case[case]
            assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (case, rank, loss, ref_loss)
            assert abs(eval_loss - ref_loss) <= RTOL * abs(ref_loss) and eval_tokens == n, (case, rank, eval_loss)
            for k, g in grads.items():
                diff, scale = float((g - ref_grads[k]).norm()), float(ref_grads[k].norm())
                assert diff <= RTOL * scale + ATOL, (case, rank, k, diff, scale)
                seen.add(k)
        assert seen == set(ref_grads), (case, set(ref_grads) - seen)


def _programs(name, p, m, vp, batched, tensors=2):
    """Every rank's posts and waits as the engine makes them, from its message plan (replay format).
    name "eval": PipelineEngine.forward_only's schedule."""
    if name == "eval":
        sched = [[Action("F", c, i) for i in range(m) for c in range(vp)]] * p
    else:
        sched = build_schedule(name, p, m, vp)
    V, progs = p * vp, []
    for r in range(p):
        plan = engine.message_plan(sched, p, vp, r, name != "eval" and splits_weight_grad(name))
        prog, launch_of, n = [], {}, 0
        for k in range(len(sched[r]) + 1):
            ops = []
            for key, out in plan[k]:
                v = key[1]
                peer = v % p if out else (v + (-1 if key[0] == "F" else 1)) % p
                tag = ((key[2] * V + v) * 2 + (key[0] == "B")) * 1000
                ops += [(key, [int(out), peer, tag + j, 8]) for j in range(tensors)]
            groups = [ops] if batched and ops else [[op] for op in ops]
            for g in groups:
                prog.append(["P", [op for _, op in g], int(batched)])
                for key, op in g:
                    launch_of.setdefault(key, []).append(n)
                n += 1
            if k < len(sched[r]):
                a = sched[r][k]
                v = a.chunk * p + r
                need = ("F", v, a.mb) if a.kind == "F" and v > 0 else (
                    ("B", v, a.mb) if a.kind == "B" and v < V - 1 else None)
                prog += [["W", i] for i in launch_of.get(need, [])] if p > 1 else []
        progs.append(prog)
    return progs


@pytest.mark.parametrize("name", SCHEDS + ("eval",))
def test_message_plan_never_deadlocks(name):
    """The engine's plan, replayed under the strict model (one stream per rank), for pp up to 8,
    m up to 3 pp and vp up to 3; also as one unbatched op per tensor."""
    for p in (2, 3, 4, 8):
        for vp in ((2, 3) if name == "interleaved_1f1b" else (1, 2) if name in ("afab", "eval") else (1,)):
            for m in sorted({p, 2 * p, 3 * p} | ({1, p + 1} if name != "interleaved_1f1b" else set())):
                for batched in (True, False):
                    got = replay(_programs(name, p, m, vp, batched), "rank", _names(p * vp))
                    assert got is None, (name, p, m, vp, batched, got)


def _recorded():
    with open(RECORDED) as f:
        return json.load(f)


def test_old_post_order_deadlocks_under_nccl_semantics():
    """8d54860's engine: eager sends, lazy receives (batched: one group of receives). Deadlocks
    where the issue found them, under torch's streams and the strict model alike; afab completes."""
    rec = _recorded()
    assert rec["commit"].startswith("8d54860")
    seen = set()
    for case in rec["cases"]:
        name, pp, batched = case["schedule"], case["pp"], case["batch_p2p"]
        V = pp * (2 if name == "interleaved_1f1b" else 1)
        for streams in ("torch", "rank"):
            got = replay(case["programs"], streams, _names(V))
            if name == "afab":
                assert got is None, (case["schedule"], pp, batched, streams, got)
            else:
                assert got is not None and "unmatched send" in got, (name, pp, batched, streams, got)
        seen.add((name, pp, batched))
    assert seen == {(s, p, b) for s in SCHEDS for p in (2, 4) for b in (False, True)}


def test_live_replay_of_old_order_times_out():
    """The recorded 1f1b pp2 programs replayed by two threads against the live fabric, deadlock
    detection off: both ranks' waits end in the timeout instead of hanging."""
    case = next(c for c in _recorded()["cases"] if c["schedule"] == "1f1b" and c["pp"] == 2 and c["batch_p2p"])
    fabric = NcclP2P(2, tag_name=_names(2), timeout_s=1.0, detect_deadlock=False)
    errors = [None, None]

    def run(rank):
        launches = []
        try:
            for item in case["programs"][rank]:
                if item[0] == "P":
                    with fabric.cond:
                        ops = [(bool(s), peer, torch.zeros(n), tag, ((n,), torch.float32))
                               for s, peer, tag, n in item[1]]
                        launches.append(fabric.model.post(rank, ops, bool(item[2])))
                        fabric.model.progress()
                        fabric.cond.notify_all()
                else:
                    fabric._wait(launches[item[1]], None)
        except TimeoutError as e:
            errors[rank] = str(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(e and "timed out after 1.0 s" in e and "unmatched send" in e for e in errors), errors


def test_fabric_matches_by_order_and_reports_mismatch():
    """The model itself: a send does not complete before its receive is posted, FIFO per pair,
    and a tag mismatch (what NCCL would silently mis-deliver) is an error."""
    m = P2PModel(2)
    a = m.post(0, [(True, 1, torch.ones(2), 7, (2,))], batched=False)
    m.progress()
    assert not a.done                              # gloo would have completed it
    dst = torch.zeros(2)
    b = m.post(1, [(False, 0, dst, 7, (2,))], batched=False)
    m.progress()
    assert a.done and b.done and torch.equal(dst, torch.ones(2))
    m.post(0, [(True, 1, torch.ones(2), 8, (2,))], batched=False)
    m.post(1, [(False, 0, torch.zeros(2), 9, (2,))], batched=False)
    m.progress()
    assert m.error is not None and "wrong tensor" in str(m.error)
    # both ranks send, then receive: a deadlock one op at a time, fine as one group each
    one_by_one = [[["P", [[1, 1 - r, 1, 4]], 0], ["P", [[0, 1 - r, 1, 4]], 0], ["W", 1]] for r in range(2)]
    grouped = [[["P", [[1, 1 - r, 1, 4], [0, 1 - r, 1, 4]], 1], ["W", 0]] for r in range(2)]
    assert "unmatched send" in replay(one_by_one) and replay(grouped) is None
    assert "ended with launches unmatched" in replay([[["P", [[1, 1, 1, 4]], 0]], []])  # never received


def _record(path, commit):
    """Record this checkout's engine posts (gloo semantics: nothing blocks) for the cases above."""
    torch.set_num_threads(1)
    weight_grad._ACTIVE = _PerThread()
    cases = []
    for pp in (2, 4):
        for name in SCHEDS:
            for batch in (False, True):
                with NcclP2P(pp, semantics="gloo", record=True) as fabric:
                    run_threaded(pp, _engine_cases([(name, batch)], 4), timeout=600)
                cases.append({"schedule": name, "pp": pp, "batch_p2p": batch, "m": 4, "programs": fabric.programs})
    with open(path, "w") as f:
        json.dump({"commit": commit, "model": "k3_tiny parity widths, m = 4", "cases": cases}, f,
                  separators=(",", ":"))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--record":
        _record(sys.argv[2], sys.argv[3])
    else:
        print("usage: python tests/test_pipeline_nccl.py --record FILE COMMIT", file=sys.stderr)
        sys.exit(2)
