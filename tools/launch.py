#!/usr/bin/env python
"""Run a megak3 training config locally under torchrun, or on SLURM across nodes.

    python tools/launch.py --nproc 4 parallel=tp2_sp train.max_steps=20          # local, 4 ranks
    python tools/launch.py --slurm --nodes 4 --gpus-per-node 8 --time 12:00:00 \\
        --partition gpu --account proj --setup "module load cuda/12.4" \\
        --dry-run model=k3_mini parallel=tp4_sp train.device=cuda                # print the sbatch
    python tools/launch.py --slurm ... model=k3_mini ...                         # write it, sbatch it

Local: ``python -m megak3.launch.torchrun --standalone --nproc-per-node N -m megak3.train OVERRIDES``
(N=1: plain python): torchrun that passes SIGTERM / SIGUSR1 on to the ranks (checkpoint, exit 75).
The backend follows the hardware (parallel.backend=auto: NCCL on GPUs, gloo on CPU). --nproc
defaults to the layout's size when parallel.dp is given, else the GPU count, else 1.

SLURM: SLURM defaults come from conf/launcher/slurm.yaml (any ``launcher.FIELD=...`` override or
the flags below change them); one task per GPU, rendezvous on the first node, SIGUSR1
``signal_grace_s`` before the time limit -> checkpoint -> exit 75 -> ``scontrol requeue`` ->
``train.resume=auto``. The training config is composed and validated for nodes x GPUs ranks
before anything is written or submitted (--no-validate skips that, e.g. for data paths that only
exist on the cluster; local runs also check the data, tokenizer and checkpoint paths). Exit
status: the training's (local), sbatch's, or 2 on bad input (one line, nothing started or written).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def compose(overrides: list):
    """The training config of ``overrides`` (conf/ composed by megak3.job.compose; errors: one line)."""
    from megak3.job.compose import compose as compose_job

    return compose_job(overrides)


def launcher_config(preset: str, overrides: list, args):
    """LauncherConfig: schema defaults <- conf/launcher/PRESET.yaml <- launcher.* overrides <- flags."""
    from omegaconf import OmegaConf

    from megak3.config import CONF_DIR
    from megak3.job.launcher import LauncherConfig

    cfg = OmegaConf.structured(LauncherConfig)
    path = Path(CONF_DIR) / "launcher" / f"{preset}.yaml"
    if not path.exists():
        choices = sorted(p.stem for p in (Path(CONF_DIR) / "launcher").glob("*.yaml"))
        raise ValueError(f"--launcher={preset}: no conf/launcher/{preset}.yaml (choose one of {', '.join(choices)})")
    cfg = OmegaConf.merge(cfg, OmegaConf.load(path))
    dotted = [o.split(".", 1)[1] for o in overrides if o.startswith("launcher.")]
    if dotted:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(dotted))
    flags = {"nnodes": args.nodes, "gpus_per_node": args.gpus_per_node, "time": args.time,
             "partition": args.partition, "account": args.account, "job_name": args.job_name,
             "mode": args.mode, "cpus_per_task": args.cpus_per_task}
    for k, v in flags.items():
        if v is not None:
            cfg[k] = v
    if args.setup:
        cfg.setup = list(cfg.setup) + list(args.setup)
    return OmegaConf.to_object(cfg).validate()


def default_nproc(cfg) -> int:
    from megak3.job.launcher import LauncherConfig

    if cfg.parallel.dp > 0:
        return LauncherConfig().resolved_nproc(cfg.parallel)
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    return 1


def validate(overrides: list, world_size: int, local: bool = True) -> None:
    """Compose and validate the job for ``world_size`` ranks; ``local``: also this machine's
    data, tokenizer, checkpoint and CUDA."""
    from megak3.job.compose import check_local, to_job

    job = to_job(compose(overrides), world_size=world_size, env={"LOCAL_WORLD_SIZE": str(world_size)})
    if local:
        check_local(job)


def run_local(args, overrides: list) -> int:
    from megak3.launch import commands

    train = [o for o in overrides if not o.startswith("launcher.")]
    nproc = args.nproc if args.nproc is not None else default_nproc(compose(train))
    if nproc < 1:
        raise ValueError(f"--nproc={nproc} must be >= 1")
    if not args.no_validate:
        validate(train, nproc)
    if nproc == 1:
        cmd = [sys.executable, "-m", commands.TRAIN_MODULE] + train
    else:
        cmd = commands.local_command(nproc, train)
    print("+ " + " ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    env = commands.local_env(args.omp_threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    from megak3.launch.torchrun import forward_signals

    proc = subprocess.Popen(cmd, cwd=os.getcwd(), env=env)
    with forward_signals(proc):  # SIGTERM / SIGUSR1: the ranks checkpoint, the job exits 75
        return proc.wait()


def run_slurm(args, overrides: list) -> int:
    from megak3.launch.commands import sbatch_script

    lcfg = launcher_config(args.launcher, overrides, args)
    train = [o for o in overrides if not o.startswith("launcher.")]
    world = lcfg.nnodes * lcfg.gpus_per_node
    if not args.no_validate:
        validate(train, world, local=False)
    script = sbatch_script(lcfg, train, python=args.python, workdir=args.workdir or os.getcwd())
    if args.dry_run:
        print(script)
        return 0
    if shutil.which("sbatch") is None:
        raise ValueError("sbatch is not on PATH: run this on a SLURM login node, or use --dry-run")
    out = Path(args.script or Path(lcfg.log_dir) / f"{lcfg.job_name}.sbatch")
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(lcfg.log_dir).mkdir(parents=True, exist_ok=True)
    out.write_text(script)
    print(f"wrote {out}")
    return subprocess.call(["sbatch", str(out)])


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the training config (key=value)")
    ap.add_argument("--slurm", action="store_true", help="generate (and submit) a SLURM batch job")
    ap.add_argument("--dry-run", action="store_true", help="print the command / sbatch script, run nothing")
    ap.add_argument("--no-validate", action="store_true", help="skip composing and validating the config")
    loc = ap.add_argument_group("local")
    loc.add_argument("--nproc", type=int, default=None, help="ranks (default: layout size, GPU count or 1)")
    loc.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS per rank (default 1)")
    sl = ap.add_argument_group("slurm (defaults: conf/launcher/slurm.yaml)")
    sl.add_argument("--launcher", default="slurm", help="preset in conf/launcher/ (default slurm)")
    sl.add_argument("--nodes", type=int, default=None)
    sl.add_argument("--gpus-per-node", type=int, default=None)
    sl.add_argument("--cpus-per-task", type=int, default=None)
    sl.add_argument("--time", default=None, help="wall-clock limit, [D-]HH:MM:SS")
    sl.add_argument("--partition", default=None)
    sl.add_argument("--account", default=None)
    sl.add_argument("--job-name", default=None)
    sl.add_argument("--mode", choices=("srun", "torchrun"), default=None,
                    help="srun: one task per GPU (default); torchrun: one torchrun per node")
    sl.add_argument("--setup", action="append", default=[],
                    help="shell line run before training (repeatable): module load, source venv, export")
    sl.add_argument("--python", default="python", help="interpreter on the compute nodes")
    sl.add_argument("--workdir", default=None, help="directory the job runs in (default: here)")
    sl.add_argument("--script", default=None, help="where to write the sbatch file")
    ap.error = lambda msg: _usage_error(ap, msg)
    return ap.parse_intermixed_args(argv)


def _usage_error(ap, msg):
    print(f"{ap.prog}: error: {msg} (see --help)", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    args = parse(argv)
    bad = [o for o in args.overrides if "=" not in o]
    try:
        if bad:
            raise ValueError(f"override {bad[0]!r} is not key=value (e.g. train.max_steps=100)")
        return run_slurm(args, args.overrides) if args.slurm else run_local(args, args.overrides)
    except ValueError as e:
        print(f"launch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
