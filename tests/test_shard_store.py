"""Per-shard checkpoints (megak3.checkpoint.writer / reader): resharding reads, atomic commit, corruption,
non-finite refusal, async saves, old-format detection and conversion. Ranks are simulated by several
ShardedCheckpointer objects in one process (rank 0 saves last: its sync save waits for the markers)."""
import contextlib
import importlib.util
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from megak3.checkpoint import atomic, legacy
from megak3.checkpoint.atomic import CheckpointError, CheckpointWarning, find_latest, validate_checkpoint
from megak3.checkpoint.reader import CheckpointReader
from megak3.checkpoint.train_state import capture_rng_state
from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry
from parallel.data_parallel import CANONICAL_FORMAT

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def _entry(full: torch.Tensor, offsets, shape) -> ShardEntry:
    sl = tuple(slice(o, o + s) for o, s in zip(offsets, shape))
    return ShardEntry(full[sl].clone(), tuple(full.shape), tuple(offsets))


def _splits(n: int, k: int):
    """(start, size) of k near-equal pieces of n."""
    b = np.linspace(0, n, k + 1).round().astype(int)
    return [(int(b[i]), int(b[i + 1] - b[i])) for i in range(k)]


def _boxes_along(shape, dim, k):
    return [(tuple(s if d == dim else 0 for d in range(len(shape))),
             tuple(n if d == dim else shape[d] for d in range(len(shape)))) for s, n in _splits(shape[dim], k)]


def _save_ranks(root, step, per_rank, objects=None, common=None, meta=None, **kw):
    world = len(per_rank)
    cps = [ShardedCheckpointer(root, r, world, **kw) for r in range(world)]
    for r in reversed(range(world)):
        cps[r].save(step, per_rank[r], objects=(objects or {}).get(r),
                    common=common if r == 0 else None, meta=meta if r == 0 else None)
    return cps


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of t's bits (bool as uint8), for bitwise comparisons."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _check_read(reader, key, full, offsets, shape):
    before = reader.bytes_read
    got = reader.read(key, offsets, shape)
    want = full[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]
    assert got.dtype == full.dtype and tuple(got.shape) == tuple(shape)
    assert torch.equal(_bits(got), _bits(want)), (key, offsets, shape)
    assert reader.bytes_read - before == math.prod(shape) * full.element_size(), (key, offsets, shape)


def test_resharding_round_trip_reads_only_the_box(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(12, 10, generator=g)                             # 2x2 grid of boxes, one per rank
    b = torch.randn(8, 6, 4, generator=g).to(torch.bfloat16)         # split along dim 0 by 4
    bias = torch.randn(7, generator=g)                               # replicated: every rank passes it
    scalar = torch.tensor(3.5)
    per_rank = []
    for r in range(4):
        i, j = divmod(r, 2)
        per_rank.append({"model/a": _entry(a, (6 * i, 5 * j), (6, 5)), "model/b": _entry(b, (2 * r, 0, 0), (2, 6, 4)),
                         "model/bias": _entry(bias, (0,), (7,))})
    per_rank[0]["optim/a/step"] = ShardEntry(scalar, (), ())
    objects = {r: {"shared": r, f"only_{r}": r} for r in range(4)}
    _save_ranks(tmp_path, 5, per_rank, objects=objects, common={"step": 5, "pos": [1, 2]}, meta={"run": "x"})
    path = find_latest(tmp_path)
    assert path == tmp_path / "step_00000005" and validate_checkpoint(path) == (True, "ok")

    r = CheckpointReader(path)
    assert r.step == 5 and r.common == {"step": 5, "pos": [1, 2]} and r.meta == {"run": "x"}
    assert r.keys() == ["model/a", "model/b", "model/bias", "optim/a/step"]
    assert r.global_shape("model/b") == (8, 6, 4) and r.dtype("model/b") == torch.bfloat16
    assert r.objects() == {"shared": 0, **{f"only_{k}": k for k in range(4)}}  # lower ranks win
    assert r.meta_bytes_read > 0 and r.bytes_read == 0
    for key, full in (("model/a", a), ("model/b", b)):
        layouts = [_boxes_along(full.shape, 1, 3), _boxes_along(full.shape, 0, 8), [((0,) * full.ndim, full.shape)]]
        for boxes in layouts:
            for offsets, shape in boxes:
                _check_read(r, key, full, offsets, shape)
    _check_read(r, "model/a", a, (5, 3), (3, 6))        # odd box across all four chunks
    _check_read(r, "model/b", b, (1, 2, 1), (4, 3, 2))  # odd box, no dim spanned fully
    _check_read(r, "model/bias", bias, (0,), (7,))      # 4 identical replicas: one chunk read
    _check_read(r, "model/bias", bias, (2,), (3,))
    _check_read(r, "optim/a/step", scalar, (), ())
    out = torch.zeros(3, 6, dtype=torch.float64)          # out: cast on copy
    assert r.read("model/a", (5, 3), (3, 6), out=out) is out and torch.equal(out, a[5:8, 3:9].double())
    with pytest.raises(CheckpointError, match="nope"):
        r.read("nope", (0,), (1,))
    with pytest.raises(ValueError, match="inside global_shape"):
        r.read("model/a", (10, 0), (3, 10))
    r.close()


def test_dtypes_round_trip_bit_exactly(tmp_path):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 5, generator=g) * torch.tensor([1e-40, -0.0, 1.0, 1e37, 1e-8])  # subnormals, -0
    tensors = {"float32": x, "bfloat16": x.to(torch.bfloat16),
               "float16": (torch.randn(6, 5, generator=g) * torch.tensor([1e-6, -0.0, 1.0, 1e4, 1e-3])).half(),
               "int64": torch.randint(-2**62, 2**62, (6, 5), generator=g),
               "int32": torch.randint(-2**31, 2**31 - 1, (6, 5), generator=g, dtype=torch.int32),
               "bool": torch.rand(6, 5, generator=g) > 0.5}
    per_rank = [{k: _entry(t, (3 * r, 0), (3, 5)) for k, t in tensors.items()} for r in range(2)]
    _save_ranks(tmp_path, 1, per_rank)
    r = CheckpointReader(tmp_path / "step_00000001")
    for k, t in tensors.items():
        assert r.dtype(k) == t.dtype
        _check_read(r, k, t, (0, 0), (6, 5))
        _check_read(r, k, t, (2, 1), (2, 3))


def test_uncovered_box_and_overlapping_boxes(tmp_path):
    a = torch.arange(24.).view(6, 4)
    _save_ranks(tmp_path / "gap", 1, [{"model/a": _entry(a, (0, 0), (3, 4))}, {}])  # rank 1 saves nothing
    r = CheckpointReader(tmp_path / "gap" / "step_00000001")
    _check_read(r, "model/a", a, (1, 0), (2, 4))
    with pytest.raises(CheckpointError, match="'model/a' cover 12 of the 24"):
        r.read("model/a", (0, 0), (6, 4))
    with pytest.raises(CheckpointError, match="overlap without being identical"):
        _save_ranks(tmp_path / "overlap", 1, [{"model/a": _entry(a, (0, 0), (4, 4))},
                                              {"model/a": _entry(a, (2, 0), (4, 4))}])
    assert find_latest(tmp_path / "overlap") is None


def test_failed_commit_keeps_latest_and_corruption_is_caught(tmp_path):
    a = torch.arange(40.).view(8, 5)
    per_rank = [{"model/a": _entry(a, (4 * r, 0), (4, 5))} for r in range(2)]
    _save_ranks(tmp_path, 10, per_rank)
    first = tmp_path / "step_00000010"
    # step 20: rank 1 never writes its marker
    with pytest.raises(CheckpointError, match=r"step 20: no marker from rank\(s\) 1 "):
        ShardedCheckpointer(tmp_path, 0, 2, commit_timeout_s=0.2).save(20, per_rank[0], common={})
    assert (tmp_path / "latest").read_text().strip() == "step_00000010"
    assert (tmp_path / ".tmp-step_00000020").is_dir() and find_latest(tmp_path) == first

    b = a * 2
    _save_ranks(tmp_path, 30, [{"model/a": _entry(b, (4 * r, 0), (4, 5))} for r in range(2)])
    assert not (tmp_path / ".tmp-step_00000020").exists()  # rank 0 removed the stale staging dir
    newest = find_latest(tmp_path)
    assert newest == tmp_path / "step_00000030"
    # the big .bin files are not hashed (size only); the small files are
    bin1 = newest / "shard_00001.bin"
    data = bytearray(bin1.read_bytes())
    data[7] ^= 0x40  # inside rank 1's chunk, element 1
    bin1.write_bytes(bytes(data))
    assert validate_checkpoint(newest, verify_checksums=True) == (True, "ok")
    r = CheckpointReader(newest)
    _check_read(r, "model/a", b, (0, 0), (4, 5))                 # rank 0's chunk: fine
    with pytest.raises(CheckpointError, match="'model/a' in shard_00001.bin fails its crc32"):
        r.read("model/a", (4, 0), (4, 5))
    with pytest.raises(CheckpointError, match="crc32"):
        r.read("model/a", (0, 0), (8, 5))
    assert not torch.equal(r.read("model/a", (4, 0), (1, 5)), b[4:5])  # partial reads are not verified
    r.close()
    # a truncated payload file (listed in its index part, not in the manifest, which would grow with
    # the world size) is refused by the reader when it opens the file, and by verify()
    bin0 = newest / "shard_00000.bin"
    bin0.write_bytes(bin0.read_bytes()[:-4])
    r = CheckpointReader(newest)
    with pytest.raises(CheckpointError, match="shard_00000.bin has 76 bytes, the index says 80 .truncated"):
        r.read("model/a", (0, 0), (1, 5))
    with pytest.raises(CheckpointError, match="truncated"):
        r.verify()
    r.close()
    # truncation of a manifest-listed file: the checkpoint no longer validates; find_latest falls back
    part = newest / "index_00000.json"
    part.write_bytes(part.read_bytes()[:-4])
    ok, why = validate_checkpoint(newest)
    assert not ok and "truncated" in why
    with pytest.warns(CheckpointWarning, match="step_00000030"):
        assert find_latest(tmp_path) == first
    with pytest.raises(CheckpointError, match="truncated"):
        CheckpointReader(newest)
    # a corrupt small file fails the sha256 check
    idx = first / "index.json"
    idx.write_text(idx.read_text().replace('"world_size": 2', '"world_size": 3'))
    ok, why = validate_checkpoint(first)
    assert not ok and "sha256" in why


def test_stale_marker_of_an_earlier_attempt_is_not_committed(tmp_path):
    a = torch.arange(8.)
    cp0 = ShardedCheckpointer(tmp_path, 0, 2, commit_timeout_s=0.2)
    cp1 = ShardedCheckpointer(tmp_path, 1, 2)
    e = [{"model/a": _entry(a, (0,), (4,))}, {"model/a": _entry(a, (4,), (4,))}]
    with pytest.raises(CheckpointError, match=r"rank\(s\) 1 "):
        cp0.save(40, e[0])        # attempt 1: rank 1 is late...
    cp1.save(40, e[1])            # ...and writes attempt 1's marker after rank 0 gave up
    with pytest.raises(CheckpointError, match="another save attempt"):
        cp0.save(40, e[0])        # attempt 2 on rank 0 must not take attempt 1's marker
    assert find_latest(tmp_path) is None
    cp1.save(40, e[1])            # attempt 2 on rank 1: now rank 0's attempt 3 waits for a seq-3 marker
    cp1.save(40, e[1])
    cp0.save(40, e[0])
    r = CheckpointReader(find_latest(tmp_path))
    _check_read(r, "model/a", a, (0,), (8,))


def test_keep_last_and_same_step_replaces(tmp_path):
    a = torch.arange(6.)
    for step, scale in ((1, 1.0), (2, 2.0), (2, 3.0), (3, 4.0)):
        _save_ranks(tmp_path, step, [{"model/a": ShardEntry(a * scale, (6,), (0,))}], keep_last=2)
    assert [p.name for p in atomic.list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    r = CheckpointReader(tmp_path / "step_00000002")
    assert torch.equal(r.read("model/a", (0,), (6,)), a * 3.0)


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_non_finite_values_are_refused(tmp_path, rank, async_save):
    ok = torch.ones(3)
    for bad in (torch.tensor([1.0, float("nan")]), torch.tensor([float("-inf")], dtype=torch.bfloat16)):
        cp = ShardedCheckpointer(tmp_path, rank, 2, async_save=async_save)
        with pytest.raises(CheckpointError, match=r"^checkpoint step 5: model/xxx holds non-finite values; not saved$"):
            cp.save(5, {"model/a": ShardEntry(ok, (3,), (0,)), "model/xxx": ShardEntry(bad, tuple(bad.shape), (0,))})
            cp.wait()  # async: the writer checks the host copies before writing and wait() re-raises
    # nothing written for step 5 (async: at most the empty staging directory is absent too)
    assert not any(p.name.startswith("step_") or p.name == "latest" for p in tmp_path.iterdir())
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_finite_values_whose_sum_overflows_are_saved(tmp_path):
    """The finiteness check's fast path (a finite sum) falls back to the element check when the sum
    overflows: such a tensor is saved; one NaN / inf among many finite values is still refused."""
    big = {"model/f32": torch.full((5,), 3e38), "model/bf16": torch.full((4, 3), 3e38, dtype=torch.bfloat16),
           "model/f16": torch.full((7,), 6e4, dtype=torch.float16)}
    ShardedCheckpointer(tmp_path / "ok", 0, 1).save(1, {k: ShardEntry(t, tuple(t.shape), (0,) * t.ndim)
                                                          for k, t in big.items()})
    with CheckpointReader(tmp_path / "ok" / "step_00000001") as r:
        for k, t in big.items():
            assert torch.equal(r.read(k, (0,) * t.ndim, tuple(t.shape)), t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
        t[617] = bad
        with pytest.raises(CheckpointError, match="model/x holds non-finite values"):
            ShardedCheckpointer(tmp_path / "bad", 0, 1).save(1, {"model/x": ShardEntry(t, (1000,), (0,))})


def test_every_file_is_fsynced_before_the_commit_renames_it(tmp_path, monkeypatch):
    """The commit writes its files first and fsyncs them together (atomic.fsync_files): at the rename
    every file of the staging dir, and the dir itself, has been fsynced."""
    synced, checked = set(), []
    real_fsync, real_publish = atomic._fsync_path, atomic.publish

    def fsync(path):
        real_fsync(path)
        synced.add(Path(path).resolve())

    def publish(root, tmp, name, keep_last):
        files = [p.resolve() for p in Path(tmp).iterdir()]
        assert files and Path(tmp).resolve() in synced
        assert not [p.name for p in files if p not in synced]
        checked.append(len(files))
        return real_publish(root, tmp, name, keep_last)

    monkeypatch.setattr(atomic, "_fsync_path", fsync)
    monkeypatch.setattr(atomic, "publish", publish)
    a = torch.arange(12.).view(3, 4)
    per_rank = [{"model/a": _entry(a, (0, 0), (2, 4)), "model/b": _entry(a, (0, 0), (3, 4))},
                {"model/a": _entry(a, (2, 0), (1, 4))}]
    _save_ranks(tmp_path, 1, per_rank, objects={1: {"x": 1}}, common={"step": 1})
    assert checked == [9]  # state, 2 payloads, 1 objects file, 2 index parts, 1 objects part, index, manifest
    assert torch.equal(CheckpointReader(tmp_path / "step_00000001").read("model/a", (0, 0), (3, 4)), a)


def test_async_save_snapshots_then_writes_in_background(tmp_path):
    a = torch.arange(20.).view(4, 5)
    src = [a[:2].clone(), a[2:].clone()]
    gate = threading.Event()
    cps = [ShardedCheckpointer(tmp_path, r, 2, async_save=True) for r in range(2)]
    for cp in cps:
        cp._before_write = lambda: gate.wait(10)
    for r, cp in enumerate(cps):
        cp.save(3, {"model/a": ShardEntry(src[r], (4, 5), (2 * r, 0))}, objects={"r": r},
                common={"step": 3} if r == 0 else None)
    for t in src:
        t.fill_(-1.0)  # after save() returned: must not reach the checkpoint
    assert all(cp._thread.is_alive() for cp in cps)
    assert not (tmp_path / ".tmp-step_00000003" / "shard_00000.json").exists()
    gate.set()
    for cp in cps:
        cp.wait()
    assert cps[0].last_save_stats["bytes"] > 40 and cps[1].last_save_stats["commit_s"] == 0.0
    r = CheckpointReader(find_latest(tmp_path))
    _check_read(r, "model/a", a, (0, 0), (4, 5))
    assert r.common == {"step": 3} and r.objects() == {"r": 0}
    # back-to-back saves: the second waits for the first
    for step in (4, 5):
        for r_, cp in enumerate(cps):
            cp._before_write = None
            cp.save(step, {"model/a": ShardEntry(a[2 * r_:2 * r_ + 2] * step, (4, 5), (2 * r_, 0))})
    for cp in cps:
        cp.wait()
    assert find_latest(tmp_path).name == "step_00000005"
    assert torch.equal(CheckpointReader(tmp_path / "step_00000004").read("model/a", (0, 0), (4, 5)), a * 4)
    # a background error is re-raised by wait(), once
    lone = ShardedCheckpointer(tmp_path, 0, 2, async_save=True, commit_timeout_s=0.1)
    lone.save(6, {})
    with pytest.raises(CheckpointError, match=r"rank\(s\) 1 "):
        lone.wait()
    lone.wait()
    assert find_latest(tmp_path).name == "step_00000005"


# ------------------------------------------------------------------------------- old format

def _old_checkpoint(root: Path):
    """A 2-rank (tp=2) checkpoint in the old per-rank part format, and the full tensors it holds."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(6, 4, generator=g), torch.randn(4, generator=g)
    mom, ea, eas = torch.randn(6, 4, generator=g), torch.randn(4, generator=g), torch.rand(4, generator=g)
    tags = legacy.make_tags(["w", "b"], {"w": 0, "b": None}, 2)
    hp = {"w": {"lr": 0.02, "momentum": 0.95}, "b": {"lr": 1e-3, "betas": (0.9, 0.95)}}
    staging = legacy.prepare_staging(root, 7)
    parts = {}
    for r in range(2):
        optim = {"format": CANONICAL_FORMAT, "optimizer": {"w": "muon", "b": "adamw"}, "hyperparameters": hp,
                 "state": {"w": {"momentum_buffer": mom.chunk(2)[r].clone()},
                           "b": {"exp_avg": ea, "exp_avg_sq": eas, "step": torch.tensor(3.0)}}}
        coords = {"tp": (r, 2), "ep": (0, 1), "pp": (0, 1), "dp": (0, 1), "edp": (0, 1)}
        part = legacy.build_part(coords, tags, {"w": w.chunk(2)[r].clone(), "b": b}, optim)
        parts[f"rank_{r:05d}.pt"] = legacy.write_part(staging, f"rank_{r:05d}.pt", part)
    common = {"step": 7, "train_data": {"epoch": 0, "pos": 11}, "rng": capture_rng_state(), "world_size": 2,
              "layout": {"tp": 2, "dp": 1, "ep": 1, "pp": 1, "sequence_parallel": False}}
    meta = {"step": 7, "dataset": "x", "config": {"model": {"dim": 4}}}
    path = legacy.commit_checkpoint(root, 7, staging, common, parts=parts, meta=meta)
    return path, {"model/w": w, "model/b": b, "optim/w/momentum_buffer": mom, "optim/b/exp_avg": ea,
                  "optim/b/exp_avg_sq": eas}, common, meta, hp


def test_old_format_error_line_and_converter(tmp_path):
    old, tensors, common, meta, hp = _old_checkpoint(tmp_path / "old")
    with pytest.raises(CheckpointError) as ei:
        CheckpointReader(old)
    assert str(ei.value) == (f"checkpoint {old} is in the old per-rank part format; convert it with: "
                             f"python tools/convert_checkpoint.py {old} <out_root>")
    out_root = tmp_path / "new"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), str(old), str(out_root)],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out_root / "step_00000007")
    r = CheckpointReader(find_latest(out_root))
    assert r.step == 7 and r.meta == meta
    assert r.keys() == sorted(tensors)
    for key, t in tensors.items():
        assert r.global_shape(key) == tuple(t.shape)
        _check_read(r, key, t, (0,) * t.ndim, tuple(t.shape))
    _check_read(r, "model/w", tensors["model/w"], (1, 1), (4, 2))  # any layout reads the converted one
    om = r.objects()["optim_meta"]
    assert om["w"] == {"optimizer": "muon", "hyperparameters": hp["w"], "scalars": {}}
    assert om["b"]["optimizer"] == "adamw" and om["b"]["hyperparameters"] == hp["b"]
    assert list(om["b"]["scalars"]) == ["step"] and torch.equal(om["b"]["scalars"]["step"], torch.tensor(3.0))
    assert r.common.keys() == common.keys() and r.common["train_data"] == common["train_data"]
    assert r.common["layout"] == common["layout"] and torch.equal(r.common["rng"]["torch"], common["rng"]["torch"])

    # errors: one line on stderr, exit 2 (in-process: a second interpreter start is slow)
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for args, msg in (([str(old), str(out_root)], "already exists"),
                      ([str(out_root / "step_00000007"), str(tmp_path / "x")], "already in the megak3.shards.v1"),
                      ([str(tmp_path / "nowhere"), str(tmp_path / "x")], "neither a checkpoint")):
        err = tmp_path / "err.txt"
        with open(err, "w") as f, contextlib.redirect_stderr(f):
            assert tool.main(args) == 2
        text = err.read_text()
        assert text.count("\n") == 1 and msg in text, text


def test_objects_by_key_read_only_the_files_that_hold_them(tmp_path):
    """The index maps object keys to rank files: asking for some keys opens only those files."""
    per_rank = [{"model/a": ShardEntry(torch.full((2, 3), float(r)), (8, 3), (2 * r, 0))} for r in range(4)]
    objects = {r: {f"only_{r}": r, "shared": r} for r in range(4)}
    _save_ranks(tmp_path, 2, per_rank, objects=objects)
    everything = CheckpointReader(tmp_path / "step_00000002")
    assert everything.objects() == {"shared": 0, **{f"only_{k}": k for k in range(4)}}
    one = CheckpointReader(tmp_path / "step_00000002")
    base = one.meta_bytes_read
    assert one.objects(["only_2"]) == {"only_2": 2}
    obj_bytes = (tmp_path / "step_00000002" / "shard_00002.obj.pt").stat().st_size
    part_bytes = (tmp_path / "step_00000002" / "objects_00000.json").stat().st_size
    assert one.meta_bytes_read - base == part_bytes + obj_bytes  # the key's index part + rank 2's file only
    assert one.objects(["shared", "missing"]) == {"shared": 0}
