"""Communication behind compute (issue 19 item 4), each switch against its non-overlapped form in
the same gloo run: (a) ZeRO-1 gradient reduce-scatter issued during the last micro-batch's backward
(``ShardedOptimizer(overlap_grad_reduce=True)`` / ``parallel.overlap_grad_reduce``) and (b)
pipeline p2p posted with ``dist.batch_isend_irecv`` (``parallel.pp_batch_p2p``). Same flat
layouts, same collectives, same bytes: losses and parameters are BITWISE equal, not merely close.
"""
import torch
import torch.distributed as dist

from megak3.optim import OptimConfig, lr_at, set_lr
from parallel.config import ParallelConfig
from parallel.data_parallel import ShardedOptimizer
from parallel.testing import run_distributed

CFG = OptimConfig(lr=2e-2, warmup_steps=1, schedule="cosine", grad_clip=0.05, ns_dtype="float32")


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
            ids, labels = batches[step]
            b = ids.shape[0] // world
            ids, labels = ids[rank * b:(rank + 1) * b], labels[rank * b:(rank + 1) * b]
            tokens = (labels != -100).sum().reshape(1)
            dist.all_reduce(tokens)
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


def _rank_step_worker(rank, world, flag_name, pp):
    from parallel.parity import PARITY_MODEL, global_batch, local_rows, parity_job
    from parallel.state import init_parallel
    from megak3.train.step import RankStep, all_reduce_sum

    dp = world // pp
    micro, steps = 2 * pp, 2
    job = parity_job(1, dp, False, PARITY_MODEL, batch=micro * dp, seqlen=32, seed=5, lr=1e-3, steps=steps, pp=pp)
    ps = init_parallel(job.parallel, model_cfg=job.model)
    out = {}
    for flag in (False, True):
        setattr(job.parallel, flag_name, flag)
        rs = RankStep(job, ps, "cpu", grad_accum=micro)
        losses = []
        for step in range(steps):
            ids, labels, _ = global_batch(step, micro * dp, 32, job.model.vocab_size)
            ids, labels, _ = local_rows(ids, labels, ps.dp_rank, dp)
            mbs = [{"input_ids": a, "labels": b} for a, b in zip(ids.chunk(micro), labels.chunk(micro))]
            rec = rs.accumulate(mbs)
            rs.apply(step, steps)
            losses.append(all_reduce_sum(rec["loss_sum"].clone(), [ps.dp_cp_group]))
        out[flag] = {"losses": losses, "params": {k: v.detach().clone() for k, v in rs.model.named_parameters()},
                     "armed": getattr(rs.optimizer, "overlap_grad_reduce", False),
                     "batched": rs.engine is not None and rs.engine.batch_p2p}
    return out


def _assert_bitwise(results):
    for res in results:
        off, on = res[False], res[True]
        assert all(torch.equal(a, b) for a, b in zip(off["losses"], on["losses"]))
        assert all(torch.equal(off["params"][k], on["params"][k]) for k in off["params"])


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


def test_switches_default_off_and_validated():
    cfg = ParallelConfig()
    assert cfg.overlap_grad_reduce is False and cfg.pp_batch_p2p is False
    for f in ("overlap_grad_reduce", "pp_batch_p2p"):
        try:
            ParallelConfig(**{f: 1}).validate(1)
        except ValueError as e:
            assert f"parallel.{f}" in str(e)
        else:
            raise AssertionError(f"{f}=1 accepted")
