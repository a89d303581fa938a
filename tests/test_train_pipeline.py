"""The training program under pipeline parallelism (torchrun, gloo, fp32): pp2 under ZB-H1,
pp2 x ep2 (MoonEP inside each stage) under ZB-H1 and pp2 x tp2 (+SP) x dp2 interleaved (vp=2, split
blocks) on 8 ranks reproduce the single-process losses (rel 1e-4); the pp2 checkpoint resumes at pp4.

Every schedule (AFAB, 1F1B, interleaved, ZB-H1) against one process, at pp2 and pp4, is checked
in-process by tests/test_pipeline.py; resumes across layouts (pp2 -> pp4, one process, ep4 x edp2)
by tests/test_checkpoint_reshard.py. Here each launch is a real torchrun of the trainer (~15 s), so
this test keeps one run per integration those do not cover."""
import shutil

import pytest

from test_train_parallel import _losses, _run

pytestmark = pytest.mark.slow

SPLIT = "parallel.pp_split_blocks=true"


def _same(got, want, steps, name):
    for s in steps:
        assert abs(got[s] - want[s]) <= 1e-4 * abs(want[s]), (name, s, got, want)


def test_pipeline_layouts_and_resume(corpus_dataset, tmp_path):
    _run.corpus = corpus_dataset
    ref = tmp_path / "single"
    _run(ref, 1, "train.max_steps=5")
    want = _losses(ref)
    layouts = {"pp2_zb": (2, 2, ["parallel.pp=2", "parallel.pp_schedule=zb_h1"]),
               "pp2ep2_zb": (4, 2, ["parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=zb_h1"]),
               "pp2tp2spdp2_vp2": (8, 3, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                          "parallel.vp=2", "parallel.pp_schedule=interleaved_1f1b", SPLIT])}
    for name, (nproc, steps, extra) in layouts.items():
        d = tmp_path / name
        _run(d, nproc, f"train.max_steps={steps}", *extra)
        _same(_losses(d), want, range(1, steps + 1), name)
    d = tmp_path / "resume_pp4"
    shutil.copytree(tmp_path / "pp2_zb" / "checkpoints", d / "checkpoints")
    r = _run(d, 4, "train.max_steps=4", "train.resume=auto", "parallel.pp=4", SPLIT)
    assert "resumed from" in r.stdout and "step_00000002" in r.stdout
    _same(_losses(d), want, (3, 4), "resume_pp4")
