"""CheckpointReader.read's two copy paths (one preadv per run; one strided copy from a mapping when a
chunk's part is many short runs) give bitwise the tensors of a naive reference reader, which reads
every chunk file whole and assembles the global tensor, for random boxes over random chunk layouts
(seeded): boxes cutting inner dims, empty boxes, 0-dim, bf16 / fp16 / int / bool tensors, every
kind of ``out=``."""
import itertools
import math
import os
import random

import pytest
import torch

from megak3.checkpoint import reader as reader_mod
from megak3.checkpoint.reader import CheckpointReader
from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry

torch.set_num_threads(1)
WORLD = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _random_tensor(rng: random.Random, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-2 ** 62, 2 ** 62, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def _grid(rng: random.Random, shape):
    """Random boxes tiling ``shape``: each dim cut into 1-3 pieces, at most WORLD boxes in all."""
    while True:
        cuts = []
        for n in shape:
            k = rng.randint(1, min(3, n))
            b = sorted(rng.sample(range(1, n), k - 1)) if k > 1 else []
            cuts.append(list(zip([0] + b, [x - y for x, y in zip(b + [n], [0] + b)])))
        if math.prod(len(c) for c in cuts) <= WORLD:
            return [tuple(zip(*p)) if p else ((), ()) for p in itertools.product(*cuts)]


def _save(root, rng: random.Random) -> dict:
    """A checkpoint of WORLD simulated ranks: a 64 x 100 fp32 key first in every .bin (so later chunks lie
    past a page: their mappings start at a nonzero aligned offset), then 12 random keys of 0-4 dims,
    each cut into a random grid whose boxes go to random distinct ranks (a 0-dim or replicated key
    from several ranks at once)."""
    full = {"model/big": _random_tensor(rng, (64, 100), torch.float32)}
    for i in range(12):
        nd = 0 if i == 0 else rng.randint(1, 4)
        full[f"model/k{i:02d}"] = _random_tensor(rng, tuple(rng.randint(1, 9) for _ in range(nd)),
                                                 DTYPES[i % len(DTYPES)])
    per_rank = [{} for _ in range(WORLD)]
    for key, t in full.items():
        boxes = _grid(rng, t.shape) if key != "model/k03" else [((0,) * t.ndim, tuple(t.shape))] * 3
        for rank, (off, shp) in zip(rng.sample(range(WORLD), len(boxes)), boxes):
            sl = tuple(slice(o, o + s) for o, s in zip(off, shp))
            per_rank[rank][key] = ShardEntry(t[sl].clone(), tuple(t.shape), tuple(off))
    cps = [ShardedCheckpointer(root, r, WORLD) for r in range(WORLD)]
    for r in reversed(range(WORLD)):  # rank 0 last: its save commits
        cps[r].save(1, per_rank[r], common={"step": 1} if r == 0 else None)
    return full


def _naive_global(reader: CheckpointReader, key: str) -> torch.Tensor:
    """The reference: every chunk of ``key`` read whole with a plain file read, placed in the global tensor."""
    dtype, shape = reader.dtype(key), reader.global_shape(key)
    out = torch.empty(shape, dtype=dtype)
    for c in reader.chunks(key):
        with open(reader.path / c["file"], "rb") as f:
            f.seek(c["byte_offset"])
            data = bytearray(f.read(c["nbytes"]))
        chunk = torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(c["shape"]) if data else \
            torch.empty(c["shape"], dtype=dtype)
        out[tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["shape"]))] = chunk
    return out


def _random_box(rng: random.Random, shape):
    if rng.random() < 0.05:  # an empty box
        lo = [rng.randrange(n + 1) for n in shape]
        return tuple(lo), tuple(0 if j == 0 else n - lo[j] for j, n in enumerate(shape))
    lo = [rng.randrange(n) for n in shape]
    return tuple(lo), tuple(rng.randint(1, n - o) for o, n in zip(lo, shape))


@pytest.mark.parametrize("mapped_run_bytes", [0, reader_mod._MAPPED_RUN_BYTES, 1 << 40],
                         ids=["preadv-only", "default", "mapped-whenever-several-runs"])
def test_read_paths_equal_a_naive_reader_on_random_boxes(tmp_path, monkeypatch, mapped_run_bytes):
    monkeypatch.setattr(reader_mod, "_MAPPED_RUN_BYTES", mapped_run_bytes)
    mapped = []  # the chunk byte offsets of the parts copied from a mapping
    real = reader_mod.CheckpointReader._copy_mapped
    monkeypatch.setattr(reader_mod.CheckpointReader, "_copy_mapped",
                        lambda self, key, fd, ch, *a: mapped.append(ch[3]) or real(self, key, fd, ch, *a))
    rng = random.Random(37)
    full = _save(tmp_path, rng)
    with CheckpointReader(tmp_path / "step_00000001") as r:
        for key, t in full.items():
            ref = _naive_global(r, key)
            assert ref.dtype == t.dtype and torch.equal(_bits(ref), _bits(t)), key
            boxes = [_random_box(rng, t.shape) for _ in range(12)]
            boxes += [((0,) * t.ndim, tuple(t.shape))]  # whole tensor: every chunk whole, crc checked
            if t.ndim >= 2:  # a column block: every row cut, the bench's resharded case
                boxes += [((0,) * (t.ndim - 1) + (t.shape[-1] // 2,), tuple(t.shape[:-1]) + (1,))]
            for i, (off, shp) in enumerate(boxes):
                want = ref[tuple(slice(o, o + s) for o, s in zip(off, shp))]
                before = r.bytes_read
                mode = i % 4
                if mode == 0:
                    got = r.read(key, off, shp)
                elif mode == 1:  # out: contiguous, same dtype: written in place
                    out = torch.full(shp, 1, dtype=t.dtype)
                    got = r.read(key, off, shp, out=out)
                    assert got is out
                elif mode == 2:  # out: not contiguous
                    out = torch.zeros(tuple(reversed(shp)), dtype=t.dtype).permute(tuple(reversed(range(len(shp)))))
                    got = r.read(key, off, shp, out=out)
                    assert got is out
                else:  # out: another dtype (cast on copy)
                    out = torch.zeros(shp, dtype=torch.float64)
                    got = r.read(key, off, shp, out=out)
                    want = want.to(torch.float64)
                assert tuple(got.shape) == tuple(shp) and got.dtype == want.dtype, (key, off, shp)
                assert torch.equal(_bits(got), _bits(want)), (key, off, shp, mode)
                assert r.bytes_read - before == math.prod(shp) * t.element_size(), (key, off, shp)
    # both paths ran (the default takes the mapped one for these small rows), mappings past a page included
    assert (len(mapped) > 50 and max(mapped) > 4096) if mapped_run_bytes else not mapped, mapped


def test_column_block_of_a_wide_chunk_is_one_mapped_copy(tmp_path, monkeypatch):
    """The bench's resharded case (rows saved, a column block read) takes the mapped path: no preadv."""
    a = torch.randn(256, 64)
    cp = ShardedCheckpointer(tmp_path, 0, 1)
    cp.save(1, {"model/a": ShardEntry(a, (256, 64), (0, 0))}, common={"step": 1})
    calls = []
    real = reader_mod.os.preadv
    monkeypatch.setattr(reader_mod.os, "preadv", lambda *a: calls.append(1) or real(*a))
    with CheckpointReader(tmp_path / "step_00000001") as r:
        assert torch.equal(r.read("model/a", (0, 16), (256, 16)), a[:, 16:32]) and not calls
        assert torch.equal(r.read("model/a", (0, 0), (256, 64)), a) and len(calls) == 1  # whole chunk: one read


def test_file_truncated_after_opening_is_an_error_on_both_paths(tmp_path):
    """A payload file cut short after the reader checked its size: CheckpointError, not a crash (SIGBUS)."""
    from megak3.checkpoint.atomic import CheckpointError

    a = torch.randn(256, 64)
    ShardedCheckpointer(tmp_path, 0, 1).save(1, {"model/a": ShardEntry(a, (256, 64), (0, 0))}, common={"step": 1})
    path = tmp_path / "step_00000001"
    with CheckpointReader(path) as r:
        assert torch.equal(r.read("model/a", (0, 0), (1, 64)), a[:1])  # opens (and size-checks) the file
        os.truncate(path / r.chunks("model/a")[0]["file"], 128 * 64 * 4)
        with pytest.raises(CheckpointError, match="cannot map shard_00000.bin to read 'model/a'"):
            r.read("model/a", (0, 16), (256, 16))  # the mapped path
        with pytest.raises(CheckpointError, match="short read of 'model/a'"):
            r.read("model/a", (200, 0), (56, 64))  # the preadv path
