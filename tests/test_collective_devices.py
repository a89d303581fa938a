"""Every tensor the trainer hands to a collective lives on the training device (what NCCL needs).

One training step and one evaluation of the real Trainer per layout family (dp2, tp2+SP, ep2 with
MoonEP, pp2 1f1b) on gloo ranks under :func:`parallel.collective_check.check_collective_devices`:
tensors made without an explicit device are meta there, so a CPU-only run sees the tensors that
would be CPU tensors next to CUDA ones on GPU. The Trainer is built OUTSIDE the check: its
construction may still use CPU tensors for setup collectives (allowed for now).

Host-side helpers that build index tensors on the default device and then move them (``.to(device)``)
are correct on GPU but fail under the meta default: they must say ``device="cpu"``.
"""
import pytest
import torch
import torch.distributed as dist

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.data.config import DataConfig
from megak3.metrics.config import LoggingConfig
from megak3.optim.config import OptimConfig
from megak3.job.config import JobConfig, TrainConfig
from parallel.collective_check import CollectiveDeviceError, check_collective_devices
from parallel.data_parallel import comm as data_parallel
from parallel.config import ParallelConfig
from parallel.testing import run_distributed

LAYOUTS = {
    "dp2": {},
    "tp2sp": {"tp": 2, "sequence_parallel": True},
    "ep2": {"ep": 2},
    "pp2": {"pp": 2, "pp_schedule": "1f1b"},
}


def _step_under_check(rank, world_size, corpus, run_dir, par):
    from megak3.train.trainer import Trainer
    from parallel.state import init_parallel

    torch.set_num_threads(1)
    job = JobConfig(
        model=load_model_config("k3_tiny", **SMALL_MODEL),
        data=DataConfig(path=corpus[0], tokenizer=corpus[1], seq_len=32, valid_fraction=0.1),
        optim=OptimConfig(lr=1e-3, warmup_steps=1, ns_dtype="float32"),
        train=TrainConfig(max_steps=2, global_batch_size=2, micro_batch_size=1, eval_interval=0, eval_batches=1,
                          save_interval=0, run_dir=run_dir, seed=3, device="cpu", threads=1),
        logging=LoggingConfig(progress_bar=False, wandb=False, log_interval=1),
        parallel=ParallelConfig(backend="gloo", timeout_s=60, **par),
    ).validate(world_size)
    ps = init_parallel(job.parallel, model_cfg=job.model)
    trainer = Trainer(job, run_dir, pstate=ps)  # outside the check: setup collectives may use CPU tensors
    with check_collective_devices(trainer.device) as chk:
        trainer.train_step()
        trainer.evaluate()
    dist.barrier()
    chk.assert_clean()
    return sorted({(r.fn, r.where.split(" ")[0].rsplit(":", 1)[0]) for r in chk.records})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_get_training_device_tensors(layout, corpus_dataset, tmp_path):
    seen = run_distributed(_step_under_check, 2, corpus_dataset, str(tmp_path), LAYOUTS[layout], timeout_s=120)
    # the check saw the step's collectives (else it wrapped the wrong functions): the ZeRO-1
    # optimizer's, and the QB statistics' wherever ranks route different tokens
    files = {f for rank in seen for _, f in rank}
    assert "parallel/data_parallel/grads.py" in files, seen
    if layout != "pp2":
        assert "parallel/moe_stats.py" in files, seen


def _unit(rank, world_size):
    t = torch.ones(2, device="cpu")
    with check_collective_devices("cpu") as chk:
        dist.all_reduce(t)                                   # right device: recorded, not a violation
        parts = [torch.empty(2, device="cpu") for _ in range(world_size)]
        dist.all_gather(parts, t)
        op = dist.P2POp(dist.isend if rank == 0 else dist.irecv, t, 1 - rank)
        for w in dist.batch_isend_irecv([op]):
            w.wait()
        box = [rank]
        dist.all_gather_object(box * world_size, rank)       # object collective: not recorded
        assert torch.zeros(1).device.type == "meta"          # no explicit device -> meta inside
        with pytest.raises(CollectiveDeviceError, match=r"test_collective_devices.py:\d+"):
            dist.all_reduce(torch.tensor([1.0]))             # meta: raises at once, names this line
    assert torch.zeros(1).device.type == "cpu" and dist.all_reduce is dist.distributed_c10d.all_reduce
    names = [r.fn for r in chk.records]
    assert names == ["all_reduce", "all_gather", "all_gather", "all_gather", "batch_isend_irecv", "all_reduce"], names
    with check_collective_devices("cpu") as chk2:               # a function bound by name is wrapped too
        assert data_parallel._all_gather is not dist.all_gather_single.__wrapped__
    assert data_parallel._all_gather is dist.all_gather_single and not chk2.records
    assert [r.device for r in chk.violations()] == ["meta"]
    with pytest.raises(CollectiveDeviceError, match="all_reduce"):
        chk.assert_clean()
    bad = check_collective_devices("meta", default_meta=False)   # every CPU tensor is now "wrong"
    with pytest.raises(ValueError), bad:
        dist.all_reduce(t)
        raise ValueError("restored on error")
    assert dist.all_reduce is dist.distributed_c10d.all_reduce and len(bad.violations()) == 1
    return True


def test_check_records_and_restores():
    assert run_distributed(_unit, 2, timeout_s=60) == [True, True]
