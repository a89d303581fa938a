"""megak3/ops/h2d.py: the packing of a non-blocking host-to-device copy, its CPU path, the lifetime
rule of the pinned staging buffers, and the callers that batch their tensors into one copy.

The CUDA path itself (pinned staging, the host not waiting for queued kernels) is checked on a GPU
by ``tools/gpu_check.py --parts h2d``; that the training step makes no other host-to-device copy is
tests/test_host_syncs.py's H2D rule."""
from __future__ import annotations

import torch

from megak3.ops import h2d
from megak3.ops.h2d import ALIGN, host_to_device, pack, unpack


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(-5, 1000, (3, 7), generator=g),              # int64
            torch.randn(5, 4, generator=g).t(),                         # non-contiguous fp32
            torch.tensor([True, False, True]),                          # bool, 3 bytes
            torch.randint(0, 9, (6,), generator=g, dtype=torch.int32),
            torch.empty(0, 3, dtype=torch.float64),                     # empty
            torch.randn((), generator=g, dtype=torch.float64),          # 0-dim
            torch.randn(9, generator=g).to(torch.bfloat16)]


def test_pack_then_unpack_returns_every_tensor_bit_for_bit():
    src = _tensors()
    buf, slots = pack(src)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert all(o % ALIGN == 0 for o, _, _ in slots)
    assert buf.numel() == sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in src)
    copy = buf.clone()                                  # what arrives on the device: the bytes only
    for t in src:                                       # the sources may change once packed
        t.zero_() if t.dtype != torch.bool else t.fill_(False)
    out = unpack(copy, slots)
    for a, b in zip(out, _tensors()):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        assert a.untyped_storage().data_ptr() == copy.untyped_storage().data_ptr()  # views of one buffer


def test_cpu_path_is_the_identity_and_passes_none_through():
    src = _tensors()
    out = host_to_device([src[0], None, src[1]], "cpu")
    assert out[0] is src[0] and out[1] is None and out[2] is src[1]
    assert host_to_device([], torch.device("cpu")) == []
    assert h2d.in_flight() == 0                         # nothing staged off CUDA


class _Event:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_a_staging_buffer_is_kept_until_its_copy_has_completed(monkeypatch):
    """The lifetime rule: a buffer leaves the in-flight list only once its event reports the copy
    complete (checked without waiting, at the next call)."""
    monkeypatch.setattr(h2d, "_in_flight", [])
    a, b = torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8)
    ea, eb = _Event(), _Event()
    h2d._track(a, ea)
    h2d._track(b, eb)
    assert [x is y for (x, _), y in zip(h2d._in_flight, (a, b))] == [True, True]
    eb.done = True                                      # copies may complete out of list order
    h2d._track(torch.zeros(1, dtype=torch.uint8), _Event())
    assert [x is a for x, _ in h2d._in_flight][:1] == [True] and h2d.in_flight() == 2
    ea.done = True
    h2d._track(torch.zeros(1, dtype=torch.uint8), _Event())
    assert h2d.in_flight() == 2 and all(x is not a and x is not b for x, _ in h2d._in_flight)


def test_step_batches_move_in_one_call_with_the_counts(monkeypatch):
    """train/step.py batches_to_device: every tensor of every micro-batch (images lists included)
    and the step's counts in ONE helper call; cu_seqlens and non-tensors stay as they are."""
    import megak3.train.step as step_mod

    calls = []
    real = step_mod.host_to_device
    monkeypatch.setattr(step_mod, "host_to_device", lambda ts, dev: calls.append(list(ts)) or real(ts, dev))
    img = [torch.randn(3, 4, 4), torch.randn(3, 8, 4)]
    micro = [{"input_ids": torch.arange(6).view(1, 6), "labels": torch.arange(6).view(1, 6),
              "cu_seqlens": torch.tensor([0, 2, 6]), "images": img, "num_images": 2},
             {"input_ids": torch.arange(4).view(1, 4), "labels": torch.arange(4).view(1, 4)}]
    counts = torch.tensor([9.0, 2.0, 0.0], dtype=torch.float64)
    out, (c,) = step_mod.batches_to_device(micro, "cpu", [counts])
    assert len(calls) == 1 and len(calls[0]) == 2 + 2 + 2 + 1
    assert out[0]["cu_seqlens"] is micro[0]["cu_seqlens"] and out[0]["num_images"] == 2
    assert list(out[0]) == list(micro[0]) and isinstance(out[0]["images"], list)
    for a, b in zip(out, micro):
        for k in b:
            if torch.is_tensor(b[k]):
                assert torch.equal(a[k], b[k])
    assert all(torch.equal(x, y) for x, y in zip(out[0]["images"], img)) and torch.equal(c, counts)


def test_seq_info_moves_its_index_tensors_and_extras_in_one_call(monkeypatch):
    from megak3.model import seqinfo

    calls = []
    real = seqinfo.host_to_device
    monkeypatch.setattr(seqinfo, "host_to_device", lambda ts, dev: calls.append(list(ts)) or real(ts, dev))
    host = seqinfo.make_seq_info(2, 8, torch.tensor([0, 3, 8, 16]))
    assert calls == [] and host.cu_seqlens.dtype == torch.int32
    extra = torch.arange(5)
    moved, (e, none) = host.moved("cpu", (extra, None))
    assert len(calls) == 1 and len(calls[0]) == 5
    for name in ("cu_seqlens", "doc_ids_BT", "pos_in_doc_BT", "cu_seqlens_host"):
        assert torch.equal(getattr(moved, name), getattr(host, name))
    assert moved.cu_seqlens_host is host.cu_seqlens_host and torch.equal(e, extra) and none is None
    calls.clear()
    seqinfo.make_seq_info(2, 8, torch.tensor([0, 3, 8, 16]), torch.device("cpu"))
    assert len(calls) == 1
