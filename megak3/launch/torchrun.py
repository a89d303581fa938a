"""``python -m megak3.launch.torchrun [torchrun options] -m megak3.train OVERRIDES``: torchrun for
megak3 jobs. The README's multi-rank commands, ``tools/launch.py``, the self-re-run of
``python -m megak3.train`` and the sbatch script's torchrun mode start their ranks through it.

It runs torchrun (``torch.distributed.run``) in this process and differs from it in three ways:

* SIGTERM and SIGUSR1 go to this node's ranks and torchrun keeps waiting for them (plain torchrun
  dies of SIGUSR1, and on SIGTERM kills its ranks after 30 s). The ranks agree on the signal,
  checkpoint and exit 75 (megak3.launch.preemption). SIGINT, SIGHUP and SIGQUIT stop the ranks as
  in torchrun.
* With ``-m megak3.train`` the overrides are composed and validated for nnodes x nproc-per-node
  ranks before any rank starts: a bad input prints one line and exits 2.
* Exit status: 0; 75 (REQUEUE_EXIT_CODE) when the ranks exited 75 (ranks torchrun stopped after
  that count as preempted); 2 when the ranks stopped on a user error (rank 0 printed it; when
  rank 0 did not exit 2 on this node, e.g. torchrun stopped it during its imports because another
  rank failed first, the line a rank recorded with :func:`record_user_error` is printed here,
  once); else 1 with one line naming the first failed rank. torchrun's ChildFailedError report and log lines
  are not printed (``LOGLEVEL=INFO`` shows the log). SIGTERM / SIGUSR1 before the ranks have
  started stop torchrun and exit 75 as well (nothing to save; the requeued job starts over).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Iterator, List, Mapping, Optional

from .commands import TRAIN_MODULE
from .preemption import DEFAULT_SIGNALS, REQUEUE_EXIT_CODE

PREFIX = "megak3.launch.torchrun"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGKILL)
"""how torchrun stops the remaining ranks once one has exited (SIGTERM, SIGKILL after 30 s)"""


def child_pids(pid: int) -> List[int]:
    """The processes whose parent is ``pid`` (``/proc`` on Linux, ``ps`` elsewhere)."""
    if os.path.isdir("/proc/self"):
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        return sorted(out)
    rows = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    return sorted(int(r.split()[0]) for r in rows if r.split() and int(r.split()[1]) == pid)


def _forward_to_ranks(signum, frame) -> None:  # noqa: ARG001
    ranks = child_pids(os.getpid())
    if not ranks:  # the ranks have not started: stop here, nothing to save
        from torch.distributed.elastic.multiprocessing.api import SignalException

        raise SignalException(f"got {signal.Signals(signum).name} before the ranks started",
                              sigval=signal.Signals(signum))
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


@contextlib.contextmanager
def forward_signals(proc: subprocess.Popen, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)) -> Iterator[None]:
    """While the block runs, pass ``signals`` received by this process on to ``proc``."""
    def handler(signum, frame):  # noqa: ARG001
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def exit_code(codes: List[int]) -> int:
    """The job's exit status from the ranks' exit codes (negative: killed by that signal)."""
    stopped = {-int(s) for s in STOP_SIGNALS}
    for code in (REQUEUE_EXIT_CODE, 2):
        if code in codes and all(c == code or c in stopped for c in codes):
            return code
    return 1


def record_user_error(line: str, env: Mapping[str, str] = os.environ) -> None:
    """Write a rank's one-line user error to its torchrun error file (``TORCHELASTIC_ERROR_FILE``,
    set by torchrun for each rank; nothing outside torchrun), where :func:`unprinted_user_error`
    finds it."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)


def _recorded(failure) -> bool:
    message = getattr(failure, "message", "")
    return isinstance(message, str) and message.startswith("megak3.")   # a megak3 entry point's line


def unprinted_user_error(failures: Mapping[int, object]) -> Optional[str]:
    """The line to print for ranks that stopped on a user error (exit 2) when rank 0 did not print
    it, i.e. global rank 0 is not among ``failures`` with exit code 2 or a recorded line (it was
    stopped before printing, or it runs on another node); None when rank 0 printed. ``failures``: global rank ->
    torchrun's ProcessFailure (``exitcode``, ``message``: the recorded line, if any)."""
    first = failures.get(0)
    if first is not None and (first.exitcode == 2 or _recorded(first)):
        return None     # rank 0 printed it (it records only after printing), then may have been stopped
    for rank in sorted(failures):
        if failures[rank].exitcode == 2 and _recorded(failures[rank]):
            return failures[rank].message
    rank = min(r for r in failures if failures[r].exitcode == 2)
    return (f"{PREFIX}: error: rank {rank} stopped on a user error (exit code 2) and recorded no message; "
            "its output is above")


def _local_ranks(nproc: str) -> Optional[int]:
    """torchrun's --nproc-per-node as a number ('cpu', 'gpu', 'auto' as torchrun counts them)."""
    if nproc.isdigit():
        return int(nproc)
    if nproc in ("gpu", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    return os.cpu_count() if nproc in ("cpu", "auto") else None


def _world(args) -> Optional[int]:
    """nnodes x nproc-per-node when the node count is fixed, else None."""
    lo, _, hi = str(args.nnodes).partition(":")
    local = _local_ranks(str(args.nproc_per_node))
    if not (lo.isdigit() and (not hi or hi == lo) and local):
        return None
    return int(lo) * local


def precheck(args, env: Mapping[str, str] = os.environ, local: bool = True) -> Optional[str]:
    """The one-line error of a megak3.train job that cannot run on this many ranks, else None
    (``local``: also this machine's data, checkpoint and CUDA)."""
    world = _world(args)
    if not (args.module and args.training_script == TRAIN_MODULE and world):
        return None
    from ..job.compose import check

    rank_env = dict(env, WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0",
                    LOCAL_WORLD_SIZE=str(_local_ranks(str(args.nproc_per_node))))
    return check(args.training_script_args, env=rank_env, local=local)[1]


def _usage_error(msg: str) -> None:
    print(f"{PREFIX}: error: {msg} (see --help)", file=sys.stderr)
    sys.exit(2)


def main(argv: Optional[List[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.prog, parser.description = PREFIX, __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.error = lambda msg: _usage_error(msg)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    error = precheck(args)
    if error:
        print(f"{PREFIX}: error: {error}", file=sys.stderr, flush=True)
        return 2
    args.signals_to_handle = "SIGINT,SIGHUP,SIGQUIT"  # SIGTERM stays ours: forwarded, no 30 s kill
    for s in DEFAULT_SIGNALS:
        signal.signal(s, _forward_to_ranks)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning
    if "LOGLEVEL" not in os.environ:  # torchrun's own log lines (LOGLEVEL=INFO shows them)
        for name in ["torch.distributed.elastic"] + list(logging.root.manager.loggerDict):
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        run(args)
    except ValueError as e:  # torchrun's own checks of its options
        print(f"{PREFIX}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except ChildFailedError as e:
        failures = sorted(e.failures.items(), key=lambda kv: kv[1].timestamp)
        code = exit_code([f.exitcode for _, f in failures])
        if code == REQUEUE_EXIT_CODE:
            print(f"{PREFIX}: the ranks were preempted and saved a checkpoint; exiting {code} "
                  "(requeue, then train.resume=auto)", file=sys.stderr, flush=True)
        elif code == 2:  # a user error: rank 0 printed it, or a rank recorded it
            line = unprinted_user_error(e.failures)
            if line:
                print(line, file=sys.stderr, flush=True)
        else:
            rank, f = failures[0]
            how = f"signal {signal.Signals(-f.exitcode).name}" if f.exitcode < 0 else f"exit code {f.exitcode}"
            print(f"{PREFIX}: error: rank {rank} failed with {how} (its output is above)", file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        sig = e.sigval
        print(f"{PREFIX}: stopped by {sig.name}", file=sys.stderr, flush=True)
        return REQUEUE_EXIT_CODE if sig in DEFAULT_SIGNALS else 128 + int(sig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
