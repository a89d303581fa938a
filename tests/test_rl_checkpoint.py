"""RL checkpoints through the checkpoint package: kill -9 after a save and rerun = the uninterrupted run (weights
and losses); a pickle planted in any file of the run directory is refused and never runs; the final policy is a
megak3 checkpoint that generate, --init-from and rl.mopd_teachers accept."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ENGINE = {"page_size": 8, "num_pages": 128, "prefill_chunk": 8}


def make_runner(cache, iterations=3, **kw):
    from conftest import SMALL_MODEL
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.data.demo_sft import build_demo_sft_dataset
    from megak3.data.tokenizer import load_tokenizer
    from megak3.job.config import JobConfig, TrainConfig
    from megak3.optim.config import OptimConfig
    from megak3.posttrain.rl import RLConfig, RLRunner

    torch.set_num_threads(1)
    tok = load_tokenizer(build_demo_sft_dataset(cache, 512, num_conversations=300, progress=False)[1])
    job = JobConfig(model=load_model_config("k3_tiny", **SMALL_MODEL), data=DataConfig(vocab_size=512),
                    optim=OptimConfig(lr=3e-3, warmup_steps=0),
                    train=TrainConfig(max_steps=iterations, global_batch_size=1, micro_batch_size=1, seed=2)).validate()
    rl = RLConfig(iterations=iterations, prompts=2, group_size=2, max_tokens=6, seed=4, **kw)
    return RLRunner(job, rl, tok, engine_options=ENGINE)


def child(run_dir, cache, make=None):
    """Runs until the first checkpoint is committed, then kills itself with SIGKILL (``make``: the runner's
    maker, default :func:`make_runner`)."""
    runner = (make or make_runner)(cache)
    runner.resumable(run_dir)
    save = runner.state.after_update

    def after_update():
        if save():
            print(f"saved {runner.version} pending {runner._pending is not None}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return False

    runner.state.after_update = after_update
    runner.fit(log=None)


def _run_child(run_dir, cache, module: str = "test_rl_checkpoint"):
    """``module.child(run_dir, cache)`` in a fresh interpreter (it kills itself with SIGKILL after a save)."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import {module} as t; "
            f"t.child({str(run_dir)!r}, {str(cache)!r})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def uninterrupted(root, make=None):
    """``(root, history, final weights)`` of an uninterrupted run made by ``make`` (default make_runner)
    with a run directory under ``root``."""
    runner = (make or make_runner)(root / "cache")
    assert not runner.resumable(root / "run")
    runner.fit(log=None)
    return root, runner.history, {k: v.clone() for k, v in runner.model.state_dict().items()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An uninterrupted 3-update run with a run directory: its history and final weights."""
    return uninterrupted(tmp_path_factory.mktemp("rlck"))


def test_kill9_after_a_save_resumes_exactly(straight, tmp_path):
    root, hist, weights = straight
    p = _run_child(tmp_path / "run", root / "cache")
    assert p.returncode == -signal.SIGKILL and "saved 1" in p.stdout, p.stderr[-2000:]
    runner = make_runner(root / "cache")
    assert runner.resumable(tmp_path / "run") and runner.version == 1
    runner.fit(log=None)
    assert [h["loss"] for h in runner.history] == [h["loss"] for h in hist]
    assert [h["uids"] for h in runner.history] == [h["uids"] for h in hist]
    for k, v in runner.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_00000002",
                                                                                       "step_00000003"]


class _Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("target", ["rl_rank0.pt", "state.pt", "objects", "rl_buffer.json", "finished.jsonl"])
def test_planted_pickle_is_refused_and_never_runs(straight, tmp_path, target):
    import shutil

    from test_checkpoint_security import _plant

    root = straight[0]
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    marker = tmp_path / "pwned"
    if target in ("state.pt", "objects"):  # inside the checkpoint: manifest hashes fixed to match
        ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
        _plant(ckpt, "state.pt" if target == "state.pt" else "shard_00000.obj.pt", marker)
    elif target == "finished.jsonl":  # a pickle in front of the journal's lines
        torch.save({"payload": _Planted(marker)}, tmp_path / "p.pt")
        (run / target).write_bytes((tmp_path / "p.pt").read_bytes() + b"\n" + (run / target).read_bytes())
    else:
        torch.save({"payload": _Planted(marker)}, run / target)
    runner = make_runner(root / "cache")
    try:
        with pytest.raises(ValueError) as e:
            runner.resumable(run)
    finally:
        assert not marker.exists(), "the planted pickle ran"
    assert "\n" not in str(e.value)


def test_final_policy_is_a_checkpoint_for_generate_init_from_and_teachers(straight, tmp_path, capsys):
    from megak3.inference.cli import main as generate
    from megak3.inference import Engine

    root, _, weights = straight
    run = root / "run"
    assert generate(["--checkpoint", str(run), "--prompt", "What is 2 + 3?", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()
    loaded = Engine.from_pretrained(str(run)).model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    hf = tmp_path / "hf"  # tools/convert_hf.py export reads it like a pretraining checkpoint
    p = subprocess.run([sys.executable, str(HERE.parent / "tools" / "convert_hf.py"), "export", str(run / "checkpoints"),
                        str(hf), "--dtype", "fp32", "--experts", "bf16"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(HERE.parent)}, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (hf / "config.json").is_file()
    r2 = make_runner(root / "cache", iterations=1, mopd_teachers=str(run))
    assert len(r2.teachers) == 1
    from megak3.posttrain.rl import RLRunner

    r3 = RLRunner(r2.job, r2.rl.__class__(iterations=1, prompts=2, group_size=2, max_tokens=6), r2.tokenizer,
                  engine_options=ENGINE, init_from=str(run))
    assert all(torch.equal(r3.model.state_dict()[k], v) for k, v in weights.items())


def test_cli_keeps_the_run_and_refuses_the_old_format(straight, tmp_path, capsys):
    from megak3.posttrain.__main__ import main

    run = straight[0] / "run"
    common = ["--init-from", str(run), "--eval-prompts", "2", "--threads", "1", "rl.iterations=2", "rl.prompts=2",
              "rl.group_size=2", "rl.max_tokens=4"]
    assert main(common + [f"train.run_dir={tmp_path / 'a'}", "train.save_interval=1"]) == 0
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("step_*")) == ["step_00000001",
                                                                                     "step_00000002"]
    assert main(common + [f"train.run_dir={tmp_path / 'a'}", "train.resume=auto"]) == 0  # nothing left to do
    assert "resumed at version 2" in capsys.readouterr().out
    (tmp_path / "b").mkdir()
    torch.save({"payload": _Planted(tmp_path / "pwned")}, tmp_path / "b" / "rl_rank0.pt")
    assert main(common + [f"train.run_dir={tmp_path / 'b'}", "train.resume=auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rl_rank0.pt" in err and not (tmp_path / "pwned").exists()
    assert main(common + ["train.resume=auto"]) == 2
    assert "train.run_dir" in capsys.readouterr().err
