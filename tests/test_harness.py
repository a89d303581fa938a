"""parallel.testing.run_distributed: results, failure propagation, hangs and hard deaths.

Rank bodies live at module level because each rank imports this module to find them.
"""
import ctypes
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from parallel.testing import DistributedTestError, run_distributed


def _all_reduce_rank(rank, world_size, scale):
    t = torch.tensor([float(rank + 1)]) * scale
    dist.all_reduce(t)
    env = tuple(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGAK3_PROBE"))
    return t.item(), env, torch.get_num_threads()


def _gather_rank(rank, world_size, base):
    # Each rank contributes a distinct row; all_gather makes every rank hold the same full matrix.
    row = base[rank] * (rank + 1)
    rows = [torch.empty_like(row) for _ in range(world_size)]
    dist.all_gather(rows, row)
    full = torch.stack(rows)
    full.requires_grad_()  # comes back detached: results never carry autograd state
    return {"rank": rank, "full": full, "view": full[1:, ::2]}


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("bad shard 1234")
    dist.barrier()  # rank 0 is left waiting for the dead rank 1: the harness must kill it


def _hang_on_rank1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))


def _exit_on_rank1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _segfault_on_rank0(rank, world_size):
    if rank == 0:
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    dist.barrier()


def test_all_reduce_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the rendezvous dir goes
    results = run_distributed(_all_reduce_rank, 2, 10.0, env={"MEGAK3_PROBE": 7})
    # (1 + 2) * 10 on both ranks; environment and thread count as documented.
    assert results == [(30.0, ("0", "2", "0", "7"), 1), (30.0, ("1", "2", "1", "7"), 1)]
    # The rendezvous directory was removed (pymp-* is multiprocessing's own, kept until exit).
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("pymp-")] == []


def test_four_ranks_return_tensors():
    base = torch.arange(12.0).reshape(4, 3)
    results = run_distributed(_gather_rank, 4, base)
    expected = base * torch.arange(1.0, 5.0)[:, None]
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        torch.testing.assert_close(r["full"], expected, rtol=0, atol=0)
        assert not r["full"].requires_grad
        # A view comes back as a compact copy of just its elements.
        torch.testing.assert_close(r["view"], expected[1:, ::2], rtol=0, atol=0)
        assert r["view"].untyped_storage().nbytes() == r["view"].numel() * 4


def test_exception_names_rank_and_carries_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank1, 2, timeout_s=300, collective_timeout_s=120)
    msg = str(info.value)
    assert msg.startswith("rank 1 of 2 raised:")
    assert "ValueError: bad shard 1234" in msg
    assert 'raise ValueError("bad shard 1234")' in msg  # the source line from the traceback
    assert "rank 0" in msg  # the blocked rank is accounted for
    # Rank 0 was killed, not left to its 120 s collective timeout (the bound leaves room for a
    # cold forkserver on a busy machine).
    assert time.monotonic() - t0 < 60


def test_hang_times_out_naming_ranks():
    # Warm this worker's forkserver first, so that both ranks surely reach fn within the timeout.
    assert [r[0] for r in run_distributed(_all_reduce_rank, 2, 1.0)] == [3.0, 3.0]
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_hang_on_rank1, 2, timeout_s=8)
    elapsed = time.monotonic() - t0
    msg = str(info.value)
    assert "timed out" in msg and "ranks [0, 1] of 2 had not finished" in msg
    # Each rank's stacks show where it was stuck: rank 0 in the collective, rank 1 in its sleep.
    stacks0, stacks1 = msg.split("--- stacks of rank 0")[1].split("--- stacks of rank 1")
    assert "in all_reduce" in stacks0 and "in _hang_on_rank1" in stacks0
    assert "in all_reduce" not in stacks1 and "in _hang_on_rank1" in stacks1
    assert elapsed >= 8  # never before the timeout (one-sided: a busy machine only adds time)


def test_hard_exit_reports_exit_code():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_on_rank1, 2, timeout_s=60)
    msg = str(info.value)
    assert msg.startswith("rank 1 of 2 exited with exit code 3 without a Python exception"), msg


def test_segfault_reports_signal_and_stack():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_segfault_on_rank0, 2, timeout_s=60)
    msg = str(info.value)
    assert msg.startswith("rank 0 of 2 was killed by signal SIGSEGV (exit code -11)"), msg
    assert "_segfault_on_rank0" in msg  # faulthandler's stack of the crashed rank


def test_local_function_is_refused_before_spawning():
    with pytest.raises(TypeError, match="module-level fn"):
        run_distributed(lambda rank, world_size: rank, 2)


def test_join_failure_is_marked_and_not_retried_when_not_gloo_mesh():
    """A rank that cannot join the harness's group says so (fn never ran); only gloo's transient
    connectFullMesh failure is started again, so a backend that cannot exist fails at once."""
    from parallel.testing import _JOIN_FAILED

    with pytest.raises(DistributedTestError) as e:
        run_distributed(_all_reduce_rank, 2, 1.0, backend="no_such_backend", timeout_s=60)
    assert _JOIN_FAILED.strip() in str(e.value) and "connectFullMesh" not in str(e.value)
