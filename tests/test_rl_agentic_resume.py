"""An agentic RL run killed with -9 in the middle of an iteration resumes from its RL checkpoint with every paused
sandbox as it was (digests equal) and no episode lost or trained twice."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ENGINE = {"page_size": 8, "num_pages": 512, "prefill_chunk": 64, "checkpoint_interval": 8}
SHORT, LONG = 10, 400   # trajectory budgets: SHORT ends after one turn, LONG reaches the turn limit


def make_runner(cache):
    from conftest import SMALL_MODEL
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.data.demo_sft import build_demo_sft_dataset
    from megak3.data.tokenizer import load_tokenizer
    from megak3.job.config import JobConfig, TrainConfig
    from megak3.optim.config import OptimConfig
    from megak3.posttrain.agentic import AgentRunner
    from megak3.posttrain.rl import RLConfig

    torch.set_num_threads(1)
    tok = load_tokenizer(build_demo_sft_dataset(cache, 512, num_conversations=200, progress=False)[1])
    job = JobConfig(model=load_model_config("k3_tiny", **SMALL_MODEL), data=DataConfig(vocab_size=512),
                    optim=OptimConfig(lr=3e-3, warmup_steps=0),
                    train=TrainConfig(max_steps=2, global_batch_size=1, micro_batch_size=1, seed=3)).validate()
    rl = RLConfig(env="ledger", prompts=2, group_size=2, max_tokens=4, max_turns=3, obs_tokens=12,
                  partial_fraction=0.5, iterations=2, micro_batch_size=8, seed=1, env_workers=1)
    holder = []
    runner = AgentRunner(job, rl, tok, engine_options=ENGINE,  # budgets: a function of the run's own state
                         budgets=lambda: [SHORT if holder[0].tasks_used % 2 else LONG] * 2)
    holder.append(runner)
    return runner


def child(run_dir, cache):
    runner = make_runner(cache)
    runner.resumable(run_dir)
    save, after_turn, turns = runner.state.after_update, runner._after_turn, [0]

    def after_update():
        saved = save()
        if saved:
            print("saved " + json.dumps({"version": runner.version, "paused": runner.paused,
                                         "trained": [h.get("uids", []) for h in runner.history]}), flush=True)
        return saved

    def kill_mid_iteration(eid):
        after_turn(eid)
        if runner.version == 1:
            turns[0] += 1
            if turns[0] == 3:
                print("killed", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    runner.state.after_update, runner._after_turn = after_update, kill_mid_iteration
    runner.fit(log=None)


def test_agentic_run_killed_mid_iteration_resumes_with_identical_sandboxes(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_rl_agentic_resume as t; "
            f"t.child({str(run_dir)!r}, {str(cache)!r})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == -signal.SIGKILL and "killed" in p.stdout, p.stderr[-3000:]
    saved = [json.loads(l.split(" ", 1)[1]) for l in p.stdout.splitlines() if l.startswith("saved ")]
    assert [s["version"] for s in saved] == [1]
    at_save = saved[0]
    assert at_save["paused"], "the test needs episodes paused across the checkpoint"

    with make_runner(cache) as runner:
        assert runner.resumable(run_dir) and runner.version == 1
        assert runner.paused == at_save["paused"]
        for eid, digest in at_save["paused"].items():  # every paused sandbox back as it was at the save
            assert runner.pool.digest(eid) == digest
        assert [h.get("uids", []) for h in runner.history] == at_save["trained"]
        runner.fit(log=None)  # generate() checks the digests again before playing on
        trained = [u for h in runner.history for u in h.get("uids", [])]
        left = sorted(runner.buffer.rollouts)
        print(f"trained episodes per update: {[h.get('uids', []) for h in runner.history]}; in the buffer: {left}")
        assert len(trained) == len(set(trained)) and runner.version == 2
        assert sorted(trained + left) == list(range(runner.buffer._next_uid))
