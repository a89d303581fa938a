"""Communication behind compute (issue 19 item 4), each switch against its non-overlapped form in
the same gloo run: (a) ZeRO-1 gradient reduce-scatter issued during the last micro-batch's backward
(``ShardedOptimizer(overlap_grad_reduce=True)`` / ``parallel.overlap_grad_reduce``) and (b)
pipeline p2p posted with ``dist.batch_isend_irecv`` (``parallel.pp_batch_p2p``) and (c) ZeRO-1
parameter all-gathers issued by the optimizer step and waited for by the next forward
(``parallel.overlap_param_gather``). Same flat layouts, same collectives, same bytes: losses and
parameters are BITWISE equal, not merely close.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from megak3.optim import OptimConfig, lr_at, set_lr
from parallel.config import ParallelConfig
from parallel.data_parallel import CANONICAL_FORMAT, ShardedOptimizer, forward_blocks
from parallel.testing import run_distributed

CFG = OptimConfig(lr=2e-2, warmup_steps=1, schedule="cosine", grad_clip=0.05, ns_dtype="float32")



def _rank_rows(batch, rank: int, world: int):
    """This rank's rows of a step's batch and the labelled-token count over the group."""
    ids, labels = batch
    b = ids.shape[0] // world
    ids, labels = ids[rank * b:(rank + 1) * b], labels[rank * b:(rank + 1) * b]
    tokens = (labels != -100).sum().reshape(1)
    dist.all_reduce(tokens)
    return ids, labels, tokens

def _zero1_worker(rank, world, steps, micro):
    from test_data_parallel import make_batches, tiny_loss_sum, tiny_model

    batches = make_batches(64, rows=2 * world * micro, seq=12, steps=steps)
    out = {}
    for overlap in (False, True):
        model = tiny_model()
        opt = ShardedOptimizer(model, CFG, dist.group.WORLD, bucket_bytes=2048, overlap_grad_reduce=overlap)
        events = []
        emb = model.embed_tokens.weight  # first in model order: its gradient is the last of the backward
        emb.register_post_accumulate_grad_hook(lambda p: events.append("embedding_grad"))
        launch = opt._reduce_scatter_async
        opt._reduce_scatter_async = lambda *a: (events.append("reduce_scatter"), launch(*a))[1]
        losses, order = [], []
        for step in range(steps):
            ids, labels, tokens = _rank_rows(batches[step], rank, world)
            loss = torch.zeros(())
            for k, (i_m, l_m) in enumerate(zip(ids.chunk(micro), labels.chunk(micro))):
                if k == micro - 1:
                    opt.start_grad_overlap()
                events.clear()
                ls = tiny_loss_sum(model, i_m, l_m)
                (ls / tokens[0]).backward()
                loss += ls.detach()
                if k < micro - 1:
                    assert "reduce_scatter" not in events  # only the last micro-batch issues them
            order.append(list(events))
            opt.reduce_gradients()
            opt.clip_grad_norm_(CFG.grad_clip)
            set_lr(opt, lr_at(step, CFG, steps))
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        out[overlap] = {"losses": losses, "params": {k: v.detach().clone() for k, v in model.named_parameters()},
                        "order": order, "buckets": len(opt.buckets), "log": list(opt.overlap_log)}
    return out


def test_zero1_overlapped_reduce_scatter_is_bitwise_and_early():
    for res in run_distributed(_zero1_worker, 2, 3, 2, timeout_s=120):
        off, on = res[False], res[True]
        assert all(torch.equal(a, b) for a, b in zip(off["losses"], on["losses"]))
        assert off["params"].keys() == on["params"].keys()
        assert all(torch.equal(off["params"][k], on["params"][k]) for k in off["params"])
        assert off["order"] == [["embedding_grad"]] * 3  # the plain form issues nothing in backward
        assert on["buckets"] >= 6
        for ev in on["order"]:
            before = ev.index("embedding_grad")
            # most buckets are issued before the backward's last gradient (the embedding) exists;
            # the rest (the embedding's own bucket, ...) right after it, still inside backward
            assert ev.count("reduce_scatter") == on["buckets"], ev
            assert ev[:before].count("reduce_scatter") >= on["buckets"] // 2, ev
        assert len(on["log"]) == on["buckets"]


class StaleReads(TorchFunctionMode):
    """Records every torch op that takes a parameter whose bucket's all-gather is still in flight
    (``reads``: a stale read). Metadata (``.shape``, ``.dtype``, ``data_ptr()``) is not a read, nor is
    being the destination of ``copy_``.

    With ``model``, also every read of a parameter before the forward pre-hook of its block
    (:func:`parallel.data_parallel.forward_blocks`) has run (``early``): a stale read if that
    param's bucket held nothing else, whatever the bucket layout."""

    def __init__(self, opt: ShardedOptimizer, model: nn.Module | None = None):
        super().__init__()
        self.opt, self.reads, self.early, self.fired = opt, [], [], set()
        self.bucket_of = {id(opt.specs[sl.index].param): k for k, b in enumerate(opt.buckets) for sl in b.slots}
        self.block_of = forward_blocks(model) if model is not None else {}
        blocks = {id(b): b for b in self.block_of.values()}.values()
        self.handles = [b.register_forward_pre_hook(lambda m, a: self.fired.add(id(m)), prepend=True) for b in blocks]

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name not in ("__get__", "data_ptr", "size", "dim", "numel"):
            # the gathered values being copied into a param (copy_'s destination) is a write, not a read
            for a in (*args[name == "copy_":], *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if not isinstance(t, nn.Parameter):
                        continue
                    if self.bucket_of.get(id(t), -1) in self.opt._gather_pending:
                        self.reads.append((name, tuple(t.shape)))
                    if id(t) in self.block_of and id(self.block_of[id(t)]) not in self.fired:
                        self.early.append((name, tuple(t.shape)))
        return func(*args, **kwargs)


class NoForwardWait(ShardedOptimizer):
    """A broken overlap: the forward does not wait for the gathers (they land at reduce_gradients)."""

    def _make_gather_hook(self, ks):
        return lambda module, args: None


def _gather_worker(rank, world, steps, micro):
    from test_data_parallel import make_batches, tiny_loss_sum, tiny_model

    batches = make_batches(64, rows=2 * world * micro, seq=12, steps=steps)
    edp = dist.new_group([0, 1])  # experts on their own group: two groups, two gather communicators
    out = {}
    for kind in ("off", "on", "broken"):
        model = tiny_model()
        cls = NoForwardWait if kind == "broken" else ShardedOptimizer
        opt = cls(model, CFG, dist.group.WORLD, edp_group=edp, bucket_bytes=2048,
                  overlap_param_gather=kind != "off")
        losses, pending, waits, stale = [], [], [], []
        for step in range(steps):
            ids, labels, tokens = _rank_rows(batches[step], rank, world)
            loss = torch.zeros(())
            with StaleReads(opt) as reads:
                for i_m, l_m in zip(ids.chunk(micro), labels.chunk(micro)):
                    ls = tiny_loss_sum(model, i_m, l_m)
                    (ls / tokens[0]).backward()
                    loss += ls.detach()
            stale.append(len(reads.reads))
            waits.append([e for e in opt.gather_log if e[0] != "issue"])
            opt.reduce_gradients()
            opt.clip_grad_norm_(CFG.grad_clip)
            set_lr(opt, lr_at(step, CFG, steps))
            opt.step()
            pending.append(len(opt._gather_pending))
            if step == 0 and kind == "on":  # an optimizer export right after step() finishes the gathers
                out["export"] = opt.export_state()["format"], len(opt._gather_pending), list(opt.gather_log)
            opt.zero_grad()
            losses.append(loss)
        before = len(opt._gather_pending)
        state = {k: v.clone() for k, v in model.state_dict().items()}  # a checkpoint right after step()
        out[kind] = {"losses": losses, "state": state, "pending": pending, "before_save": before,
                     "after_save": len(opt._gather_pending), "waits": waits, "stale": stale,
                     "issue": [k for e, k in opt.gather_log if e == "issue"],
                     "multi": getattr(opt, "_gather_order", []), "groups": len(opt.groups)}
    return out


def test_zero1_param_gather_behind_forward_is_bitwise_and_deferred():
    """parallel.overlap_param_gather on ShardedOptimizer (dp2, experts on their own group): params
    and losses bitwise those of the blocking all-gather; step() returns with every gather in flight,
    each is waited for by a forward pre-hook (none read stale: a torch-function spy), an export
    and a model.state_dict() right after step() see the gathered values; a forward that does not
    wait (NoForwardWait) reads stale params and changes the losses."""
    for res in run_distributed(_gather_worker, 2, 4, 2, timeout_s=180):
        off, on, broken = res["off"], res["on"], res["broken"]
        assert on["groups"] == 2 and len(on["multi"]) >= 6
        assert all(torch.equal(a, b) for a, b in zip(off["losses"], on["losses"]))
        assert off["state"].keys() == on["state"].keys()
        assert all(torch.equal(off["state"][k], on["state"][k]) for k in off["state"])
        assert off["pending"] == [0] * 4 and off["waits"] == [[]] * 4
        assert on["pending"] == [len(on["multi"])] * 4          # step() left every gather in flight
        assert on["issue"] == on["multi"]                       # in forward order
        # step 0's gathers were finished by export_state; steps 1..3's by the forward's hooks
        fmt, left, log = res["export"]
        assert fmt == CANONICAL_FORMAT and left == 0
        assert [e for e, _ in log if e != "issue"] == ["finish"] * len(on["multi"])
        assert on["waits"][0] == [] and on["waits"][1] == [e for e in log if e[0] == "finish"]  # none left
        for w in on["waits"][2:]:
            assert sorted(k for _, k in w) == sorted(on["multi"]) and {e for e, _ in w} == {"forward"}, w
        assert on["stale"] == [0] * 4
        assert on["before_save"] == len(on["multi"]) and on["after_save"] == 0
        # the spy and the losses catch a forward that skips the wait
        assert broken["pending"] == on["pending"] and sum(broken["stale"][2:]) > 0
        assert not torch.equal(broken["losses"][2], on["losses"][2])


def _rank_step_worker(rank, world, flag_names, pp, tp=1, ep=1, cp=1, steps=2):
    from parallel.testing import PARITY_MODEL, global_batch, local_rows
    from megak3.train.parity import parity_job
    from parallel.state import init_parallel
    from megak3.train.step import RankStep, all_reduce_sum
    from parallel.data_parallel import build_sharded_optimizer

    flag_names = (flag_names,) if isinstance(flag_names, str) else flag_names
    dp = world // (pp * tp * cp)
    micro = 2 * pp
    job = parity_job(tp, dp, tp > 1, PARITY_MODEL, batch=micro * dp, seqlen=32, seed=5, lr=1e-3, steps=steps,
                     pp=pp, ep=ep, cp=cp)
    ps = init_parallel(job.parallel, model_cfg=job.model)
    out = {}
    for flag in (False, True):
        for name in flag_names:
            setattr(job.parallel, name, flag)
        rs = RankStep(job, ps, "cpu", grad_accum=micro)
        opt = rs.optimizer
        if "overlap_param_gather" in flag_names:  # RankStep's choices, 64 KiB buckets: ~20 per group
            opt.remove_hooks()
            rs.optimizer = opt = build_sharded_optimizer(
                rs.model, job.optim, rs.plan, overlap_grad_reduce=opt.overlap_grad_reduce,
                overlap_param_gather=opt.overlap_param_gather, bucket_bytes=64 * 2**10)
        losses, waits, stale = [], [], []
        for step in range(steps):
            ids, labels, _ = global_batch(step, micro * dp, 32, job.model.vocab_size)
            ids, labels, _ = local_rows(ids, labels, ps.dp_rank, dp)
            mbs = [{"input_ids": a, "labels": b} for a, b in zip(ids.chunk(micro), labels.chunk(micro))]
            pending = len(opt._gather_pending)
            with StaleReads(opt, rs.model) as reads:
                rec = rs.accumulate(mbs)
            stale.append((len(reads.reads), len(reads.early)))
            waits.append((pending, [e for e in opt.gather_log if e[0] != "issue"]))
            rs.apply(step, steps)
            losses.append(all_reduce_sum(rec["loss_sum"].clone(), [ps.dp_cp_group]))
        # model.state_dict() right after the last step: its hook waits for the gathers still in flight
        out[flag] = {"losses": losses, "params": {k: v.clone() for k, v in rs.model.state_dict().items()},
                     "armed": getattr(opt, "overlap_grad_reduce", False),
                     "batched": rs.engine is not None and rs.engine.batch_p2p,
                     "gather": opt.overlap_param_gather, "buckets": len(getattr(opt, "_gather_order", [])),
                     "waits": waits, "stale": stale}
    return out


def _assert_bitwise(results):
    for res in results:
        off, on = res[False], res[True]
        assert all(torch.equal(a, b) for a, b in zip(off["losses"], on["losses"]))
        assert all(torch.equal(off["params"][k], on["params"][k]) for k in off["params"])


def _assert_gathers_deferred(results):
    """Every bucket's gather was in flight when the next step began and was waited for by the
    forward (the first step has none), with no stale read."""
    for res in results:
        on, off = res[True], res[False]
        assert on["gather"] and not off["gather"] and on["buckets"] >= 4
        assert off["waits"] == [(0, [])] * len(off["waits"])
        assert on["waits"][0] == (0, [])
        for pending, w in on["waits"][1:]:
            assert pending == on["buckets"] and len({k for _, k in w}) == on["buckets"], w
            assert {e for e, _ in w} == {"forward"} and len(w) == on["buckets"], w
        # no stale read, and none would be with one param per bucket (every read after its block's hook)
        assert on["stale"] == [(0, 0)] * len(on["stale"]), on["stale"]


def test_rank_step_dp2_overlap_grad_reduce_is_bitwise():
    """The trainer's step (k3_tiny, dp2, 2 micro-batches) with parallel.overlap_grad_reduce."""
    res = run_distributed(_rank_step_worker, 2, "overlap_grad_reduce", 1, timeout_s=180)
    assert all(r[True]["armed"] and not r[False]["armed"] for r in res)
    _assert_bitwise(res)


def test_rank_step_pp2_batched_p2p_is_bitwise():
    """The pipeline (k3_tiny, pp2, 1f1b, 4 micro-batches) with parallel.pp_batch_p2p."""
    res = run_distributed(_rank_step_worker, 2, "pp_batch_p2p", 2, timeout_s=180)
    assert all(r[True]["batched"] and not r[False]["batched"] for r in res)
    _assert_bitwise(res)


def test_rank_step_dp2_overlap_param_gather_is_bitwise():
    """The trainer's step (k3_tiny, dp2) with parallel.overlap_param_gather, alone and together with
    parallel.overlap_grad_reduce; 3 steps, the state read through model.state_dict() right after
    the last one."""
    for flags in ("overlap_param_gather", ("overlap_param_gather", "overlap_grad_reduce")):
        res = run_distributed(_rank_step_worker, 2, flags, 1, steps=3, timeout_s=180)
        _assert_bitwise(res)
        _assert_gathers_deferred(res)
    assert all(r[True]["armed"] for r in res)


@pytest.mark.parametrize("layout", [dict(ep=2), dict(cp=2), dict(pp=2), dict(tp=2)],
                         ids=["ep2_dp2", "cp2", "pp2_dp2", "tp2_dp2"])
def test_rank_step_overlap_param_gather_layouts(layout):
    """parallel.overlap_param_gather under the layouts RankStep uses it in: the gathers run on
    dedicated dp(-cp) communicators beside MoonEP's all-to-alls (ep2: dense params on dp2), the CP
    exchanges (cp2: dense and expert params on the dp-cp group of 2), the pipeline's p2p
    (pp2 x dp2, 1f1b) and the TP collectives (tp2 x dp2, sequence parallel)."""
    world = 4 if layout.get("pp", 1) > 1 or layout.get("tp", 1) > 1 else 2
    pp = layout.pop("pp", 1)
    res = run_distributed(_rank_step_worker, world, "overlap_param_gather", pp, **layout, timeout_s=300)
    _assert_bitwise(res)
    _assert_gathers_deferred(res)


def _trainer_worker(rank, world, corpus, run_dir, max_steps, eval_batches, flag):
    from test_checkpoint_reshard import _job
    from megak3.train.trainer import Trainer
    from parallel.state import init_parallel

    torch.set_num_threads(1)
    job = _job(corpus, run_dir, max_steps, world, overlap_param_gather=flag)
    job.train.eval_batches, job.train.eval_interval = eval_batches, 1
    tr = Trainer(job, run_dir, pstate=init_parallel(job.parallel, model_cfg=job.model))
    out = tr.fit()
    return {"losses": [h["loss"] for h in tr.history], "steps": [h["step"] for h in tr.history],
            "val": (out["first_val_loss"], out["final_val_loss"]), "gather": tr.optimizer.overlap_param_gather}


def test_trainer_dp2_overlap_param_gather_saves_evaluates_resumes(corpus_dataset, tmp_path):
    """The trainer at dp2 with parallel.overlap_param_gather: 2 steps and a checkpoint written right
    after the last optimizer step (gathers in flight, no evaluation in between), then a resume to
    step 4 with an evaluation after every step (a forward with gathers in flight). Losses and
    validation losses are bitwise those without the switch: the checkpoint held the gathered
    params, the evaluations read them."""
    runs = {}
    for flag in (False, True):
        d = str(tmp_path / f"run{int(flag)}")
        first = run_distributed(_trainer_worker, 2, corpus_dataset, d, 2, 0, flag, timeout_s=300)[0]
        resumed = run_distributed(_trainer_worker, 2, corpus_dataset, d, 4, 1, flag, timeout_s=300)[0]
        assert first["gather"] is flag and first["steps"] == [1, 2] and resumed["steps"] == [3, 4]
        runs[flag] = (first["losses"], resumed["losses"], resumed["val"])
    assert runs[True] == runs[False], runs


def test_switches_default_off_and_validated():
    cfg = ParallelConfig()
    assert cfg.overlap_grad_reduce is False and cfg.pp_batch_p2p is False and cfg.overlap_param_gather is False
    for f in ("overlap_grad_reduce", "pp_batch_p2p", "overlap_param_gather"):
        try:
            ParallelConfig(**{f: 1}).validate(1)
        except ValueError as e:
            assert f"parallel.{f}" in str(e)
        else:
            raise AssertionError(f"{f}=1 accepted")
