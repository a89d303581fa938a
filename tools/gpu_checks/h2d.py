"""Part h of tools/gpu_check.py: megak3/ops/h2d.py's host-to-device copy on CUDA. The values arrive
bit for bit; with GPU work queued the helper returns without waiting for it while a plain
``.to(device)`` of the same pageable tensor waits (the control); the caller may change its tensor as
soon as the call returns; a staging buffer stays in flight until its copy completes and is released
by the next call after that. (The packing is tested on CPU by tests/test_h2d.py; that a training step
makes no other host-to-device copy, by tests/test_host_syncs.py.)"""
from __future__ import annotations

import time

import torch

from .common import Check, Skip, sync

HELPER_MAX = 0.25   # the helper's host time with Q seconds of GPU work queued: < 0.25 Q
BLOCKING_MIN = 0.5  # the control (.to(device) of pageable memory): > 0.5 Q


def _cycles_per_s(dev) -> float:
    """GPU clock cycles per second of ``torch.cuda._sleep`` (measured with CUDA events)."""
    sync(dev)
    n = 50_000_000
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(n)
    e.record()
    e.synchronize()
    return n / (s.elapsed_time(e) / 1e3)


def _host_seconds(fn, dev, queued_s: float, cps: float):
    """(host seconds of ``fn()`` issued behind ``queued_s`` of GPU work, its result after a sync)."""
    sync(dev)
    torch.cuda._sleep(int(queued_s * cps))
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    sync(dev)
    return dt, out


def part_h2d(dev, quick, ctx):
    if dev.type != "cuda":
        raise Skip("pinned staging and non-blocking copies are CUDA's (the packing is tested on CPU: "
                   "tests/test_h2d.py)")
    from megak3.ops import h2d

    chk = Check()
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(0, 150_000, (2, 4096), generator=g), torch.randn(5, 7, generator=g).t(),
           torch.tensor([True, False, True]), torch.empty(0, 3, dtype=torch.int32),
           torch.randn(9, generator=g).to(torch.bfloat16), torch.randn((), generator=g, dtype=torch.float64)]
    out = h2d.host_to_device(src, dev)
    sync(dev)
    chk.require("values", all(o.is_cuda and o.dtype == s.dtype and o.shape == s.shape and torch.equal(o.cpu(), s)
                              for o, s in zip(out, src)), "every tensor arrives bit for bit (6 dtypes/shapes)")

    cps = _cycles_per_s(dev)
    queued = 0.2 if quick else 0.5
    ids = torch.randint(0, 150_000, (4, 65536), generator=g)   # 2 MiB: a micro-batch of 256K token ids
    h2d.host_to_device([ids], dev)                               # warm the caching host allocator
    sync(dev)
    t_helper, (d_helper,) = _host_seconds(lambda: h2d.host_to_device([ids], dev), dev, queued, cps)
    t_block, d_block = _host_seconds(lambda: ids.to(dev), dev, queued, cps)
    t_nb, d_nb = _host_seconds(lambda: ids.to(dev, non_blocking=True), dev, queued, cps)
    chk.require("helper_does_not_wait", t_helper < HELPER_MAX * queued,
                f"host_to_device returned in {t_helper * 1e3:.2f} ms with {queued * 1e3:.0f} ms of GPU work queued "
                f"(limit {HELPER_MAX} x)")
    chk.require("control_blocking_copy_waits", t_block > BLOCKING_MIN * queued,
                f".to(device) of pageable memory took {t_block * 1e3:.2f} ms (the control: > {BLOCKING_MIN} x queued)")
    chk.require("copies_equal", all(torch.equal(d.cpu(), ids) for d in (d_helper, d_block, d_nb)),
                "the helper's and the controls' results equal the source")

    # two copies behind queued work, the source changed right after each call: the staging buffer,
    # not the caller's tensor, is what the DMA reads; both buffers are in flight until the work ends
    sync(dev)
    torch.cuda._sleep(int(queued * cps))
    a = ids.clone()
    ra = h2d.host_to_device([a], dev)[0]
    a.add_(1)
    rb = h2d.host_to_device([a], dev)[0]
    pending = h2d.in_flight()
    a.add_(1)
    sync(dev)
    chk.require("source_free_after_call", torch.equal(ra.cpu(), ids) and torch.equal(rb.cpu(), ids + 1),
                "each result holds the source as it was when its call returned")
    chk.require("in_flight_until_complete", pending >= 2, f"{pending} staging buffers in flight behind queued work "
                                                          "(need both)")
    h2d.host_to_device([ids[:1]], dev)
    sync(dev)
    chk.require("released_after_complete", h2d.in_flight() == 1,
                f"{h2d.in_flight()} in flight after the earlier copies completed (need 1: the last call's)")
    return {"queued_s": queued, "host_s": {"host_to_device": t_helper, "to_blocking": t_block,
                                           "to_non_blocking_pageable": t_nb},
            "blocking_over_helper": t_block / max(t_helper, 1e-9)}, chk
