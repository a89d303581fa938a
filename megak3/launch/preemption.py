"""Preemption: turn SIGTERM / SIGUSR1 into "checkpoint at the next step boundary, then exit".

SLURM sends SIGUSR1 ``--signal`` seconds before the time limit (the generated sbatch asks for it)
and SIGTERM when it preempts or cancels the job. A signal handler may run between any two
bytecodes, so it only sets a flag. The training loop asks :meth:`PreemptionHandler.requested`
after every optimizer step; that call all-reduces the flag (MAX) over the world, so every rank
sees the same answer at the same step even when only some ranks got the signal (or got it a
step later). The trainer passes ``ParallelState.host_group`` (gloo, CPU tensors), so under NCCL
the per-step check waits for the other ranks' host threads, never for the GPU. The loop then saves a checkpoint, closes its logger and raises :class:`Preempted`;
the entry point (``python -m megak3.train``) exits with :data:`REQUEUE_EXIT_CODE`, on which the
sbatch script runs ``scontrol requeue``; the requeued job resumes with ``train.resume=auto``.
Under several ranks the signal goes to ``python -m megak3.launch.torchrun``, which passes it to
the ranks and exits 75 when they did. :func:`catch_early` (called first thing by the entry point)
keeps a signal that arrives while a rank is still starting up for the handler.

    handler = PreemptionHandler(device=device).install()
    for step in ...:
        train_step()
        if handler.requested():          # collective: every rank calls it at every step
            save(); logger.close()
            raise Preempted(step, handler.signal_name)
    handler.uninstall()
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Iterable, Optional

import torch
import torch.distributed as dist

REQUEUE_EXIT_CODE = 75
"""exit status of a preempted run that saved its checkpoint (sysexits' EX_TEMPFAIL: "try again");
the sbatch script requeues the job on it, anything else ends the job"""

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


_early: list = []
"""signals caught by :func:`catch_early` and not yet taken over by a PreemptionHandler"""


def _remember(signum, frame) -> None:  # noqa: ARG001
    _early.append(signum)


def catch_early(signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
    """Remember ``signals`` instead of dying of them until a :class:`PreemptionHandler` is
    installed (start-up: imports, data, model build); the handler then acts on them at the first
    step. Also active again after the handler is uninstalled (a signal during shutdown is
    ignored). Main thread only."""
    if threading.current_thread() is threading.main_thread():
        for s in signals:
            signal.signal(s, _remember)


class Preempted(Exception):
    """Raised by the training loop after the preemption checkpoint is on disk."""

    exit_code = REQUEUE_EXIT_CODE

    def __init__(self, step: int, signal_name: str = ""):
        self.step = step
        self.signal_name = signal_name
        super().__init__(f"preempted by {signal_name or 'a signal'}: checkpoint saved at step {step}; "
                         f"exiting with {REQUEUE_EXIT_CODE} so the job is requeued (train.resume=auto resumes)")


class PreemptionHandler:
    """Installs signal handlers that set a flag; :meth:`requested` agrees on it across ranks.

    Args:
        signals: which signals mean "stop soon" (default SIGTERM and SIGUSR1).
        group: process group to agree over (default: the world when torch.distributed is up).
        device: where the one-element flag tensor lives for the all-reduce (CUDA under NCCL).
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS, group=None,
                 device: Optional[torch.device] = None):
        self.signals = tuple(signals)
        self.group = group
        self.device = device
        self.signal_received: Optional[int] = None
        self._previous: dict = {}
        self._agreed = False

    # ---- handlers ----------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        if self.signal_received is None:
            self.signal_received = signum

    def install(self) -> "PreemptionHandler":
        """Replace the handlers of ``signals``; the old ones are kept for uninstall. Outside the main
        thread (Python only delivers signals there) this is a no-op and only ``requested`` works."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for s in self.signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._on_signal)
        for s in list(_early):  # a signal that arrived during start-up (catch_early)
            if s in self.signals:
                self._on_signal(s, None)
            _early.remove(s)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were installed before :meth:`install`."""
        for s, old in self._previous.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # ---- queries -----------------------------------------------------------------------------
    @property
    def local(self) -> bool:
        """Whether THIS process got one of the signals (no communication)."""
        return self.signal_received is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal_received).name if self.signal_received is not None else ""

    @staticmethod
    def flag_device(backend: str) -> torch.device:
        """Where the flag lives without an explicit ``device``: this rank's selected GPU under NCCL
        (parallel.state.local_device_index, as init_parallel selects it; not the current device,
        which is GPU 0 in a process that never set it), else the CPU."""
        if backend != "nccl":
            return torch.device("cpu")
        from parallel.state import local_device_index

        return torch.device("cuda", local_device_index(os.environ, torch.cuda.device_count()))

    def requested(self) -> bool:
        """True on every rank iff some rank got a signal. Collective over ``group``: every rank
        must call it at the same points (after each optimizer step). One all-reduce of one int."""
        if self._agreed:
            return True
        flag = self.local
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            device = self.device
            if device is None:
                device = self.flag_device(dist.get_backend(self.group))
            t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            flag = bool(t.item())
        self._agreed = flag
        return flag
