"""The training program under torchrun: a tp2 x dp2 (+SP) run equals one process, and its
layout-free checkpoint resumes at another layout (tp1 x dp4) with the same losses (one process and other
layouts: tests/test_checkpoint_reshard.py)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.testing import PARITY_MODEL as MODEL

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(run_dir, nproc, *args):
    prefix, tok = _run.corpus
    common = [f"data.path={prefix}", f"data.tokenizer={tok}", "data.seq_len=32", "data.valid_fraction=0.1",
              f"train.run_dir={run_dir}", "train.global_batch_size=4", "train.micro_batch_size=1",
              "train.eval_batches=1", "train.eval_interval=0", "train.save_interval=2", "train.seed=3",
              "optim.warmup_steps=1", "optim.lr=1e-3", "optim.ns_dtype=float32", "logging.progress_bar=false",
              "logging.wandb=false", f"hydra.run.dir={run_dir}/hydra"]
    common += [f"model.{k}={v}" for k, v in MODEL.items()]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if nproc == 1:
        cmd = [sys.executable, "-m", "megak3.train"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "megak3.train"]
    r = subprocess.run(cmd + common + list(args), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return r


def _losses(run_dir):
    lines = [json.loads(l) for l in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {l["step"]: l["loss"] for l in lines if l.get("kind") == "train"}


def test_layouts_and_cross_layout_resume(corpus_dataset, tmp_path):
    _run.corpus = corpus_dataset
    ref = tmp_path / "single"
    _run(ref, 1, "train.max_steps=4")
    want = _losses(ref)
    assert sorted(want) == [1, 2, 3, 4]

    par = tmp_path / "tp2dp2"
    _run(par, 4, "train.max_steps=2", "parallel.tp=2", "parallel.sequence_parallel=true")
    got = _losses(par)
    for s in (1, 2):
        assert abs(got[s] - want[s]) <= 1e-4, (got, want)

    for name, nproc, extra in (("dp4", 4, []),):  # one process: tests/test_checkpoint_reshard.py
        d = tmp_path / name
        shutil.copytree(par / "checkpoints", d / "checkpoints")
        r = _run(d, nproc, "train.max_steps=4", "train.resume=auto", *extra)
        assert "resumed from" in r.stdout and "step_00000002" in r.stdout
        resumed = _losses(d)
        for s in (3, 4):
            assert abs(resumed[s] - want[s]) <= 1e-4, (name, resumed, want)
