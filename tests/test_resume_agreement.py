"""``train.resume=auto`` on 2 gloo ranks (dp2, ZeRO-1): the ranks agree on what they could read.

Each rank reads only its own shards, so a damaged file is seen by one rank alone. Rank 1's payload
file of the newest checkpoint truncated: rank 0 reads all it needs, yet both ranks fall back to the
previous checkpoint together (a CheckpointWarning on each) and hold exactly what that checkpoint
saved. A pickle planted in rank 1's objects file (hash chain updated to match): refused on both
ranks with one line each (rank 1 names the file, rank 0 names rank 1), the planted code never runs,
and no rank is left waiting in a collective or falls back to an older checkpoint.
"""
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist

from parallel.testing import run_distributed
from tests.conftest import SMALL_MODEL
from tests.test_checkpoint_security import _plant

pytestmark = pytest.mark.slow


def _job(corpus, run_dir):
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.metrics.config import LoggingConfig
    from megak3.optim.config import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig
    from parallel.config import ParallelConfig

    return JobConfig(
        model=load_model_config("k3_tiny", **SMALL_MODEL),
        data=DataConfig(path=corpus[0], tokenizer=corpus[1], seq_len=32, valid_fraction=0.1),
        optim=OptimConfig(lr=1e-3, warmup_steps=1),
        train=TrainConfig(max_steps=2, global_batch_size=2, micro_batch_size=1, eval_interval=0, eval_batches=0,
                          save_interval=1, run_dir=str(run_dir), seed=5, device="cpu", threads=1, resume="auto"),
        logging=LoggingConfig(progress_bar=False, wandb=False, log_interval=1),
        parallel=ParallelConfig(backend="gloo", timeout_s=120),
    ).validate(2)


def _resume(tr) -> dict:
    from parallel.plan import canonical_name

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            path = tr.maybe_resume()
        except ValueError as e:
            return {"error": str(e)}
    from megak3.checkpoint.atomic import CheckpointWarning

    return {"path": path.name, "step": tr.step,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)],
            "model": {canonical_name(n): t.clone() for n, t in tr.model.state_dict().items()},
            "optim": tr.optimizer.export_state(canonical=True)["state"]}


def _rank(rank, world, corpus, run_dir, marker):
    from megak3.train.trainer import Trainer
    from parallel.state import init_parallel

    job = _job(corpus, run_dir)
    tr = Trainer(job, run_dir, pstate=init_parallel(job.parallel, model_cfg=job.model))
    tr.fit()  # checkpoints at steps 1 and 2
    newest = run_dir / "checkpoints" / "step_00000002"
    if rank == 0:
        shutil.copytree(newest, run_dir / "pristine")
        _plant(newest, "shard_00001.obj.pt", marker)
    dist.barrier()
    planted = _resume(tr)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(newest)
        shutil.copytree(run_dir / "pristine", newest)
        payload = newest / "shard_00001.bin"
        payload.write_bytes(payload.read_bytes()[:-8])  # rank 1's optimizer shards, cut short
    dist.barrier()
    return planted, _resume(tr)


def test_resume_auto_ranks_fall_back_together_and_refuse_planted_pickles(corpus_dataset, tmp_path):
    from megak3.checkpoint.reader import CheckpointReader

    marker = tmp_path / "pwned"
    results = run_distributed(_rank, 2, corpus_dataset, tmp_path / "run", marker, timeout_s=600,
                              collective_timeout_s=300)
    assert not marker.exists(), "the planted code ran"
    (p0, f0), (p1, f1) = results
    assert set(p0) == {"error"} and set(p1) == {"error"}, (p0.keys(), p1.keys())
    assert "shard_00001.obj.pt" in p1["error"] and "\n" not in p1["error"], p1["error"]
    assert "rank 1 refused" in p0["error"] and "\n" not in p0["error"], p0["error"]

    reader = CheckpointReader(tmp_path / "run" / "checkpoints" / "step_00000001")
    for r, res in enumerate((f0, f1)):
        assert res.get("path") == "step_00000001" and res["step"] == 1, (r, res.get("error"))
        assert len(res["warnings"]) == 1 and "step_00000002" in res["warnings"][0], res["warnings"]
        for n, t in res["model"].items():
            assert torch.equal(t, reader.read(f"model/{n}", (0,) * t.ndim, tuple(t.shape))), (r, n)
        assert res["optim"], f"rank {r} owns no optimizer state"
        for n, st in res["optim"].items():
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim:
                    assert torch.equal(v, reader.read(f"optim/{n}/{k}", (0,) * v.ndim, tuple(v.shape))), (r, n, k)
    assert "truncated" in f1["warnings"][0] and "another rank" in f0["warnings"][0]
