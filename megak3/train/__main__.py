"""``python -m megak3.train`` / ``megak3-train``: Hydra-driven K3 pretraining.

    python -m megak3.train                                  # k3_tiny on the built-in demo corpus
    python -m megak3.train train.max_steps=50 optim.lr=2e-3 data.seq_len=512
    python -m megak3.train data.path=/data/mycorpus model=k3_mini train.device=cuda
    python -m megak3.train train.run_dir=runs/exp1 train.resume=auto   # continue a run
    python -m megak3.train parallel=tp2_dp2                 # 4 ranks: re-runs itself under torchrun
    python -m megak3.train -m parallel=tp2_dp2,tp1_dp4,tp4_dp1 train.max_steps=20   # layout sweep

Defaults live in conf/config.yaml; every field is documented in the dataclasses of
megak3/job/config.py and the modules it imports (``--help`` prints them). A run's overrides are
composed once (megak3/job/compose.py) and validated before anything is written: a user error
prints one line and exits 2; the same composed config then runs as Hydra's job (run directory,
.hydra/ config copy, logging). A sweep (``-m``) and Hydra's own flags go through Hydra's main,
after every swept value was checked.

Ranks (megak3/job/launcher.py, ``launcher.*``): a job that needs more than one rank
(``launcher.nproc_per_node``, or the layout's size when ``parallel.dp`` > 0) and is not already a
torchrun / SLURM rank is started as ``python -m megak3.launch.torchrun --standalone
--nproc-per-node N`` in a subprocess (SIGTERM / SIGUSR1 / SIGINT are passed on to it),
so every job of a ``-m`` sweep gets its own ranks. Every job writes ``status.json`` (ok / failed /
preempted, the error line, per-rank peak memory) next to its ``metrics.jsonl``; in a sweep a
failed job is recorded and the sweep goes on (``tools/sweep_report.py DIR`` tabulates it).
A preempted run (SIGTERM / SIGUSR1, checkpoint saved) exits with
megak3.launch.preemption.REQUEUE_EXIT_CODE.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..config import CONF_DIR
from ..launch import commands
from ..launch.preemption import REQUEUE_EXIT_CODE, Preempted, catch_early
from ..launch.sweep import error_line, write_status
from ..launch.torchrun import forward_signals, record_user_error
from ..job.compose import check, compose, one_line, prepare, split_launcher, task_config, to_job
from ..job.launcher import SLURM_MARKER, LauncherConfig, inside_launcher


def _peak_memory_per_rank(pstate) -> list:
    from ..metrics.telemetry import peak_memory_mb

    mine = peak_memory_mb()
    if pstate.world_size == 1:
        return [mine]
    import torch.distributed as dist

    box = [None] * pstate.world_size
    dist.all_gather_object(box, mine)
    return box


def run(cfg: DictConfig, prepared: Optional[tuple] = None) -> dict:
    """Train in this process (one rank of the job); returns the trainer's result. ``prepared``:
    (JobConfig, notices) of ``cfg`` when the start-up already validated it."""
    from parallel.state import destroy_parallel, init_parallel

    from .trainer import Trainer

    if prepared is None:
        notices: list = []
        job = to_job(cfg, notices=notices)
    else:
        job, notices = prepared
    if int(os.environ.get("RANK", "0")) == 0:
        for line in notices:
            print(f"megak3.train: {line}", flush=True)
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
        result["peak_memory_mb_per_rank"] = _peak_memory_per_rank(pstate)
    finally:
        destroy_parallel()
    if rank == 0:
        if result["first_val_loss"] is not None:
            print(f"validation loss: {result['first_val_loss']:.4f} at the start -> "
                  f"{result['final_val_loss']:.4f} after {result['steps']} steps")
        else:
            print(f"trained {result['steps']} steps (validation off: train.eval_batches=0)")
        print(f"run directory: {os.path.abspath(run_dir)}  (metrics.jsonl, checkpoints/, wandb/)")
    return result


def spawn(overrides: list, nproc: int, job_dir: str, launcher: LauncherConfig) -> tuple:
    """Run this job under ``torchrun --nproc-per-node nproc``; output is echoed and kept in
    ``job_dir/train.log``. Returns (return code, error line or None)."""
    os.makedirs(job_dir, exist_ok=True)
    child = [o for o in overrides if not o.split("=", 1)[0].lstrip("+~").startswith("hydra.")]
    if not any(o.split("=", 1)[0].lstrip("+") == "train.run_dir" for o in child):
        child.append(f"train.run_dir={job_dir}")
    child += [f"hydra.run.dir={job_dir}", "hydra.output_subdir=null"]
    cmd = commands.local_command(nproc, child)
    env = commands.local_env(launcher.omp_threads)
    log_path = os.path.join(job_dir, "train.log")
    print(f"megak3.train: launching {nproc} ranks: {' '.join(cmd[1:])}", flush=True)
    timeout = launcher.job_timeout_s or None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        t0 = time.monotonic()
        timed_out = False
        with forward_signals(proc):  # SIGTERM / SIGUSR1 / SIGINT reach the ranks through the launcher
            for line in proc.stdout:  # echo and keep
                sys.stdout.write(line)
                log.write(line)
                if timeout and time.monotonic() - t0 > timeout:
                    timed_out = True
                    break
            if timed_out:
                os.killpg(proc.pid, 9)
            rc = proc.wait()
    if timed_out:
        return rc, f"timed out after launcher.job_timeout_s={launcher.job_timeout_s:g}s"
    if rc == 0:
        return 0, None
    with open(log_path) as f:
        return rc, error_line(f.read())


def _layout_name(cfg: DictConfig, overrides: list) -> str:
    """The parallel group's option (``tp2_dp2``), or the degrees when parallel.* fields are overridden."""
    try:
        choice = HydraConfig.get().runtime.choices.get("parallel")
    except Exception:
        choice = None
    if choice and not any(o.lstrip("+~").startswith("parallel.") for o in overrides):
        return choice
    p = cfg.parallel
    deg = "_".join(f"{a}{p[a]}" for a in ("tp", "cp", "pp", "ep", "dp") if p[a] != 1 or a == "tp")
    return deg + ("_sp" if p.sequence_parallel else "")


def job(cfg: DictConfig, prepared: Optional[tuple] = None) -> int:
    """One Hydra job: spawn its ranks or train in-process; write status.json. Returns the exit code.
    ``prepared``: (JobConfig, notices) of ``cfg``, validated on the ranks it runs on (:func:`run_once`)."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    rank = int(os.environ.get("RANK", "0"))
    job_dir = cfg.train.run_dir or hc.runtime.output_dir
    overrides = list(hc.overrides.task)
    info = {"layout": _layout_name(cfg, overrides), "overrides": overrides,
            "degrees": {k: cfg.parallel[k] for k in ("tp", "cp", "pp", "ep", "etp", "dp", "sequence_parallel")}}
    t0 = time.time()
    status, error, code = "ok", None, 0
    try:
        _, launcher = split_launcher(cfg)
        nproc = launcher.resolved_nproc(cfg.parallel)
        info["nproc"] = nproc
        if nproc * launcher.nnodes > 1 and not inside_launcher():
            if launcher.nnodes > 1:
                raise ValueError(f"launcher.nnodes={launcher.nnodes}: multi-node jobs start through SLURM "
                                 "(tools/launch.py --slurm); locally use launcher.nnodes=1")
            if prepared is None:  # a layout that cannot run fails here, before any rank starts
                to_job(cfg, world_size=nproc)
            rc, err = spawn(overrides, nproc, job_dir, launcher)
            info["returncode"] = rc
            if rc == REQUEUE_EXIT_CODE:
                status, error, code = "preempted", err, rc
            elif rc != 0:
                status, error, code = "failed", err, 2 if rc == 2 else 1
            else:
                child = (read_child_status(job_dir) or {})
                info["peak_memory_mb_per_rank"] = child.get("peak_memory_mb_per_rank")
        else:
            info["nproc"] = int(os.environ.get("WORLD_SIZE", "1"))
            result = run(cfg, prepared)
            info["peak_memory_mb_per_rank"] = result.get("peak_memory_mb_per_rank")
            info["steps"] = result.get("steps")
    except Preempted as e:
        status, error, code = "preempted", str(e), REQUEUE_EXIT_CODE
        if rank == 0:
            print(f"megak3.train: {e}", file=sys.stderr, flush=True)
    except ValueError as e:  # user errors: one line from rank 0 (every rank has the same), no traceback
        status, error, code = "failed", str(e), 2
        _user_error(f"megak3.train: error: {e}", rank)
    except Exception as e:  # noqa: BLE001
        status, error, code = "failed", f"{type(e).__name__}: {e}".splitlines()[0], 1
        if not multirun:
            _write(rank, job_dir, status, error, info, t0)
            raise
        import traceback

        traceback.print_exc()
    _write(rank, job_dir, status, error, info, t0)
    return code


def _user_error(line: str, rank: int) -> None:
    """Rank 0 prints a user error; every rank records it for megak3.launch.torchrun, which prints it
    when rank 0 could not (stopped by torchrun during its imports after another rank failed first).
    Rank 0 records only after printing, so a line recorded by rank 0 means it was printed."""
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    record_user_error(line)


def read_child_status(job_dir: str) -> Optional[dict]:
    from ..launch.sweep import read_status

    return read_status(job_dir)


def _write(rank: int, job_dir: str, status: str, error, info: dict, t0: float) -> None:
    if rank == 0:
        try:
            write_status(job_dir, status, error, wall_s=round(time.time() - t0, 3), **info)
        except OSError as e:
            print(f"megak3.train: could not write {job_dir}/status.json ({e})", file=sys.stderr)


RANK_QUIET = ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=none", "hydra/hydra_logging=none"]
"""overrides of ranks > 0: only rank 0 writes Hydra's run directory and config copy"""


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    """A sweep (``-m``) or a run with Hydra's own flags (``--cfg``, ``--info``, ...): Hydra composes."""
    _exit_unless_sweep(job(cfg))


def _exit_unless_sweep(code: int) -> None:
    # in a sweep a failed job is recorded in its status.json and the next job runs
    if code and HydraConfig.get().mode != RunMode.MULTIRUN:
        sys.exit(code)


def run_once(overrides: list, env=os.environ) -> int:
    """One job (no sweep, no Hydra flag) from ONE composition of the config: compose (Hydra's run
    config, ``hydra`` node included), validate on the ranks it runs on and against this machine
    (bad input: one line, exit code 2, before anything is written), then run :func:`job` as Hydra
    runs an app's task (run directory, .hydra/ config copy, logging, HydraConfig), with that config
    and that JobConfig. Returns the exit code."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext

    rank = int(env.get("RANK", "0"))
    notices: list = []
    try:
        cfg = compose(overrides + (RANK_QUIET if rank > 0 else []), run_as=hydra_main.__module__.rpartition(".")[2])
        checked = prepare(task_config(cfg), env=env, notices=notices)
    except ValueError as e:
        _user_error(f"megak3.train: error: {one_line(e)}", rank)
        return 2
    if cfg.hydra.mode is None:
        cfg.hydra.mode = RunMode.RUN
    callbacks = Callbacks(cfg)

    def start() -> None:
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        callbacks.on_run_start(config=cfg, config_name="config")
        ret = run_job(hydra_context=HydraContext(config_loader=None, callbacks=callbacks),
                      task_function=lambda task: _exit_unless_sweep(job(task, (checked, notices))),
                      config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None)
        callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
        _ = ret.return_value  # the job's exception, reported as Hydra reports it

    run_and_report(start)
    return 0


def main() -> None:
    catch_early()  # a SIGTERM / SIGUSR1 during start-up stops the run at its first step, with a checkpoint
    if os.environ.get(SLURM_MARKER) == "1" and "RANK" not in os.environ:
        try:  # srun mode of the sbatch script: one task per GPU, ranks from SLURM's variables
            os.environ.update(commands.torch_env_from_slurm(os.environ))
        except ValueError as e:
            print(f"megak3.train: error: {e}", file=sys.stderr)
            sys.exit(2)
    argv = sys.argv[1:]
    if "-h" in argv or "--help" in argv:
        from .usage import usage

        print(usage())
        sys.exit(0)
    if not any(a.startswith("-") for a in argv):  # one run: composed once, checked, run
        code = run_once(argv)
        if code:
            sys.exit(code)
        return
    code, message = check(argv)  # bad input: one line, exit 2, before Hydra writes anything
    if code:
        _user_error(f"megak3.train: error: {message}", int(os.environ.get("RANK", "0")))
        sys.exit(code)
    if int(os.environ.get("RANK", "0")) > 0:
        sys.argv += RANK_QUIET
    hydra_main()


if __name__ == "__main__":
    main()
