"""The training program: config errors, bit-identical resume, QB in the loop, the CLI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SMALL_MODEL
from megak3.config import load_model_config
from megak3.data.config import DataConfig
from megak3.metrics.config import LoggingConfig
from megak3.optim.config import OptimConfig
from megak3.job.config import JobConfig, TrainConfig
from megak3.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def make_job(corpus, run_dir, optim_lr=3e-3, **train_kw) -> JobConfig:
    prefix, tok = corpus
    train = dict(max_steps=6, global_batch_size=4, micro_batch_size=2, eval_interval=0, eval_batches=2,
                 save_interval=0, run_dir=str(run_dir), seed=7)
    train.update(train_kw)
    return JobConfig(
        model=load_model_config("k3_tiny", **SMALL_MODEL),
        data=DataConfig(path=prefix, tokenizer=tok, seq_len=64, valid_fraction=0.1),
        optim=OptimConfig(lr=optim_lr, warmup_steps=2),
        train=TrainConfig(**train),
        logging=LoggingConfig(progress_bar=False, wandb=False, log_interval=1),
    ).validate()


def test_resume_is_bit_identical(corpus_dataset, tmp_path):
    full = Trainer(make_job(corpus_dataset, tmp_path / "full", max_steps=6), tmp_path / "full")
    full.fit()
    first = Trainer(make_job(corpus_dataset, tmp_path / "split", max_steps=3), tmp_path / "split")
    first.fit()
    second = Trainer(make_job(corpus_dataset, tmp_path / "split", max_steps=6, resume="auto"), tmp_path / "split")
    second.fit()
    a = [h["loss"] for h in full.history]
    b = [h["loss"] for h in first.history] + [h["loss"] for h in second.history]
    assert a == b  # exact float equality: same data, weights, optimizer state, QB biases
    for name, t in full.model.state_dict().items():
        assert torch.equal(t, second.model.state_dict()[name]), name


def test_grad_accumulation_matches_one_big_batch(corpus_dataset, tmp_path):
    one = Trainer(make_job(corpus_dataset, tmp_path / "a", max_steps=3, global_batch_size=4, micro_batch_size=4),
                  tmp_path / "a")
    two = Trainer(make_job(corpus_dataset, tmp_path / "b", max_steps=3, global_batch_size=4, micro_batch_size=2),
                  tmp_path / "b")
    m1 = one.accumulate_gradients(one.next_micro_batches())
    m2 = two.accumulate_gradients(two.next_micro_batches())
    assert abs(float(m1["loss_sum"] / m1["step_tokens"]) - float(m2["loss_sum"] / m2["step_tokens"])) < 1e-6
    for (n, p), (_, q) in zip(one.model.named_parameters(), two.model.named_parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=n)
    one.optimizer_step(), two.optimizer_step()
    for a, b in zip(one.model.moe_layers(), two.model.moe_layers()):
        torch.testing.assert_close(a.gate.e_score_correction_bias, b.gate.e_score_correction_bias)


def test_training_lowers_validation_loss_and_updates_qb(corpus_dataset, tmp_path):
    tr = Trainer(make_job(corpus_dataset, tmp_path, max_steps=25, optim_lr=1e-2), tmp_path)
    out = tr.fit()
    assert out["final_val_loss"] < out["first_val_loss"] - 0.5, out
    biases = [m.gate.e_score_correction_bias for m in tr.model.moe_layers()]
    assert any(b.abs().sum() > 0 for b in biases)  # Quantile Balancing moved the selection biases
    assert all(abs(float(b.mean())) < 1e-5 for b in biases)  # and keeps them mean-centred
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [l for l in lines if l.get("kind") == "train"]
    assert len(train) == 25 and {"loss", "lr", "grad_norm", "expert_load_max_violation"} <= train[-1].keys()
    assert (tmp_path / "checkpoints" / "latest").exists()


def test_corrupt_latest_checkpoint_falls_back(corpus_dataset, tmp_path):
    tr = Trainer(make_job(corpus_dataset, tmp_path, max_steps=4, save_interval=2), tmp_path)
    tr.fit()
    state = tmp_path / "checkpoints" / "step_00000004"
    victim = next(p for p in state.iterdir() if p.suffix == ".pt")
    victim.write_bytes(victim.read_bytes()[:100])  # truncated by a crash
    with pytest.warns(UserWarning):
        again = Trainer(make_job(corpus_dataset, tmp_path, max_steps=4, resume="auto", save_interval=2), tmp_path)
        path = again.maybe_resume()
    assert path.name == "step_00000002" and again.step == 2


@pytest.mark.parametrize("train_kw,needle", [
    (dict(global_batch_size=5, micro_batch_size=2), "train.global_batch_size=5"),
    (dict(precision="fp8"), "train.precision"),
])
def test_bad_train_config_names_field(corpus_dataset, tmp_path, train_kw, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        make_job(corpus_dataset, tmp_path, **train_kw)


def _cli(*args, env_extra=None):
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "megak3.train", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,needle", [
    (["data.path=/nonexistent/corpus"], "data.path=/nonexistent/corpus"),
    (["data.seq_len=100000"], "data.seq_len=100000 exceeds model.max_seq_len"),
    (["train.global_batch_size=6", "train.micro_batch_size=4"], "train.global_batch_size=6"),
    (["model=k3_huge"], "k3_huge"),
    (["train.max_stepz=3"], "max_stepz"),
])
def test_cli_user_errors_are_one_line(args, needle, tmp_path):
    r = _cli(*args, f"hydra.run.dir={tmp_path}")
    assert r.returncode != 0
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_cli_trains_and_resumes(corpus_dataset, tmp_path):
    prefix, tok = corpus_dataset
    common = [f"data.path={prefix}", f"data.tokenizer={tok}", "data.seq_len=64", "data.valid_fraction=0.1",
              f"train.run_dir={tmp_path}", "train.global_batch_size=2", "train.micro_batch_size=2",
              "train.eval_batches=1", "optim.warmup_steps=1", "logging.progress_bar=false", "logging.log_interval=1",
              f"hydra.run.dir={tmp_path}/hydra"]
    common += [f"model.{k}={v}" for k, v in SMALL_MODEL.items()]
    r = _cli(*common, "train.max_steps=2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "validation loss:" in r.stdout and str(tmp_path) in r.stdout
    # what an operator sees: the start-up summary, MFU in the log line, a checkpoint line, the config
    for needle in ("M parameters", "M active per token", "layout 1 rank(s): tp 1", "tokens per step",
                   "GFLOP per token", "| mfu ", "TFLOP/s/rank", "checkpoint step_00000002 saved:"):
        assert needle in r.stdout, (needle, r.stdout[-3000:])
    import yaml
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["max_steps"] == 2
    r = _cli(*common, "train.max_steps=4", "train.resume=auto")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and "step_00000002" in r.stdout


def test_nonfinite_stop_is_checked_at_log_steps(corpus_dataset, tmp_path):
    """Between log steps the loop never reads the skip flag (no host sync): with log_interval=4 the
    stop comes at the first log step, naming the step that crossed train.max_nonfinite_steps, and
    the window's skipped steps are all logged and changed nothing."""
    from megak3.train.trainer import NonFiniteError

    job = make_job(corpus_dataset, tmp_path, optim_lr=1e6, max_steps=12, max_nonfinite_steps=1,
                   eval_batches=0)
    job.optim.warmup_steps = 0
    job.logging.log_interval = 4
    tr = Trainer(job, tmp_path)
    with pytest.raises(NonFiniteError) as err:
        tr.fit()
    train = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
    skipped = [r["step"] for r in train if r["skipped_nonfinite"]]
    assert tr.step % 4 == 0 and len(train) == tr.step  # stopped at a log step, every step logged
    assert len(skipped) >= 2 and str(err.value).startswith(f"step {skipped[1]}: ")
    assert tr.nonfinite_steps == len(skipped)
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())


def test_nonfinite_steps_are_skipped_counted_and_never_saved(corpus_dataset, tmp_path):
    """optim.lr=1e6: diverging steps change nothing, are counted, and the run stops with one line
    naming the step; every checkpoint written holds only finite values."""
    from megak3.checkpoint import atomic as ckpt
    from megak3.checkpoint.reader import CheckpointReader
    from megak3.train.trainer import NonFiniteError

    job = make_job(corpus_dataset, tmp_path, optim_lr=1e6, max_steps=8, save_interval=1, max_nonfinite_steps=2,
                   eval_batches=0)  # eval_batches=0: no validation pass at all (also checked here)
    job.optim.warmup_steps = 0
    tr = Trainer(job, tmp_path)
    with pytest.raises(NonFiniteError, match=r"^step \d+: the loss / gradient norm is NaN or inf \(3 such step"):
        tr.fit()
    assert tr.first_val is None and not (tmp_path / "metrics.jsonl").read_text().count('"eval"')
    assert tr.nonfinite_steps == 3
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())  # skipped steps changed nothing
    train = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
    assert sum(r["skipped_nonfinite"] for r in train) == 3
    for path in ckpt.list_checkpoints(tmp_path / "checkpoints"):
        r = CheckpointReader(path)
        for key in r.keys():
            if r.dtype(key).is_floating_point:
                assert torch.isfinite(r.read(key, (0,) * len(r.global_shape(key)), r.global_shape(key))).all()
