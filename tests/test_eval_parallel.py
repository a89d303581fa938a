"""Trainer.evaluate under parallel layouts (tp + SP, cp, pp: the pipeline engine's forward-only
path, dp, ep) equals the single-process validation loss over the same validation rows (fp32,
same seed), on gloo ranks."""
import pytest
import torch

from conftest import SMALL_MODEL
from parallel.testing import run_distributed

pytestmark = pytest.mark.slow
EVAL_ROWS = 4


def _evaluate(rank, world, corpus, run_dir, par, dp):
    from megak3.config import load_model_config
    from megak3.data.config import DataConfig
    from megak3.metrics.config import LoggingConfig
    from megak3.optim.config import OptimConfig
    from megak3.job.config import JobConfig, TrainConfig
    from megak3.train.trainer import Trainer
    from parallel.config import ParallelConfig
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    job = JobConfig(
        model=load_model_config("k3_tiny", **SMALL_MODEL),
        data=DataConfig(path=corpus[0], tokenizer=corpus[1], seq_len=32, valid_fraction=0.1),
        optim=OptimConfig(lr=1e-3, warmup_steps=1, ns_dtype="float32"),
        # every DP rank runs eval_batches micro-batches of one row: EVAL_ROWS rows in all, in every layout
        train=TrainConfig(max_steps=2, global_batch_size=2, micro_batch_size=1, eval_interval=0,
                          eval_batches=EVAL_ROWS // dp, run_dir=run_dir, seed=3, device="cpu", threads=1),
        logging=LoggingConfig(progress_bar=False, wandb=False, log_interval=1),
        parallel=ParallelConfig(backend="gloo", timeout_s=120, **par),
    ).validate(world)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    tr = Trainer(job, run_dir, pstate=ps)
    return tr.evaluate(), tr.engine is not None


@pytest.fixture(scope="module")
def single(corpus_dataset, tmp_path_factory):
    loss, _ = _evaluate(0, 1, corpus_dataset, str(tmp_path_factory.mktemp("eval_one")), {}, 1)
    return loss


LAYOUTS = {"tp2-sp": ({"tp": 2, "sequence_parallel": True}, 1), "cp2": ({"cp": 2}, 1), "pp2": ({"pp": 2}, 1),
           "dp2": ({}, 2), "ep2-dp2": ({"ep": 2}, 2)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_evaluate_equals_one_process(corpus_dataset, tmp_path, single, layout):
    par, dp = LAYOUTS[layout]
    out = run_distributed(_evaluate, 2, corpus_dataset, str(tmp_path), par, dp, timeout_s=300)
    assert 3 < single < 10  # a real loss of an untrained model (ln 400 ~ 6)
    for rank, (loss, pipelined) in enumerate(out):
        assert pipelined == ("pp" in par), (layout, rank)
        assert abs(loss - single) <= 1e-5 * single, (layout, rank, loss, single)
