"""Per-shard checkpoints load into any layout, reading only each rank's own boxes.

A checkpoint written at tp2 x ep2 x pp2 (8 gloo ranks, MoonEP, 1F1B, SP) resumes at ep4 x edp2
(8 ranks, tp1, no pipeline), at pp4 (4 ranks, blocks split) and on one process; the next two
steps' losses equal the uninterrupted single-process run's (the second depends on the restored
optimizer state, not only the weights), the one-process resume ends with the reference's weights,
and every rank reads no more payload bytes than the shards it holds (model tensors + the optimizer
state it owns).
"""
import shutil

import pytest
import torch

from parallel.testing import PARITY_MODEL, run_distributed

pytestmark = pytest.mark.slow

REL = 1e-4  # the trainer tests' tolerance for losses across layouts (fp32)


def _job(corpus, run_dir, max_steps, world, **par):
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.metrics.config import LoggingConfig
    from megak3.optim.config import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig
    from parallel.config import ParallelConfig

    return JobConfig(
        model=load_model_config("k3_tiny", **PARITY_MODEL),
        data=DataConfig(path=corpus[0], tokenizer=corpus[1], seq_len=32, valid_fraction=0.1),
        optim=OptimConfig(lr=1e-3, warmup_steps=1, ns_dtype="float32"),
        train=TrainConfig(max_steps=max_steps, global_batch_size=8, micro_batch_size=1, eval_interval=0,
                          eval_batches=1, save_interval=2, run_dir=run_dir, seed=3, device="cpu", threads=1,
                          resume="auto"),
        logging=LoggingConfig(progress_bar=False, wandb=False, log_interval=1),
        parallel=ParallelConfig(backend="gloo", timeout_s=120, **par),
    ).validate(world)


def _train(rank, world, corpus, run_dir, max_steps, par):
    from megak3.train.trainer import Trainer
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    job = _job(corpus, run_dir, max_steps, world, **par)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    tr = Trainer(job, run_dir, pstate=ps)
    tr.fit()
    weights = {n: p.detach().clone() for n, p in tr.model.named_parameters()} if world == 1 else None
    return {"history": tr.history, "load": tr.checkpoint.load_stats or None, "weights": weights}


def _check(results, want_steps, ref):
    for r in results:
        got = {h["step"]: h["loss"] for h in r["history"]}
        assert sorted(got) == list(want_steps), got
        for s in want_steps:
            assert abs(got[s] - ref[s]) <= REL * abs(ref[s]), (got, ref)
        load = r["load"]
        if load is not None:
            print(f"read {load['bytes_read']} B payload + {load['meta_bytes_read']} B metadata, "
                  f"shards held {load['shard_bytes']} B")
            assert 0 < load["bytes_read"] <= load["shard_bytes"], load


def test_tp2_ep2_pp2_checkpoint_resumes_at_other_layouts(corpus_dataset, tmp_path):
    full = _train(0, 1, corpus_dataset, str(tmp_path / "ref"), 4, {})
    ref = {h["step"]: h["loss"] for h in full["history"]}
    src = tmp_path / "src"
    saved = run_distributed(_train, 8, corpus_dataset, str(src), 2,
                            {"tp": 2, "ep": 2, "pp": 2, "sequence_parallel": True}, timeout_s=300)
    for s in (1, 2):
        assert abs(saved[0]["history"][s - 1]["loss"] - ref[s]) <= REL * abs(ref[s])
    for name, world, par in (("ep4", 8, {"ep": 4}), ("pp4", 4, {"pp": 4, "pp_split_blocks": True})):
        d = tmp_path / name
        shutil.copytree(src / "checkpoints", d / "checkpoints")
        out = run_distributed(_train, world, corpus_dataset, str(d), 4, par, timeout_s=300)
        _check(out, (3, 4), ref)  # resumed at step 2
    d = tmp_path / "one"
    shutil.copytree(src / "checkpoints", d / "checkpoints")
    one = _train(0, 1, corpus_dataset, str(d), 4, {})
    _check([one], (3, 4), ref)
    # the last two updates, made from the restored momentum / Adam moments, are the reference's: each
    # tensor within 10% of its two updates (measured < 1%); a lost optimizer state moves every tensor by
    # 39% to 190% of them (tests/test_context_parallel.py::_check_resume), step 4's loss by only 4e-5
    at2 = _train(0, 1, corpus_dataset, str(tmp_path / "ref2"), 2, {})["weights"]  # steps 1-2 ignore max_steps
    rel = {n: float((one["weights"][n] - w).norm() / (w - at2[n]).norm())
           for n, w in full["weights"].items() if (w - at2[n]).norm() > 0}
    assert len(rel) > 0.9 * len(full["weights"])
    assert max(rel.values()) <= 0.1, sorted(rel.items(), key=lambda kv: -kv[1])[:3]
