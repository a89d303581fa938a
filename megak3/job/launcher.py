"""The ``launcher`` config group (conf/launcher/): how a job's ranks are started, and whether this
process already is one of them (:func:`inside_launcher`).

``python -m megak3.train`` reads ``launcher.nproc_per_node``: when a job needs more than one rank
and the process is not already a torchrun/SLURM rank, it re-runs itself under
``python -m megak3.launch.torchrun --standalone --nproc-per-node N`` (one subprocess per Hydra job, so a ``-m`` sweep runs
every layout with its own ranks). The SLURM fields are read by ``tools/launch.py --slurm``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Mapping, Optional

from .config import JobConfig

MODES = ("srun", "torchrun")
SLURM_MARKER = "MEGAK3_SLURM_SRUN"
"""set to 1 by the sbatch script in srun mode: each task maps SLURM_* to torch's variables"""


def inside_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """Whether this process already is one rank of a torchrun / SLURM-srun job."""
    return "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env or env.get(SLURM_MARKER) == "1"


@dataclass
class LauncherConfig:
    """Rank start-up: local torchrun and SLURM batch settings."""

    nproc_per_node: int = 0
    """ranks per node; 0 = derive from the layout (tp*cp*pp*dp when parallel.dp > 0, else 1)"""
    nnodes: int = 1
    """nodes (SLURM: #SBATCH --nodes)"""
    omp_threads: int = 1
    """OMP_NUM_THREADS of every local rank (CPU ranks share the cores)"""
    job_timeout_s: float = 0.0
    """wall-clock limit of one spawned sweep job in seconds (0: none); a job past it is failed"""
    # ---- SLURM (tools/launch.py --slurm) ----
    gpus_per_node: int = 8
    """GPUs per node; one task per GPU (SLURM: --ntasks-per-node, --gpus-per-node)"""
    cpus_per_task: int = 8
    """CPU cores per task (--cpus-per-task)"""
    time: str = "04:00:00"
    """wall-clock limit (--time), [D-]HH:MM:SS"""
    partition: Optional[str] = None
    """SLURM partition (--partition); None: the cluster default"""
    account: Optional[str] = None
    """SLURM account (--account); None: the user's default"""
    job_name: str = "megak3"
    """--job-name and log file prefix"""
    mode: str = "srun"
    """'srun': srun starts one task per GPU, each a rank (env from SLURM_PROCID...);
    'torchrun': srun starts one torchrun per node (c10d rendezvous on the first node)"""
    signal_grace_s: int = 180
    """SIGUSR1 this many seconds before the time limit (checkpoint + requeue)"""
    master_port: int = 29500
    """rendezvous port on the first node"""
    setup: List[str] = field(default_factory=list)
    """shell lines run before the job (module load ..., source venv/bin/activate, export ...)"""
    extra_sbatch: List[str] = field(default_factory=list)
    """additional '#SBATCH' options, e.g. ['--exclusive', '--qos=high']"""
    log_dir: str = "slurm_logs"
    """directory of the %x-%j.out logs"""

    def validate(self) -> "LauncherConfig":
        import re

        def need(ok, f, rule):
            if not ok:
                raise ValueError(f"launcher.{f}={getattr(self, f)!r} {rule}")

        for f in ("nproc_per_node", "omp_threads"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= 0, f, "must be an integer >= 0")
        for f in ("nnodes", "gpus_per_node", "cpus_per_task"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) >= 1, f, "must be an integer >= 1")
        need(self.job_timeout_s >= 0, "job_timeout_s", "must be >= 0 (0: no limit)")
        need(bool(re.fullmatch(r"(\d+-)?\d{1,2}:\d{2}:\d{2}|\d+", str(self.time))), "time",
             "must be [D-]HH:MM:SS or minutes, e.g. 04:00:00 or 1-00:00:00")
        need(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}")
        need(0 <= self.signal_grace_s < 86400, "signal_grace_s", "must be in [0, 86400) seconds")
        need(1024 <= self.master_port < 65536, "master_port", "must be a port in [1024, 65535]")
        need(bool(re.fullmatch(r"[A-Za-z0-9_.-]+", self.job_name)), "job_name",
             "may only use letters, digits, '_', '.', '-'")
        return self

    def resolved_nproc(self, parallel) -> int:
        """Ranks per node of this job: nproc_per_node, or the layout's size (dp > 0) / nnodes."""
        if self.nproc_per_node:
            return self.nproc_per_node
        if parallel.dp > 0:
            world = parallel.tp * parallel.cp * parallel.pp * parallel.dp
            if world % self.nnodes:
                raise ValueError(f"the layout has {world} ranks, not a multiple of launcher.nnodes={self.nnodes}; "
                                 "set launcher.nproc_per_node explicitly")
            return world // self.nnodes
        return 1


@dataclass
class LaunchJobConfig(JobConfig):
    """JobConfig plus the ``launcher`` group; ``python -m megak3.train`` registers it as the
    schema. The launcher is popped before the job reaches the trainer (JobConfig is unchanged)."""

    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    """how the ranks of this job are started (conf/launcher/)"""
