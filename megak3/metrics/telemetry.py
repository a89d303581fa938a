"""Hardware telemetry: peak memory, NVML GPU sampling, wall-clock throughput."""
from __future__ import annotations

import os
import resource
import sys
import time
from typing import Callable, Optional

import torch


def peak_memory_source() -> str:
    """Which quantity :func:`peak_memory_mb` reports in this process: ``"cuda_max_allocated"``
    (torch's CUDA caching allocator, current device) or ``"host_peak_rss"`` (process max RSS)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return "cuda_max_allocated"
    return "host_peak_rss"


def peak_memory_mb() -> float:
    """Peak memory in MiB: ``torch.cuda.max_memory_allocated()`` once CUDA is in use, else the
    process's peak resident set size from ``getrusage`` (see :func:`peak_memory_source`).

    The CUDA number excludes allocator cache and NCCL buffers (it is what the model actually
    holds); the host number includes everything the process ever touched.
    """
    if peak_memory_source() == "cuda_max_allocated":
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_bytes() / 2**20


def _proc_status_bytes(field: str) -> Optional[int]:
    """``field`` (a kB line such as VmHWM or VmRSS) of /proc/self/status in bytes; None without it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """The process's resident high-water mark in bytes: ``VmHWM`` of /proc/self/status on Linux
    (this address space only), else ``getrusage``'s ru_maxrss. Linux carries ru_maxrss across
    exec, so a process started by a large parent (a pytest worker) would report the parent's peak."""
    hwm = _proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # macOS reports bytes, Linux KiB


def rss_bytes() -> int:
    """The process's resident set size now, in bytes (``VmRSS`` of /proc/self/status; 0 where
    that file does not exist)."""
    return _proc_status_bytes("VmRSS") or 0


def malloc_in_use_bytes() -> Optional[int]:
    """Bytes glibc's malloc has handed out and not freed (arena + mmapped chunks; ``mallinfo2``):
    torch's CPU tensors live there, so a difference around a forward is what it keeps for the
    backward. Unlike saved_tensors_hooks it also sees inside checkpointed regions. None off glibc."""
    import ctypes

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None

    class _MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    fn.restype = _MallInfo2
    m = fn()
    return m.uordblks + m.hblkhd


def reset_peak_rss() -> bool:
    """Restart the resident high-water mark at the current RSS (Linux ``clear_refs`` 5); False
    where that is not possible (the peak then covers the whole process life)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class GPUTelemetry:
    """Samples power, memory in use and utilisation of this process's GPU through NVML.

    When NVML cannot initialise (no driver, no ``nvidia-ml-py``), ``available`` is False, one
    notice line is printed and :meth:`sample` returns ``{}``: telemetry is never a reason to fail.
    The NVML device is matched to the CUDA device by UUID because NVML ignores CUDA_VISIBLE_DEVICES.
    """

    def __init__(self, cuda_index: Optional[int] = None, verbose: bool = True):
        self.available = False
        self._nvml = None
        self._handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._device_handle(pynvml, cuda_index)
            self.available = True
        except Exception as e:  # NVMLError_LibraryNotFound, ImportError, driver mismatch, ...
            if verbose:
                print(f"NVML unavailable ({type(e).__name__}: {e}): GPU telemetry skipped",
                      file=sys.stderr, flush=True)

    @staticmethod
    def _device_handle(pynvml, cuda_index: Optional[int]):
        if cuda_index is None:  # this rank's GPU, chosen as init_parallel chose it (LOCAL_RANK, SLURM_LOCALID, ...)
            from parallel.state import local_device_index

            count = torch.cuda.device_count() if torch.cuda.is_available() else pynvml.nvmlDeviceGetCount()
            cuda_index = local_device_index(os.environ, count)
        if torch.cuda.is_available():
            try:
                uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
                return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:
                pass  # older torch without .uuid, or MIG: fall back to the index
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)

    def sample(self) -> dict:
        """``{gpu_power_w, gpu_mem_used_mb, gpu_util_pct}``; a reading the GPU does not support
        (e.g. power on some MIG slices) is left out rather than failing."""
        if not self.available:
            return {}
        nv, h = self._nvml, self._handle
        readings = {
            "gpu_power_w": lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,  # reported in mW
            "gpu_mem_used_mb": lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20,
            "gpu_util_pct": lambda: float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
        }
        out = {}
        for key, read in readings.items():
            try:
                out[key] = read()
            except Exception:
                pass
        return out

    def close(self) -> None:
        if self.available:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self.available = False


class Throughput:
    """Tokens/s and step time from wall-clock deltas between consecutive :meth:`step` calls.

    On GPU the clock only means something after a synchronising call (``loss.item()`` is one);
    the training loop already has one per step for logging. ``clock`` is injectable for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._last = clock()

    def reset(self) -> None:
        """Restart the interval (e.g. after evaluation or checkpointing, which are not training)."""
        self._last = self._clock()

    def step(self, tokens: int, steps: int = 1) -> dict:
        """Close the interval covering ``steps`` optimizer steps that processed ``tokens`` tokens;
        returns ``{tokens_per_s, step_time_ms}`` (step time averaged over ``steps``)."""
        now = self._clock()
        dt = max(now - self._last, 1e-9)
        self._last = now
        return {"tokens_per_s": tokens / dt, "step_time_ms": 1000.0 * dt / max(steps, 1)}
