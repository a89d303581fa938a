"""The training progress bar advances at every optimizer step (not only at log windows) and its
clock starts with the training loop, so start-up and the first evaluation do not enter its rate/ETA."""
import time

from megak3.metrics import LoggingConfig
from megak3.train import trainer as trainer_mod
from tests.test_train import make_job


def test_bar_advances_every_step_and_starts_with_the_loop(corpus_dataset, tmp_path, monkeypatch):
    loggers, seen, eval_done = [], [], []

    class Recording(trainer_mod.TrainLogger):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            loggers.append(self)

    real_step, real_eval = trainer_mod.Trainer.train_step, trainer_mod.Trainer.evaluate

    def train_step(self):
        bar = loggers[0]._bar
        seen.append((bar.n, bar.start_t))
        return real_step(self)

    def evaluate(self):
        out = real_eval(self)
        eval_done.append(time.time())
        return out

    monkeypatch.setattr(trainer_mod, "TrainLogger", Recording)
    monkeypatch.setattr(trainer_mod.Trainer, "train_step", train_step)
    monkeypatch.setattr(trainer_mod.Trainer, "evaluate", evaluate)
    job = make_job(corpus_dataset, tmp_path, max_steps=4, eval_batches=1)
    job.logging = LoggingConfig(progress_bar=True, wandb=False, log_interval=10)
    trainer_mod.Trainer(job, tmp_path).fit()
    assert [n for n, _ in seen] == [0, 1, 2, 3]       # one step per step, before any log window
    assert seen[0][1] >= eval_done[0]                  # clock restarted after the first evaluation
    assert loggers[0]._bar is None or loggers[0]._bar.n == 4
