"""The training program under pipeline parallelism (torchrun, gloo, fp32): pp2 (1F1B and AFAB),
pp2 x dp2, pp2 x tp2 (+SP) and pp2 x ep2 (MoonEP inside each stage) reproduce the single-process losses; a pp2 checkpoint resumes on one
process and at pp2 x dp2 with the same losses."""
import shutil

import pytest

from test_train_parallel import _losses, _run

pytestmark = pytest.mark.slow


def test_pipeline_layouts_and_resume(corpus_dataset, tmp_path):
    _run.corpus = corpus_dataset
    ref = tmp_path / "single"
    _run(ref, 1, "train.max_steps=4")
    want = _losses(ref)
    layouts = {"pp2": (2, ["parallel.pp=2"]),
               "pp2_afab": (2, ["parallel.pp=2", "parallel.pp_schedule=afab"]),
               "pp2dp2": (4, ["parallel.pp=2"]),
               "pp2tp2sp": (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
               "pp2ep2": (4, ["parallel.pp=2", "parallel.ep=2"])}
    for name, (nproc, extra) in layouts.items():
        d = tmp_path / name
        _run(d, nproc, "train.max_steps=2", *extra)
        got = _losses(d)
        for s in (1, 2):
            assert abs(got[s] - want[s]) <= 1e-4 * abs(want[s]), (name, got, want)
    for name, nproc, extra in (("one", 1, []), ("dp2pp2", 4, ["parallel.pp=2"])):
        d = tmp_path / f"resume_{name}"
        shutil.copytree(tmp_path / "pp2" / "checkpoints", d / "checkpoints")
        r = _run(d, nproc, "train.max_steps=4", "train.resume=auto", *extra)
        assert "resumed from" in r.stdout and "step_00000002" in r.stdout
        resumed = _losses(d)
        for s in (3, 4):
            assert abs(resumed[s] - want[s]) <= 1e-4 * abs(want[s]), (name, resumed, want)
