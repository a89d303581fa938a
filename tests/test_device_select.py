"""Which GPU a rank drives (issue 24, finding 7), checked on CPU with a faked CUDA device count.

torchrun sets LOCAL_RANK; a plain ``srun`` task has only SLURM_LOCALID; a bare launcher only
RANK. Before the fix ``init_parallel`` set the device only from LOCAL_RANK, so under ``srun``
without torchrun every rank (and every object collective, which stages on the current device)
used GPU 0."""
import pytest
import torch
import torch.distributed as dist

from megak3.launch.preemption import PreemptionHandler
from megak3.metrics.telemetry import GPUTelemetry
from parallel.config import ParallelConfig
from parallel.state import init_parallel, local_device_index

LAUNCH_ENV = ("LOCAL_RANK", "SLURM_LOCALID", "RANK", "WORLD_SIZE")


@pytest.mark.parametrize("env, count, want", [
    ({"LOCAL_RANK": "3", "SLURM_LOCALID": "1", "RANK": "11"}, 8, 3),  # torchrun wins
    ({"SLURM_LOCALID": "2", "RANK": "10"}, 4, 2),                     # srun without torchrun
    ({"RANK": "13"}, 4, 1),                                           # only a global rank
    ({"SLURM_LOCALID": "5"}, 1, 0),                                   # one GPU bound per task
    ({}, 2, 0),
])
def test_local_device_index(env, count, want):
    assert local_device_index(env, count) == want


def test_local_device_index_errors_name_the_variable():
    with pytest.raises(ValueError, match="LOCAL_RANK=5 but this node has 4 visible CUDA devices"):
        local_device_index({"LOCAL_RANK": "5"}, 4)
    with pytest.raises(ValueError, match="SLURM_LOCALID='x' must be an integer"):
        local_device_index({"SLURM_LOCALID": "x"}, 4)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        local_device_index({"LOCAL_RANK": "0"}, 0)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("env, want", [({"SLURM_LOCALID": "3", "RANK": "7"}, 3),
                                       ({"RANK": "6"}, 2),
                                       ({"LOCAL_RANK": "1", "RANK": "5"}, 1)])
def test_init_parallel_selects_the_device_before_nccl_starts(monkeypatch, env, want):
    """Four faked GPUs, 8 ranks: the device is set from the launcher's variables before
    init_process_group (where NCCL binds it), also without LOCAL_RANK."""
    for k in LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in {**env, "WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))

    def init(*a, **k):
        calls.append(("init_process_group", a[0] if a else k.get("backend")))
        raise _Stop

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    with pytest.raises(_Stop):
        init_parallel(ParallelConfig(dp=8), backend="nccl")
    assert calls == [("set_device", want), ("init_process_group", "nccl")], calls


def test_preemption_flag_and_nvml_follow_the_selected_device(monkeypatch):
    """The collective's flag tensor and the NVML handle use the rank's GPU (SLURM_LOCALID=3), not
    the current device (0 in a process that never set it)."""
    for k in LAUNCH_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert PreemptionHandler.flag_device("nccl") == torch.device("cuda", 3)
    assert PreemptionHandler.flag_device("gloo") == torch.device("cpu")

    class FakeNVML:
        @staticmethod
        def nvmlDeviceGetCount():
            return 4

        @staticmethod
        def nvmlDeviceGetHandleByIndex(i):
            return ("handle", i)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert GPUTelemetry._device_handle(FakeNVML, None) == ("handle", 3)
