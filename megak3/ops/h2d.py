"""Host-to-device copies that never block the host: the one home for a training step's H2D traffic.

On CUDA ``t.to(device)`` (and ``torch.tensor(data, device=)``) of a pageable (ordinary) host
tensor blocks the host: torch synchronizes the stream after the copy, so the host waits for every
kernel queued before it and stops running ahead of the GPU. With ``non_blocking=True`` from pageable
memory the driver must first stage the bytes into pinned memory itself and "may synchronize with
the stream" to do so (CUDA runtime API, API synchronization behavior). From *pinned* (page-locked)
memory with ``non_blocking=True`` the copy is a DMA queued on the current stream and the call
returns at once.

:func:`host_to_device` moves a list of host tensors in ONE such copy:

1. pack: every tensor is copied (a host memcpy) into one staging buffer of bytes, each at an offset
   aligned to :data:`ALIGN` bytes. The buffer is pinned on CUDA (``torch.empty(pin_memory=True)``,
   served by torch's caching host allocator, so after the first steps no page-locking happens).
   Packing also frees the caller's tensors at once: the loader may reuse or change them as soon as
   the call returns.
2. copy: ``staging.to(device, non_blocking=True)``, one DMA on the device's current stream.
3. unpack: each result is a view of the device buffer (``view(dtype).view(shape)``); the results are
   ordered after the copy on that stream like any other kernel's output. A consumer on ANOTHER
   stream must wait for the current stream (or call ``record_stream``) as for any tensor.

Lifetime: the pinned staging buffer must stay alive, and unwritten, until the DMA has read it. Each
copy records a CUDA event on the stream right after it and keeps (buffer, event) in an in-flight
list; every later call drops the entries whose event has completed (``Event.query()``: never
waits). So a buffer is released, and can be handed out again by the allocator, only after its copy
finished, and nothing writes into a buffer while a copy reads it (every call packs into a fresh
allocation). Between two training steps the list holds the previous step's one or two buffers.
(torch's caching host allocator also records an event when a pinned block takes part in a
non-blocking copy; the list above does not rely on it.)

Elsewhere (CPU, meta): each tensor is returned as ``t.to(device)``, the identity on the host (no
copy, no packing); the packing path is exercised on CPU through :func:`pack` / :func:`unpack` by the
tests. tests/test_host_syncs.py counts any host-to-device copy of a step made outside this module.
"""
from __future__ import annotations

import threading
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = ["ALIGN", "host_to_device", "pack", "unpack", "in_flight"]

ALIGN = 16
"""byte alignment of every tensor in the staging buffer (the largest element size, complex128)"""

Slot = Tuple[int, torch.dtype, torch.Size]
"""(byte offset, dtype, shape) of one packed tensor"""

_lock = threading.Lock()
_in_flight: List[tuple] = []   # (pinned staging buffer, torch.cuda.Event recorded after its copy)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack(tensors: Sequence[torch.Tensor], pin: bool = False) -> Tuple[torch.Tensor, List[Slot]]:
    """One uint8 host buffer holding every tensor's bytes (pinned when ``pin``), and their slots."""
    slots, off = [], 0
    for t in tensors:
        slots.append((off, t.dtype, t.shape))
        off += -(-_nbytes(t) // ALIGN) * ALIGN
    buf = torch.empty(off, dtype=torch.uint8, pin_memory=pin)
    for t, (o, dt, shape) in zip(tensors, slots):
        buf[o:o + _nbytes(t)].view(dt).view(shape).copy_(t)
    return buf, slots


def unpack(buf: torch.Tensor, slots: Sequence[Slot]) -> List[torch.Tensor]:
    """The tensors of ``slots`` as views of ``buf`` (a packed buffer, on any device)."""
    out = []
    for o, dt, shape in slots:
        n = shape.numel() * dt.itemsize
        out.append(buf[o:o + n].view(dt).view(shape))
    return out


def in_flight() -> int:
    """Staging buffers whose copy has not been seen complete yet (kept alive until it is)."""
    with _lock:
        return len(_in_flight)


def _track(buf: torch.Tensor, event) -> None:
    """Keep ``buf`` alive until ``event`` (recorded after its copy) completes; release the
    buffers whose copies have completed (``query()``: never waits)."""
    with _lock:
        _in_flight[:] = [(b, ev) for b, ev in _in_flight if not ev.query()]
        _in_flight.append((buf, event))


def host_to_device(tensors: Sequence[Optional[torch.Tensor]], device) -> List[Optional[torch.Tensor]]:
    """``tensors`` (host tensors, or None: passed through) on ``device``, without blocking the host.

    CUDA: one pinned staging buffer, one ``non_blocking`` copy, results are views of one device
    buffer (see the module docstring for the lifetime rule). Other devices: ``t.to(device)`` each
    (the identity on the CPU). On CUDA a tensor already on ``device`` is returned as it is."""
    device = torch.device(device)
    out = list(tensors)
    if device.type != "cuda":
        return [None if t is None else t.to(device) for t in tensors]
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    idx = [i for i, t in enumerate(tensors) if t is not None and t.device != device]
    if not idx:
        return out
    if any(tensors[i].device.type != "cpu" for i in idx):
        raise ValueError(f"host_to_device: every tensor must be on the host or on {device}; got "
                         f"{sorted({str(tensors[i].device) for i in idx})}")
    buf, slots = pack([tensors[i] for i in idx], pin=True)
    dev_buf = buf.to(device, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    _track(buf, ev)
    for i, t in zip(idx, unpack(dev_buf, slots)):
        out[i] = t
    return out
