"""Kill -9 during an RL run, resume: every sample finished before the kill is in the buffer or trained on."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def make_runner(cache):
    import torch

    from conftest import SMALL_MODEL
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.data.tokenizer import load_tokenizer
    from megak3.optim.config import OptimConfig
    from megak3.data.demo_sft import build_demo_sft_dataset
    from megak3.posttrain.rl import RLConfig, RLRunner
    from megak3.job.config import JobConfig, TrainConfig

    torch.set_num_threads(1)
    tok = load_tokenizer(build_demo_sft_dataset(cache, 512, num_conversations=300, progress=False)[1])
    job = JobConfig(model=load_model_config("k3_tiny", **SMALL_MODEL), data=DataConfig(vocab_size=512),
                    optim=OptimConfig(lr=3e-3, warmup_steps=0),
                    train=TrainConfig(max_steps=3, global_batch_size=1, micro_batch_size=1, seed=2)).validate()
    rl = RLConfig(iterations=3, prompts=2, group_size=2, max_tokens=8, partial_fraction=0.5, seed=4)
    return RLRunner(job, rl, tok, engine_options={"page_size": 8, "num_pages": 128, "prefill_chunk": 8})


def child(run_dir, cache, kill_after, make=None):
    """Killed with SIGKILL the moment the kill_after-th sample finished (``make``: the runner's maker)."""
    runner = (make or make_runner)(cache)
    runner.resumable(run_dir)
    journal, count = runner.sampler.on_finish, [0]

    def on_finish(r):
        journal(r)  # the journal line is durable from here on
        print(f"finished {r.uid}", flush=True)
        count[0] += 1
        if count[0] == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    runner.sampler.on_finish = on_finish
    runner.fit(log=None)


@pytest.mark.parametrize("kill_after", [3, 6])  # inside the first iteration; after the first update
def test_kill9_then_resume_loses_no_finished_sample(tmp_path, kill_after):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_rl_resume as t; "
            f"t.child({str(run_dir)!r}, {str(cache)!r}, {kill_after})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    before = {int(l.split()[1]) for l in p.stdout.splitlines() if l.startswith("finished ")}
    assert len(before) == kill_after

    runner = make_runner(cache)
    assert runner.resumable(run_dir)
    trained = {u for h in runner.history for u in h.get("uids", [])}
    in_buffer = {r.uid for r in runner.buffer.rollouts.values() if r.finished}
    assert before <= trained | in_buffer, (before, trained, in_buffer)
    for r in runner.buffer.rollouts.values():
        assert len(r.token_ids) == len(r.versions) == len(r.logprobs) <= r.budget
    runner.fit(log=None)  # and the run goes on to the end
    assert runner.version == 3
