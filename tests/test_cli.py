"""``python -m megak3.train``: --help lists every field with its docstring per group; defaults that
depend on the run (threads, a warmup longer than the run) are resolved with a one-line notice."""
from megak3.job.launcher import LaunchJobConfig
from megak3.job.compose import compose, default_threads, to_job
from megak3.job.fields import field_docs, schema_fields
from megak3.job.config import TrainConfig
from megak3.train.usage import usage


def test_help_lists_every_field_with_its_docstring():
    text = usage()
    fields = schema_fields(LaunchJobConfig)
    assert len(fields) > 100
    for f in fields:
        assert f.doc, f.name  # every schema field has a docstring
        line = next(l for l in text.splitlines() if l.strip().startswith(f.name + "="))
        assert f.doc in line, (f.name, line)
    assert "train (conf/train/: demo, long; default demo)" in text
    assert "train.max_steps=30" in text and "optimizer steps to run" in field_docs(TrainConfig)["max_steps"]


def test_threads_from_cores_and_local_ranks():
    n, how = default_threads({"LOCAL_WORLD_SIZE": "1"})
    assert n >= 1 and "1 local ranks" in how
    assert default_threads({"LOCAL_WORLD_SIZE": "100000"})[0] == 1
    notices = []
    job = to_job(compose(["train.threads=0"]), world_size=1, notices=notices, env={"LOCAL_WORLD_SIZE": "1"})
    assert job.train.threads == n and notices[0].startswith(f"train.threads={n} per rank")
    assert to_job(compose(["train.threads=3"]), world_size=1).train.threads == 3


def test_warmup_longer_than_the_run_is_clamped_with_a_notice():
    notices = []
    job = to_job(compose(["train.max_steps=3", "train.threads=1"]), world_size=1, notices=notices)
    assert job.optim.warmup_steps == 0
    assert notices == ["optim.warmup_steps=10 >= train.max_steps=3: warming up for 0 steps (train.max_steps // 10)"]
    job = to_job(compose(["train.max_steps=50", "optim.warmup_steps=60", "train.threads=1"]), world_size=1)
    assert job.optim.warmup_steps == 5
