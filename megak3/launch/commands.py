"""Command lines and batch scripts that start megak3 ranks.

    local_command(4, overrides)        # [python, -m, megak3.launch.torchrun, --standalone, ...]
    sbatch_script(launcher_cfg, overrides)   # the text of a SLURM batch script
    torch_env_from_slurm(os.environ)   # RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR from SLURM_* (srun mode)

Backend choice is automatic at init (parallel.backend=auto: NCCL when CUDA is available, else
gloo), so the same command runs CPU and GPU ranks.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
from typing import Mapping, Optional, Sequence

from ..job.launcher import SLURM_MARKER, LauncherConfig
from .preemption import REQUEUE_EXIT_CODE

TRAIN_MODULE = "megak3.train"
TORCHRUN_MODULE = "megak3.launch.torchrun"
"""torchrun with preemption forwarding and one-line failures (megak3/launch/torchrun.py)"""


def local_command(nproc: int, overrides: Sequence[str], python: str = sys.executable,
                  module: str = TRAIN_MODULE, master_port: Optional[int] = None) -> list:
    """``python -m megak3.launch.torchrun --standalone --nproc-per-node N -m megak3.train OVERRIDES``
    as an argv list (torchrun that passes SIGTERM / SIGUSR1 to the ranks and exits 75 when they
    were preempted).

    --standalone picks a free rendezvous port on localhost, so concurrent jobs do not collide
    unless ``master_port`` pins one."""
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"launcher.nproc_per_node={nproc!r} must be an integer >= 1")
    cmd = [python, "-m", TORCHRUN_MODULE]
    if master_port is None:
        cmd.append("--standalone")
    else:
        cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{master_port}", "--nnodes=1"]
    cmd += [f"--nproc-per-node={nproc}", "-m", module]
    return cmd + list(overrides)


def local_env(omp_threads: int = 1, base: Mapping[str, str] = os.environ) -> dict:
    env = dict(base)
    if omp_threads:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    return env


def torch_env_from_slurm(env: Mapping[str, str]) -> dict:
    """torch.distributed's env:// variables for one srun task (one task per GPU).

    RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID,
    LOCAL_WORLD_SIZE = tasks on this node, MASTER_ADDR = first host of SLURM_JOB_NODELIST (or
    MASTER_ADDR if the script exported it), MASTER_PORT from the script (default 29500)."""
    missing = [k for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if k not in env]
    if missing:
        raise ValueError(f"{SLURM_MARKER}=1 but {', '.join(missing)} not set: run the batch script's "
                         "command under srun, or unset " + SLURM_MARKER)
    out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"],
           "MASTER_PORT": env.get("MASTER_PORT", "29500")}
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    m = re.match(r"(\d+)", per_node)
    if m:
        out["LOCAL_WORLD_SIZE"] = m.group(1)
    addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
    if not addr:
        raise ValueError("cannot find the rendezvous host: neither MASTER_ADDR nor SLURM_JOB_NODELIST is set")
    out["MASTER_ADDR"] = addr
    return out


def first_host(nodelist: str) -> str:
    """First host of a SLURM hostlist: 'gpu[012-015,020],cpu1' -> 'gpu012' (what
    ``scontrol show hostnames | head -1`` prints)."""
    nodelist = nodelist.strip()
    if not nodelist:
        return ""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    prefix, ranges = m.group(1), m.group(3)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _shell_arg(arg: str) -> str:
    """Quote one argument for bash; ``${SLURM_*}`` references stay expandable (double quotes)."""
    if "${SLURM_" in arg:
        return '"' + re.sub(r'(["\\`])', r"\\\1", arg.replace("$", "\0")).replace("\0{SLURM_", "${SLURM_").replace("\0", "\\$") + '"'
    return shlex.quote(arg)


def _quote_overrides(overrides: Sequence[str]) -> str:
    return " ".join(_shell_arg(o) for o in overrides)


def sbatch_script(cfg: LauncherConfig, overrides: Sequence[str], python: str = "python",
                  workdir: Optional[str] = None) -> str:
    """The batch script of a multi-node job: ``cfg.nnodes`` nodes x ``cfg.gpus_per_node`` GPUs.

    Rendezvous: MASTER_ADDR = first node of the allocation, MASTER_PORT = cfg.master_port.
    srun mode: ``srun --ntasks-per-node=G`` starts one task per GPU (each binds its own GPU), and
    ``python -m megak3.train`` maps SLURM_PROCID/NTASKS/LOCALID to RANK/WORLD_SIZE/LOCAL_RANK.
    torchrun mode: one srun task per node runs ``python -m megak3.launch.torchrun --nnodes N
    --nproc-per-node G`` with a c10d rendezvous on MASTER_ADDR; it passes SLURM's SIGUSR1 / SIGTERM
    to the ranks and exits 75 when they were preempted. Preemption: ``--signal=USR1@grace`` (and SLURM's own SIGTERM)
    make the trainer checkpoint and exit with REQUEUE_EXIT_CODE; the script then requeues the job
    (``--requeue``), and ``train.resume=auto`` (appended unless given) resumes it."""
    cfg.validate()
    overrides = list(overrides)
    if not any(o.split("=", 1)[0].lstrip("+") == "train.resume" for o in overrides):
        overrides.append("train.resume=auto")
    if not any(o.split("=", 1)[0].lstrip("+") == "train.run_dir" for o in overrides):
        # a requeued job must find its own checkpoints: one run directory per job id, not per start
        overrides.append(f"train.run_dir=runs/{cfg.job_name}-${{SLURM_JOB_ID}}")
    n, g = cfg.nnodes, cfg.gpus_per_node
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={cfg.job_name}",
             f"#SBATCH --nodes={n}"]
    if cfg.mode == "srun":
        lines += [f"#SBATCH --ntasks-per-node={g}", f"#SBATCH --gpus-per-node={g}",
                  f"#SBATCH --cpus-per-task={cfg.cpus_per_task}"]
    else:
        lines += ["#SBATCH --ntasks-per-node=1", f"#SBATCH --gpus-per-node={g}",
                  f"#SBATCH --cpus-per-task={cfg.cpus_per_task * g}"]
    lines += [f"#SBATCH --time={cfg.time}"]
    if cfg.partition:
        lines.append(f"#SBATCH --partition={cfg.partition}")
    if cfg.account:
        lines.append(f"#SBATCH --account={cfg.account}")
    lines += [f"#SBATCH --signal=USR1@{cfg.signal_grace_s}",
              "#SBATCH --requeue",
              "#SBATCH --open-mode=append",
              f"#SBATCH --output={cfg.log_dir}/%x-%j.out"]
    lines += [f"#SBATCH {o if o.startswith('--') else '--' + o}" for o in cfg.extra_sbatch]
    lines += ["", "set -uo pipefail"]
    if workdir:
        lines.append(f"cd {shlex.quote(workdir)}")
    lines += list(cfg.setup)
    lines += [f"mkdir -p {shlex.quote(cfg.log_dir)}",
              'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f"export MASTER_PORT={cfg.master_port}",
              f"export OMP_NUM_THREADS={max(cfg.omp_threads, 1)}",
              f'echo "megak3: $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES nodes x {g} GPUs, '
              f'rendezvous $MASTER_ADDR:$MASTER_PORT (restart ${{SLURM_RESTART_COUNT:-0}})"', ""]
    args = _quote_overrides(overrides)
    if cfg.mode == "srun":
        lines += [f"export {SLURM_MARKER}=1",
                  f"srun --kill-on-bad-exit=1 --ntasks-per-node={g} --cpus-per-task={cfg.cpus_per_task} --gpu-bind=none \\",
                  f"    {python} -m {TRAIN_MODULE} {args}"]
    else:
        lines += ["srun --kill-on-bad-exit=1 --ntasks-per-node=1 \\",
                  f"    {python} -m {TORCHRUN_MODULE} --nnodes={n} --nproc-per-node={g} \\",
                  "    --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID \\",
                  f"    -m {TRAIN_MODULE} {args}"]
    lines += ["rc=$?",
              f"if [ $rc -eq {REQUEUE_EXIT_CODE} ]; then",
              '    echo "megak3: preempted, checkpoint saved; requeueing $SLURM_JOB_ID"',
              '    scontrol requeue "$SLURM_JOB_ID"',
              "    exit 0",
              "fi",
              "exit $rc", ""]
    return "\n".join(lines)
