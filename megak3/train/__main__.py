"""``python -m megak3.train`` / ``megak3-train``: Hydra-driven K3 pretraining.

    python -m megak3.train                                  # k3_tiny on the built-in demo corpus
    python -m megak3.train train.max_steps=50 optim.lr=2e-3 data.seq_len=512
    python -m megak3.train data.path=/data/mycorpus model=k3_mini train.device=cuda
    python -m megak3.train train.run_dir=runs/exp1 train.resume=auto   # continue a run

Defaults live in conf/config.yaml; every field is documented in the dataclasses of
megak3/train/config.py and the modules it imports. User errors print one line and exit 2.
"""
from __future__ import annotations

import os
import sys

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from ..config import CONF_DIR
from .config import JobConfig

ConfigStore.instance().store(name="job_schema", node=JobConfig)


def to_job(cfg: DictConfig) -> JobConfig:
    job = OmegaConf.to_object(cfg)
    assert isinstance(job, JobConfig)
    return job.validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))


def run(cfg: DictConfig) -> dict:
    from parallel.state import destroy_parallel, init_parallel

    from .trainer import Trainer

    job = to_job(cfg)
    run_dir = job.train.run_dir or HydraConfig.get().runtime.output_dir
    pstate = init_parallel(job.parallel, model_cfg=job.model)
    rank = pstate.rank
    if pstate.world_size > 1:  # one run directory for the whole job: rank 0's
        import torch.distributed as dist

        box = [run_dir]
        dist.broadcast_object_list(box, src=0)
        run_dir = box[0]
    try:
        trainer = Trainer(job, run_dir, config_dict=OmegaConf.to_container(cfg, resolve=True), pstate=pstate)
        result = trainer.fit()
    finally:
        destroy_parallel()
    if rank == 0:
        print(f"validation loss: {result['first_val_loss']:.4f} at the start -> "
              f"{result['final_val_loss']:.4f} after {result['steps']} steps")
        print(f"run directory: {os.path.abspath(run_dir)}  (metrics.jsonl, checkpoints/, wandb/)")
    return result


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except ValueError as e:  # user errors: one line, no traceback
        print(f"megak3.train: error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    if int(os.environ.get("RANK", "0")) > 0:
        # only rank 0 writes Hydra's run directory and config copy; the others log nothing there
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none",
                     "hydra/hydra_logging=none"]
    hydra_main()


if __name__ == "__main__":
    main()
