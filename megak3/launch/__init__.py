"""Launching megak3 at any scale: local torchrun, SLURM batch scripts, layout sweeps, preemption,
and an analytic memory / FLOPs / step-time planner (see docs/SCALING.md). The ``launcher`` config
group (LauncherConfig) is part of the job config: megak3.job.launcher.

    megak3.launch.commands    torchrun command lines, sbatch scripts, SLURM -> torch environment
    megak3.launch.preemption  PreemptionHandler: SIGTERM/SIGUSR1 -> checkpoint -> requeue exit code
    megak3.launch.torchrun    torchrun that passes SIGTERM/SIGUSR1 to the ranks, checks the job
                              before they start, exits 75 / 2 / 1 with one line
    megak3.launch.sweep       per-job status files and metrics summaries of a Hydra sweep
    megak3.launch.hardware    the documented hardware table used by the planner
    megak3.launch.planner     per-rank memory, FLOPs per token, comm volume, step time, layout search
"""
