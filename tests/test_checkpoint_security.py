"""Checkpoints are data, never code: a checkpoint whose pickles were replaced (manifest sizes and
hashes updated to match, so every integrity check passes) is refused on resume with one line naming
the file, and the planted code never runs. Everything megak3 writes loads with ``weights_only=True``."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megak3.checkpoint.atomic import CheckpointError
from megak3.checkpoint.reader import CheckpointReader
from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry
from tests.conftest import SMALL_MODEL

ROOT = Path(__file__).resolve().parents[1]


class _Planted:
    """Unpickling this runs ``os.system`` (what an attacker would plant)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(ckpt_dir: Path, name: str, marker: Path) -> None:
    """Replace ``name`` with a malicious pickle and fix the manifest so size and sha256 match."""
    torch.save({"payload": _Planted(marker)}, ckpt_dir / name)
    data = (ckpt_dir / name).read_bytes()
    mpath = ckpt_dir / "manifest.json"
    manifest = json.loads(mpath.read_text())

    def fix(entry, blob):
        entry["bytes"] = len(blob)
        if "sha256" in entry:
            entry["sha256"] = hashlib.sha256(blob).hexdigest()

    if name in manifest["files"]:
        fix(manifest["files"][name], data)
    else:  # a per-rank file: listed in an objects part, whose sha256 is in index.json (hash chain)
        index = json.loads((ckpt_dir / "index.json").read_text())
        for i, ref in enumerate(index["object_parts"]):
            part_path = ckpt_dir / f"objects_{i:05d}.json"
            part = json.loads(part_path.read_text())
            if name in part["files"]:
                fix(part["files"][name], data)
                blob = json.dumps(part).encode()
                part_path.write_bytes(blob)
                ref[1] = hashlib.sha256(blob).hexdigest()
                fix(manifest["files"][part_path.name], blob)
        blob = json.dumps(index).encode()
        (ckpt_dir / "index.json").write_bytes(blob)
        fix(manifest["files"]["index.json"], blob)
    mpath.write_text(json.dumps(manifest))


def _save(root: Path) -> Path:
    cp = ShardedCheckpointer(root, 0, 1)
    full = torch.arange(12.0).reshape(3, 4)
    cp.save(3, {"model/w": ShardEntry(full.clone(), (3, 4), (0, 0))},
            objects={"optim_meta": {"w": {"scalars": {"step": 3}}}}, common={"step": 3}, meta={})
    cp.wait()
    return root / "step_00000003"


@pytest.mark.parametrize("victim", ["state.pt", "objects"])
def test_planted_pickle_is_refused_and_never_runs(tmp_path, victim):
    path = _save(tmp_path / "ckpt")
    name = victim if victim == "state.pt" else next(p.name for p in path.iterdir() if p.name.endswith(".obj.pt"))
    marker = tmp_path / "pwned"
    _plant(path, name, marker)
    with pytest.raises(CheckpointError) as err:
        reader = CheckpointReader(path)
        reader.objects()
    msg = str(err.value)
    assert name in msg and "\n" not in msg, msg
    assert not marker.exists()


def test_clean_checkpoint_reads_with_the_safe_loader(tmp_path):
    path = _save(tmp_path / "ckpt")
    reader = CheckpointReader(path)
    assert reader.common == {"step": 3}
    assert reader.objects() == {"optim_meta": {"w": {"scalars": {"step": 3}}}}
    torch.testing.assert_close(reader.read("model/w", (0, 0), (3, 4)), torch.arange(12.0).reshape(3, 4))


def test_resume_from_planted_checkpoint_is_one_line(corpus_dataset, tmp_path):
    """The user-facing path: ``train.resume=auto`` on a run whose latest checkpoint was tampered with."""
    prefix, tok = corpus_dataset
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    common = [f"data.path={prefix}", f"data.tokenizer={tok}", "data.seq_len=64", "data.valid_fraction=0.1",
              f"train.run_dir={tmp_path}/run", "train.global_batch_size=2", "train.micro_batch_size=2",
              "train.eval_batches=0", "optim.warmup_steps=1", "logging.progress_bar=false",
              f"hydra.run.dir={tmp_path}/hydra"] + [f"model.{k}={v}" for k, v in SMALL_MODEL.items()]

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "megak3.train", *common, *extra], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    r = run("train.max_steps=2")
    assert r.returncode == 0, r.stderr[-2000:]
    path = tmp_path / "run" / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"
    _plant(path, "state.pt", marker)
    r = run("train.max_steps=4", "train.resume=auto")
    assert not marker.exists(), "the planted code ran"
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "state.pt" in lines[0] and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_saving_an_unsafe_object_is_refused_before_writing(tmp_path):
    cp = ShardedCheckpointer(tmp_path / "ckpt", 0, 1)
    with pytest.raises(ValueError, match="weights_only"):
        cp.save(1, {"model/w": ShardEntry(torch.ones(2), (2,), (0,))}, common={"bad": _Planted(tmp_path / "x")})
    assert not (tmp_path / "x").exists() and not list((tmp_path / "ckpt").glob("step_*"))
