"""PreemptionHandler: a signal sets a flag, the loop checkpoints at the next step boundary and exits
with the requeue code; across ranks the flag is agreed so every rank stops at the same step."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megak3.launch.preemption import REQUEUE_EXIT_CODE, Preempted, PreemptionHandler
from parallel.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]

LOOP = textwrap.dedent("""
    import os, signal, sys, time
    from megak3.launch.preemption import PreemptionHandler, Preempted
    out, self_signal_at = sys.argv[1], int(sys.argv[2])
    handler = PreemptionHandler().install()
    try:
        for step in range(1, 10_000):
            time.sleep(0.01)                      # one "training step"
            if step == self_signal_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            if step == 2:
                print("ready", flush=True)
            if handler.requested():
                open(out, "w").write(f"saved {step} {handler.signal_name}")   # the checkpoint
                raise Preempted(step, handler.signal_name)
        sys.exit(0)
    except Preempted as e:
        sys.exit(e.exit_code)
""")


def _loop(tmp_path, self_signal_at):
    out = tmp_path / "ckpt.txt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return out, subprocess.Popen([sys.executable, "-c", LOOP, str(out), str(self_signal_at)], env=env,
                                 stdout=subprocess.PIPE, text=True)


def test_sigusr1_checkpoints_and_exits_with_requeue_code(tmp_path):
    out, p = _loop(tmp_path, self_signal_at=3)
    assert p.wait(timeout=60) == REQUEUE_EXIT_CODE == 75
    assert out.read_text() == "saved 3 SIGUSR1"  # stopped at the step the signal arrived in


def test_external_sigterm(tmp_path):
    out, p = _loop(tmp_path, self_signal_at=-1)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == REQUEUE_EXIT_CODE
    step = int(out.read_text().split()[1])
    assert step >= 2 and out.read_text().endswith("SIGTERM")


def test_flag_only_and_uninstall_restores_previous_handler():
    seen = []
    prev = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        h = PreemptionHandler(signals=(signal.SIGUSR1,)).install()
        assert not h.requested() and not h.local
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert h.local and h.requested() and h.signal_name == "SIGUSR1" and seen == []
        h.uninstall()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, prev)
    e = Preempted(7, "SIGTERM")
    assert e.exit_code == REQUEUE_EXIT_CODE and "step 7" in str(e)


def _ranks_agree(rank, world, signal_rank, signal_step):
    h = PreemptionHandler(signals=(signal.SIGTERM,)).install()
    try:
        for step in range(1, 20):
            if rank == signal_rank and step == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.002 * rank)  # ranks drift
            if h.requested():
                return step, h.local
        return None, h.local
    finally:
        h.uninstall()


def test_ranks_stop_at_the_same_step():
    res = run_distributed(_ranks_agree, 3, 2, 4, timeout_s=120)
    assert [s for s, _ in res] == [4, 4, 4]            # all stop where rank 2 got the signal
    assert [loc for _, loc in res] == [False, False, True]


@pytest.mark.slow
def test_trainer_preemption_saves_and_resumes(corpus_dataset, tmp_path):
    """The real training loop: SIGUSR1 mid-run -> checkpoint at that step, exit 75; resume=auto goes on."""
    prefix, tok = corpus_dataset
    run_dir = tmp_path / "run"
    args = [f"data.path={prefix}", f"data.tokenizer={tok}", "data.seq_len=32", "data.valid_fraction=0.1",
            f"train.run_dir={run_dir}", "train.global_batch_size=2", "train.micro_batch_size=1",
            "train.eval_batches=1", "train.eval_interval=0", "train.save_interval=0", "logging.log_interval=1",
            "logging.progress_bar=false", "logging.wandb=false", f"hydra.run.dir={run_dir}/hydra",
            "model.hidden_size=64", "model.num_layers=4", "optim.warmup_steps=1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "megak3.train"]
    p = subprocess.Popen(cmd + args + ["train.max_steps=100000"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("step 2 "):
            p.send_signal(signal.SIGUSR1)
            break
    rest = p.communicate(timeout=300)[0]
    assert p.returncode == REQUEUE_EXIT_CODE, "".join(seen) + rest
    assert "checkpoint saved" in rest, rest
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert ckpts, rest
    stopped = int(ckpts[-1].name.split("_")[1])
    assert stopped >= 2
    r = subprocess.run(cmd + args + [f"train.max_steps={stopped + 2}", "train.resume=auto"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"step_{stopped:08d}" in r.stdout and "resumed from" in r.stdout


def _wait_for_step(p, step: int) -> list:
    """Read p's output until rank 0 logs ``step N``; returns the lines read."""
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith(f"step {step} "):
            return seen
    raise AssertionError("".join(seen))


@pytest.mark.slow
def test_torchrun_forwards_sigterm_and_sigusr1_and_exits_75(corpus_dataset, tmp_path):
    """A real torchrun of 2 gloo ranks: SIGTERM to ``python -m megak3.launch.torchrun`` -> the ranks
    checkpoint, the job exits 75; ``train.resume=auto`` continues from that checkpoint, this time
    started by ``python -m megak3.train launcher.nproc_per_node=2`` (its own torchrun), and SIGUSR1
    to it gives a later checkpoint and 75 again."""
    from test_sweep import common_overrides

    prefix, tok = corpus_dataset
    run_dir = tmp_path / "run"
    args = common_overrides(prefix, tok) + [f"train.run_dir={run_dir}", f"hydra.run.dir={run_dir}",
                                            "train.max_steps=100000", "parallel=tp1_dp2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    kw = dict(cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def steps():
        return sorted(int(c.name.split("_")[1]) for c in (run_dir / "checkpoints").glob("step_*"))

    p = subprocess.Popen([sys.executable, "-m", "megak3.launch.torchrun", "--standalone", "--nproc-per-node=2",
                          "-m", "megak3.train"] + args, **kw)
    seen = _wait_for_step(p, 2)
    p.send_signal(signal.SIGTERM)
    out = "".join(seen) + p.communicate(timeout=300)[0]
    assert p.returncode == REQUEUE_EXIT_CODE, out
    assert "preempted by SIGTERM" in out and "ChildFailedError" not in out and "Traceback" not in out, out
    first = steps()
    assert first and first[-1] >= 2, out

    p = subprocess.Popen([sys.executable, "-m", "megak3.train", "launcher.nproc_per_node=2", "train.resume=auto"]
                         + args, **kw)
    seen = _wait_for_step(p, first[-1] + 2)
    p.send_signal(signal.SIGUSR1)
    out = "".join(seen) + p.communicate(timeout=300)[0]
    assert p.returncode == REQUEUE_EXIT_CODE, out
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{first[-1]:08d}'}" in out, out
    assert f"step {first[-1] + 1} " in out and "step 1 " not in out and "preempted by SIGUSR1" in out, out
    assert steps()[-1] >= first[-1] + 2, out
    assert json.loads((run_dir / "status.json").read_text())["status"] == "preempted"
