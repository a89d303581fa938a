"""The training program under pipeline parallelism (torchrun, gloo, fp32): pp2 under every schedule
(1F1B, AFAB, interleaved 1F1B with vp=2, ZB-H1), pp2 x dp2, pp2 x tp2 (+SP), pp2 x ep2 (MoonEP
inside each stage) under ZB-H1 and pp2 x tp2 (+SP) x dp2 interleaved on 8 ranks reproduce the single-process losses (rel 1e-4; interleaved over a 5-step
trajectory); a pp2 checkpoint resumes on one process, at pp2 x dp2 and at pp4 with the same losses."""
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
    layouts = {"pp2": (2, 2, ["parallel.pp=2"]),
               "pp2_afab": (2, 2, ["parallel.pp=2", "parallel.pp_schedule=afab"]),
               "pp2_vp2": (2, 5, ["parallel.pp=2", "parallel.vp=2", "parallel.pp_schedule=interleaved_1f1b", SPLIT]),
               "pp2_zb": (2, 2, ["parallel.pp=2", "parallel.pp_schedule=zb_h1"]),
               "pp2dp2_zb": (4, 2, ["parallel.pp=2", "parallel.pp_schedule=zb_h1"]),
               "pp2tp2sp_zb": (4, 2, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                      "parallel.pp_schedule=zb_h1"]),
               "pp2ep2_zb": (4, 2, ["parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=zb_h1"]),
               "pp2tp2spdp2_vp2": (8, 2, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                          "parallel.vp=2", "parallel.pp_schedule=interleaved_1f1b", SPLIT])}
    for name, (nproc, steps, extra) in layouts.items():
        d = tmp_path / name
        _run(d, nproc, f"train.max_steps={steps}", *extra)
        _same(_losses(d), want, range(1, steps + 1), name)
    for name, nproc, extra in (("one", 1, []), ("dp2pp2", 4, ["parallel.pp=2"]),
                               ("pp4", 4, ["parallel.pp=4", SPLIT])):
        d = tmp_path / f"resume_{name}"
        shutil.copytree(tmp_path / "pp2" / "checkpoints", d / "checkpoints")
        r = _run(d, nproc, "train.max_steps=4", "train.resume=auto", *extra)
        assert "resumed from" in r.stdout and "step_00000002" in r.stdout
        _same(_losses(d), want, (3, 4), name)
