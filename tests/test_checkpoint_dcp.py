"""megak3 <-> torch.distributed.checkpoint (DCP) conversion (megak3/checkpoint/dcp.py): lossless both ways.

A 2-rank per-shard checkpoint (boxes split along different dims, fp32 / bf16 / int64 / 0-dim tensors,
per-rank objects) goes to DCP, where DCP's own ``dcp_to_torch_save`` reads every tensor whole and the
common state, objects and meta as values; back to the per-shard format it holds the same chunks, bit for
bit, and any box reads as before. A trained checkpoint converted there and back resumes with the trainer
to exactly the trained model and optimizer state at the same step. A planted ``.metadata`` pickle is
refused (DCP itself unpickles it with ``pickle.load``).
"""
import contextlib
import io
import pickle
from pathlib import Path

import torch

from megak3.checkpoint import dcp
from megak3.checkpoint.convert import main as convert_main
from megak3.checkpoint.reader import CheckpointReader
from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry


def _two_rank_checkpoint(root: Path) -> Path:
    g = torch.Generator().manual_seed(4)
    w, m = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    b, i = torch.randn(5, generator=g).bfloat16(), torch.arange(10)
    writers = [ShardedCheckpointer(root, r, 2) for r in range(2)]
    for r in (1, 0):  # rank 0 commits once rank 1's files are there
        entries = {"model/w": ShardEntry(w[3 * r:3 * r + 3].clone(), (6, 4), (3 * r, 0)),
                   "optim/w/momentum_buffer": ShardEntry(m[:, 2 * r:2 * r + 2].clone(), (6, 4), (0, 2 * r))}
        if r == 0:
            entries.update({"model/b": ShardEntry(b, (5,), (0,)), "model/i": ShardEntry(i, (10,), (0,)),
                            "model/s": ShardEntry(torch.tensor(0.5), (), ())})
        writers[r].save(7, entries, objects={f"optim_meta/p{r}": {"scalars": {"step": torch.tensor(2.0 + r)}}},
                        common={"step": 7, "rng": {"torch": torch.arange(4, dtype=torch.uint8)}, "seq": (1, 2)}
                        if r == 0 else None, meta={"step": 7, "config": {"a": [1, 2]}} if r == 0 else None)
    return root / "step_00000007"


def _run(*args):
    err = io.StringIO()
    out = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = convert_main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def test_round_trip_is_bitwise_and_dcp_tools_read_it(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = _two_rank_checkpoint(tmp_path / "src")
    rc, out, err = _run("--to-dcp", tmp_path / "src", tmp_path / "dcp")  # a root: its newest checkpoint
    assert rc == 0 and out.strip() == str(tmp_path / "dcp"), err
    a = CheckpointReader(src)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(full) == set(a.keys()) | {dcp.COMMON_KEY, dcp.OBJECTS_KEY, dcp.META_KEY}
    for key in a.keys():
        gs = a.global_shape(key)
        want = a.read(key, (0,) * len(gs), gs)
        assert full[key].dtype == want.dtype and torch.equal(full[key], want), key
    assert full[dcp.META_KEY] == a.meta and full[dcp.COMMON_KEY]["step"] == 7
    assert full[dcp.OBJECTS_KEY].keys() == {"optim_meta/p0", "optim_meta/p1"}

    rc, out, err = _run("--from-dcp", tmp_path / "dcp", tmp_path / "back")
    assert rc == 0 and out.strip() == str(tmp_path / "back" / "step_00000007"), err
    b = CheckpointReader(tmp_path / "back" / "step_00000007")
    assert b.step == a.step == 7 and b.meta == a.meta and b.keys() == a.keys()
    assert b.common["seq"] == (1, 2) and torch.equal(b.common["rng"]["torch"], a.common["rng"]["torch"])
    assert {k: float(v["scalars"]["step"]) for k, v in b.objects().items()} == {"optim_meta/p0": 2.0,
                                                                                "optim_meta/p1": 3.0}
    for key in a.keys():
        boxes = lambda r: sorted((c["offsets"], c["shape"]) for c in r.chunks(key))  # noqa: E731
        assert boxes(b) == boxes(a), key
        gs = a.global_shape(key)
        x, y = a.read(key, (0,) * len(gs), gs), b.read(key, (0,) * len(gs), gs)
        assert x.dtype == y.dtype and torch.equal(x, y), key
    assert torch.equal(b.read("model/w", (1, 1), (4, 2)), a.read("model/w", (0, 0), (6, 4))[1:5, 1:3])

    for args, needle in ((("--to-dcp", tmp_path / "src", tmp_path / "dcp"), "not empty"),
                         (("--from-dcp", tmp_path / "src", tmp_path / "x"), "not a DCP checkpoint"),
                         (("--from-dcp", tmp_path / "dcp", tmp_path / "back"), "already exists"),
                         (("--to-dcp", tmp_path / "nowhere", tmp_path / "y"), "neither a checkpoint")):
        rc, _, err = _run(*args)
        assert rc == 2 and err.count("\n") == 1 and needle in err, err


class _Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def test_planted_dcp_metadata_is_refused(tmp_path):
    _two_rank_checkpoint(tmp_path / "src")
    assert _run("--to-dcp", tmp_path / "src", tmp_path / "dcp")[0] == 0
    marker = tmp_path / "pwned"
    (tmp_path / "dcp" / dcp.METADATA_FILE).write_bytes(pickle.dumps(_Planted(marker)))
    rc, _, err = _run("--from-dcp", tmp_path / "dcp", tmp_path / "back")
    assert rc == 2 and ".metadata" in err and "refused" in err and err.count("\n") == 1, err
    assert not marker.exists()


def test_trainer_resumes_a_checkpoint_converted_there_and_back(corpus_dataset, tmp_path):
    from megak3.train.trainer import Trainer
    from tests.test_train import make_job

    tr = Trainer(make_job(corpus_dataset, tmp_path / "a", max_steps=3, save_interval=3, eval_batches=0),
                 tmp_path / "a")
    tr.fit()
    assert _run("--to-dcp", tmp_path / "a" / "checkpoints", tmp_path / "dcp")[0] == 0
    rc, out, err = _run("--from-dcp", tmp_path / "dcp", tmp_path / "b" / "checkpoints")
    assert rc == 0, err
    again = Trainer(make_job(corpus_dataset, tmp_path / "b", max_steps=3, eval_batches=0, resume=out.strip()),
                    tmp_path / "b")
    assert again.maybe_resume() == Path(out.strip()) and again.step == 3
    for n, t in tr.model.state_dict().items():
        assert torch.equal(t, again.model.state_dict()[n]), n
    want, got = tr.optimizer.export_state(), again.optimizer.export_state()
    assert want["optimizer"] == got["optimizer"] and want["hyperparameters"] == got["hyperparameters"]
    for n, st in want["state"].items():
        assert st.keys() == got["state"][n].keys(), n
        for k, v in st.items():
            assert torch.equal(v, got["state"][n][k]) if torch.is_tensor(v) else v == got["state"][n][k], (n, k)


def test_boxes_through_dcp_planners(tmp_path):
    """save_boxes / load_boxes (the benchmark's DCP side): a sub-box reads back exactly; DCP reads the
    whole saved chunk to narrow it (the bytes tools/bench_checkpoint.py --vs-dcp counts)."""
    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    dcp.save_boxes(tmp_path / "d", {"w": ((6, 4), (0, 0), (6, 4), torch.float32, lambda: w)},
                   {dcp.COMMON_KEY: {"step": 1}})
    out = torch.empty(4, 2)
    objs, reader = dcp.load_boxes(tmp_path / "d", {"w": ((1, 1), out)}, [dcp.COMMON_KEY])
    assert torch.equal(out, w[1:5, 1:3]) and objs == {dcp.COMMON_KEY: {"step": 1}}
    assert reader.bytes_read >= w.numel() * 4 > out.numel() * 4
    assert reader.meta_bytes_read == (tmp_path / "d" / dcp.METADATA_FILE).stat().st_size
