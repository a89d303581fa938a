"""Multi-rank test harness: run one function on N ranks, each in its own process, and collect results;
and the deterministic fixtures of the layout tests (:data:`PARITY_MODEL`, :func:`global_batch`,
:func:`local_rows`), shared by megak3/train/parity.py, parallel/pipeline_trace.py, tests and tools.

    def _sum(rank, world_size, scale):          # module level: it is pickled by reference
        t = torch.tensor([float(rank)]) * scale
        dist.all_reduce(t)
        return t

    results = run_distributed(_sum, 2, 10.0)    # [tensor([10.]), tensor([10.])]

Every rank has joined a gloo process group (file:// rendezvous in a fresh temporary directory, so
no ports and any number of pytest-xdist workers at once) before `fn` runs. A failure in one rank
becomes one `DistributedTestError` in the caller that carries that rank's traceback; the other
ranks are killed instead of being left blocked in a collective; a hang becomes an error naming the
unfinished ranks, with their Python stacks at the moment of the timeout.

The caller's main module is imported again in every rank (the multiprocessing rule), so a script
that calls run_distributed must guard its entry point with `if __name__ == "__main__":`.

Ranks are forked from multiprocessing's *forkserver*, which imports torch once per caller process:
after the first call a 2-rank run costs ~0.1 s instead of the 2-3 s per rank that
"spawn" spends re-importing torch. Set MEGAK3_MP_START=spawn to use "spawn" instead (slower, and
immune to anything the forkserver may hold over from its import of torch).
"""
from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

__all__ = ["PARITY_MODEL", "DistributedTestError", "global_batch", "local_rows", "run_distributed", "run_threaded"]

# After the first failure the other ranks get this long to report errors of their own before they
# are killed: long enough for ranks failing on their own at the same time, short enough for a test.
_GRACE_S = 0.5
# faulthandler writes from a C signal handler, so a rank blocked inside gloo dumps in milliseconds.
_STACK_DUMP_S = 0.3
# A rank that has sent its result normally exits within milliseconds; this bounds a stuck teardown.
_EXIT_WAIT_S = 10.0
_MAX_STACK_CHARS = 4000


class DistributedTestError(RuntimeError):
    """A rank of `run_distributed` raised, died without an exception, or did not finish in time."""


# First line of a rank's error when it failed while joining the harness's group (before fn ran).
_JOIN_FAILED = "[joining the process group, before fn ran]\n"


def run_distributed(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120,
                    collective_timeout_s: float = 60, env: dict | None = None, **kwargs) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return their results.

    fn: a module-level function (pickled by reference, so lambdas and nested functions are
        refused here, before any process starts). Its module is imported again in every rank.
    args, kwargs: passed to every rank; pickled, so tensors arrive as copies.
    backend: the torch.distributed backend each rank joins before fn ("gloo" on CPU).
    timeout_s: limit on the whole run, process start-up included (the first call in a process
        starts the forkserver: 1-3 s, more on a busy machine); past it unfinished ranks are killed.
    collective_timeout_s: the process group's timeout, which bounds each collective and the
        rendezvous (keep it above timeout_s to let the harness, not gloo, report hangs).
    env: extra environment variables for the ranks, on top of a copy of the caller's environment
        and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE. Variables torch reads at import time
        (OMP_NUM_THREADS, ...) are already fixed in a forkserver rank; use MEGAK3_MP_START=spawn.

    Returns [result of rank 0, result of rank 1, ...]; results must be picklable and every plain
    tensor in them comes back detached, on the CPU, as a compact copy.
    Raises DistributedTestError as described in the module docstring.
    Each rank runs torch.set_num_threads(1): many ranks share few cores.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    try:
        return _run_once(fn, world_size, args, backend, timeout_s, collective_timeout_s, env, kwargs)
    except DistributedTestError as e:
        # gloo's TCP mesh set-up now and then loses a connection on a loaded machine ("Gloo
        # connectFullMesh failed ... Connection closed by peer"); fn has not run on any rank then,
        # so one fresh start is safe. Anything else, or a second such failure, is the caller's.
        if _JOIN_FAILED not in str(e) or "connectFullMesh" not in str(e):
            raise
    return _run_once(fn, world_size, args, backend, timeout_s, collective_timeout_s, env, kwargs)


def _run_once(fn, world_size, args, backend, timeout_s, collective_timeout_s, env, kwargs) -> list:
    try:
        call = pickle.dumps((fn, args, kwargs))
    except Exception as e:  # lambdas, local functions, open files ...
        raise TypeError(f"run_distributed needs a module-level fn and picklable arguments: {e}") from e

    ctx = _context()
    tmp = tempfile.mkdtemp(prefix="megak3-dist-")
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            rank_env = {**os.environ, **{k: str(v) for k, v in (env or {}).items()},
                        "RANK": str(rank), "WORLD_SIZE": str(world_size),
                        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)}
            spec = {"call": call, "backend": backend, "collective_timeout_s": collective_timeout_s,
                    # The file must not exist yet: FileStore treats an existing file as a live store.
                    "init_method": "file://" + os.path.join(tmp, "rendezvous"),
                    "stack_path": os.path.join(tmp, f"stack{rank}.txt"),
                    # A forkserver child inherits the server's sys.path and environment, frozen
                    # when it started; send the caller's current ones.
                    "sys_path": list(sys.path), "environ": rank_env}
            reader, writer = ctx.Pipe(duplex=False)
            alive_r, alive_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, args=(rank, world_size, spec, writer, alive_r),
                               name=f"megak3-rank{rank}", daemon=True)
            proc.start()
            writer.close()  # keep only the child's ends, so each side's death reads as EOF
            alive_r.close()
            ranks.append(_Rank(rank, proc, reader, alive_w, spec["stack_path"]))
        return _collect(ranks, timeout_s)
    finally:
        for r in ranks:  # normally all exited already; this covers errors and KeyboardInterrupt
            if r.proc.is_alive():
                r.proc.kill()
            r.proc.join()
            r.conn.close()
            r.alive.close()
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------
# Inside a rank


class _CpuPickler(pickle.Pickler):
    """Pickles plain tensors as detached, compact CPU copies (never device or shared memory)."""

    def reducer_override(self, obj):
        # Subclasses (DTensor, ...) keep their own pickling; a Parameter comes back a plain tensor.
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            return obj.detach().cpu().clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def _dump_result(result) -> bytes:
    buf = io.BytesIO()
    _CpuPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(result)
    return buf.getvalue()


def _exit_with_caller(alive) -> None:
    """Ends this rank when the caller dies (EOF on `alive`): a rank blocked in a collective or
    a sleep would otherwise outlive a killed test run (daemonic cleanup needs a normal exit)."""
    try:
        alive.recv()
    except (EOFError, OSError):
        pass
    os._exit(70)


def _rank_main(rank: int, world_size: int, spec: dict, conn, alive) -> None:
    """Body of one rank's process: join the group, run fn, send ("ok", result) or ("error", tb)."""
    threading.Thread(target=_exit_with_caller, args=(alive,), daemon=True).start()
    sys.path[:] = spec["sys_path"]  # before unpickling fn, which imports fn's module
    os.environ.clear()
    os.environ.update(spec["environ"])
    # Crashes (SIGSEGV, abort) and the parent's SIGUSR1 at a timeout write this rank's stacks here.
    stack_file = open(spec["stack_path"], "w")  # noqa: SIM115 - must stay open for faulthandler
    faulthandler.enable(stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, stack_file, all_threads=True)
    torch.set_num_threads(1)
    joined = False
    try:
        fn, args, kwargs = pickle.loads(spec["call"])
        dist.init_process_group(spec["backend"], init_method=spec["init_method"], rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=spec["collective_timeout_s"]))
        joined = True
        reply = ("ok", _dump_result(fn(rank, world_size, *args, **kwargs)))
    except BaseException:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are failures too
        reply = ("error", ("" if joined else _JOIN_FAILED) + traceback.format_exc())
    # Reply before tearing down: if fn failed, the error must reach the parent even if teardown hangs.
    conn.send(reply)
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------
# In the caller


@dataclass
class _Rank:
    """The caller's view of one rank: its process, its pipes and what it has reported so far."""

    rank: int
    proc: mp.process.BaseProcess
    conn: object  # the read end of this rank's pipe
    alive: object  # its closing (even by our death) ends the rank
    stack_path: str
    reply: tuple | None = None  # ("ok", bytes) or ("error", traceback text)
    eof: bool = False  # the pipe closed without a reply: the process died
    exited: bool = False

    def failed(self) -> bool:
        if self.reply is not None and self.reply[0] == "error":
            return True
        return self.exited and (self.reply is None or self.proc.exitcode != 0)

    def read(self) -> None:
        try:
            self.reply = self.conn.recv()
        except (EOFError, OSError):
            self.eof = True

    def stacks(self) -> str:
        try:
            with open(self.stack_path) as f:
                text = f.read().strip()
        except OSError:
            return ""
        return text if len(text) <= _MAX_STACK_CHARS else "...\n" + text[-_MAX_STACK_CHARS:]


def _context():
    method = os.environ.get("MEGAK3_MP_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver" and __name__ != "__main__":
        # Importing this module imports torch: the server pays it once, every rank inherits it.
        # No effect if this process already started its forkserver (it is shared by the process).
        # pytest too when the caller runs under it: every rank imports its test module, and
        # `import pytest` in 4 ranks on 2 cores costs ~1 s per run.
        ctx.set_forkserver_preload([__name__] + (["pytest"] if "pytest" in sys.modules else []))
    return ctx


def _collect(ranks: list[_Rank], timeout_s: float) -> list:
    """Wait for every rank; stop early once one fails. Returns the results or raises."""
    start = time.monotonic()
    stop_at = start + timeout_s
    failures: list[_Rank] = []  # in the order they were seen
    running = {r.rank: r for r in ranks}
    teardown = False  # every rank has replied; waiting for the processes to exit
    while running and time.monotonic() < stop_at:
        watch = {}
        for r in running.values():
            watch[r.proc.sentinel] = r
            if r.reply is None and not r.eof:
                watch[r.conn] = r  # read while the rank is alive: a large result fills the pipe
        for obj in wait(list(watch), timeout=max(0.0, stop_at - time.monotonic())):
            r = watch[obj]
            if r.rank not in running:
                continue
            if obj is r.conn:
                r.read()
            else:
                r.proc.join()
                r.exited = True
                if r.reply is None and not r.eof and r.conn.poll():
                    r.read()
                del running[r.rank]
            if r.failed() and r not in failures:
                failures.append(r)
                stop_at = min(stop_at, time.monotonic() + _GRACE_S)
        if not failures and not teardown and all(r.reply is not None for r in running.values()):
            # Everyone replied; only teardown is left, so a slow exit must not count as a hang.
            teardown = True
            stop_at = max(stop_at, time.monotonic() + _EXIT_WAIT_S)

    if failures:
        for r in running.values():
            r.proc.kill()
        # A rank that lost its gloo peer only echoes the real failure, and its error may arrive
        # before the dead peer's exit is seen: list such ranks last (stable sort keeps arrival order).
        failures.sort(key=_lost_peer)
        raise DistributedTestError(_failure_message(ranks, failures, running))
    if running:
        raise DistributedTestError(_timeout_message(ranks, running, time.monotonic() - start))
    return [pickle.loads(r.reply[1]) for r in ranks]


def _lost_peer(r: _Rank) -> bool:
    """Whether r failed only because a gloo connection to another rank broke."""
    return r.reply is not None and r.reply[0] == "error" and "gloo/transport" in r.reply[1]


def _describe_death(r: _Rank) -> str:
    code = r.proc.exitcode
    if code is not None and code < 0:
        how = f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
    else:
        how = f"exited with exit code {code}"
    if r.reply is not None:
        return f"returned its result but then {how}"
    return f"{how} without a Python exception"


def _failure_message(ranks, failures, running) -> str:
    world = len(ranks)
    first = failures[0]
    if first.reply is not None and first.reply[0] == "error":
        lines = [f"rank {first.rank} of {world} raised:", first.reply[1].rstrip()]
    else:
        lines = [f"rank {first.rank} of {world} {_describe_death(first)}"]
        if stacks := first.stacks():
            lines.append(stacks)
    others = []
    for r in failures[1:]:
        if r.reply is not None and r.reply[0] == "error":
            others.append(f"  rank {r.rank} raised: {r.reply[1].rstrip().splitlines()[-1]}")
        else:
            others.append(f"  rank {r.rank} {_describe_death(r)}")
    others += [f"  rank {rank} was killed (still running when rank {first.rank} failed)"
               for rank in sorted(running)]
    if others:
        lines += ["other ranks:", *others]
    return "\n".join(lines)


def _timeout_message(ranks, running, elapsed_s) -> str:
    unfinished = sorted(running)
    finished = [r.rank for r in ranks if r.rank not in running]
    for r in running.values():  # stacks first, kill after: ask each hung rank where it is
        try:
            os.kill(r.proc.pid, signal.SIGUSR1)
        except (OSError, AttributeError):  # gone meanwhile / a platform without SIGUSR1
            pass
    time.sleep(_STACK_DUMP_S)
    for r in running.values():
        r.proc.kill()
    lines = [f"run_distributed timed out after {elapsed_s:.1f} s: ranks {unfinished} of "
             f"{len(ranks)} had not finished (finished: {finished or 'none'})."]
    for rank in unfinished:
        state = "replied, then hung in teardown" if running[rank].reply else "no reply"
        lines += [f"--- stacks of rank {rank} ({state}) ---", running[rank].stacks() or "(none)"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Threaded ranks: one process, a thread per rank (torch's "threaded" group). For unit tests of
# collectives-heavy code where separate processes are not the point: no start-up, shared memory.


def run_threaded(world_size: int, fn, timeout: float = 60.0) -> list:
    """Run ``fn(group)`` on ``world_size`` threaded ranks sharing one "threaded" process group;
    returns the per-rank results in rank order. Inside ``fn``, ``dist.get_rank()`` is the thread's
    rank. The first failure is re-raised with its own type (for ``pytest.raises``) and every
    failing rank's traceback attached as a note; ranks blocked in a collective are woken; a rank
    still running after ``timeout`` seconds is a TimeoutError."""
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    results, errors = [None] * world_size, []

    def worker(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = fn(dist.group.WORLD)
        except SystemExit:  # woken because another rank failed
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append((exc, f"rank {rank}:\n{traceback.format_exc()}"))
            ProcessLocalGroup.exception_handle(exc)  # release ranks waiting in a collective
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"threaded ranks still running after {timeout}s (a collective mismatch?)")
    finally:
        ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    if errors:
        exc = errors[0][0]
        exc.add_note("\n".join(trace for _, trace in errors))
        raise exc
    return results


# ---------------------------------------------------------------------------------------------------
# Deterministic fixtures of the layout tests and benchmarks (the model widths and the batches every
# layout and its one-process reference train on).

PARITY_MODEL = {
    # k3_tiny's structure (layer schedule, 3 AttnRes blocks, dense layer 0, MoE + shared experts)
    # at widths where every head count and FFN width divides tp=4; trains in milliseconds a step.
    "hidden_size": 64, "dense_intermediate_size": 128,
    "kda.num_heads": 4, "kda.head_dim": 16, "kda.gate_rank": 8, "kda.chunk_size": 16,
    "mla.num_heads": 4, "mla.q_lora_rank": 32, "mla.kv_lora_rank": 16, "mla.qk_nope_head_dim": 8,
    "mla.qk_rope_head_dim": 8, "mla.v_head_dim": 8,
    "moe.num_experts": 8, "moe.top_k": 2, "moe.expert_intermediate_size": 32, "moe.latent_size": 32,
    "vision.enabled": False, "vocab_size": 512,
}
"""model.* overrides of k3_tiny used by the layout parity tests and benchmarks"""


def _packed_cu(rows: int, seqlen: int) -> torch.Tensor:
    """cu_seqlens of ``rows`` rows of ``seqlen`` tokens, each packing two documents (cut at T // 3)."""
    cut = seqlen // 3
    cu = [0]
    for b in range(rows):
        cu += [b * seqlen + cut, (b + 1) * seqlen]
    return torch.tensor(cu, dtype=torch.int32)


def global_batch(step: int, batch: int, seqlen: int, vocab: int, seed: int = 99):
    """Deterministic token batch with packed documents (two per row) for a step: (ids, labels,
    cu_seqlens); labels are ids shifted left, -100 at the end of each row."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(4, vocab, (batch, seqlen), generator=g)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return ids, labels, _packed_cu(batch, seqlen)


def local_rows(ids, labels, dp_rank: int, dp: int):
    """The rows of data-parallel rank ``dp_rank`` of ``dp`` (contiguous blocks) and their cu_seqlens."""
    B = ids.shape[0] // dp
    ids, labels = ids[dp_rank * B:(dp_rank + 1) * B], labels[dp_rank * B:(dp_rank + 1) * B]
    return ids, labels, _packed_cu(B, ids.shape[1])
