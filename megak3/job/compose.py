"""The training job from command-line overrides: Hydra's composition of conf/config.yaml, the
schema's validation, and the checks against this machine (paths, CUDA). Every user mistake
becomes a :class:`ConfigError` whose message is one line naming the field and the fix.

    cfg = compose(["model=k3_tiny", "train.max_steps=3"])   # DictConfig, launcher group included
    job = to_job(cfg, world_size=4)                         # the validated JobConfig of 4 ranks
    job = prepare(cfg)                                      # ... on the ranks it runs on, this machine checked
    check(["parallel=tp9"])                                 # (2, "parallel=tp9: no such option; choose ...")

``python -m megak3.train`` composes a run once (``compose(overrides, run_as=...)``) and checks it
with :func:`prepare`; ``python -m megak3.launch.torchrun`` and ``tools/launch.py`` run :func:`check`
(or compose + to_job); all before any rank starts or any file is written.
"""
from __future__ import annotations

import difflib
import functools
import os
import re
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from ..config import CONF_DIR
from .config import JobConfig
from .launcher import LauncherConfig, LaunchJobConfig, inside_launcher
from .fields import schema_fields

# JobConfig plus the launcher group (popped before the job reaches the trainer)
ConfigStore.instance().store(name="job_schema", node=LaunchJobConfig)
# ${megak3_or:A,B}: A unless it is null or empty, else B (conf/config.yaml: Hydra's run directory is
# train.run_dir when given, so Hydra writes nothing beside it)
OmegaConf.register_new_resolver("megak3_or", lambda a, b: a if a not in (None, "") else b, replace=True)

HELP_HINT = "python -m megak3.train --help lists every field"
HYDRA_FLAGS_OK = ("-m", "--multirun")


class ConfigError(ValueError):
    """A user mistake in the job's configuration; the message is one line."""


def one_line(e: BaseException) -> str:
    """The message of ``e`` on one line."""
    return "; ".join(l.strip() for l in str(e).splitlines() if l.strip()) or type(e).__name__


# ---- composition --------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def groups() -> dict:
    """{group: [options]} of conf/ (the directories of YAML files)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(Path(CONF_DIR).iterdir()) if d.is_dir()}


@functools.lru_cache(maxsize=None)
def known_fields() -> dict:
    """{dotted field: Field} of the job schema (launcher included)."""
    return {f.name: f for f in schema_fields(LaunchJobConfig)}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _with_value(overrides: Sequence[str], key: str) -> str:
    """``key=value`` as the overrides set it, or ``key`` alone."""
    for o in reversed(list(overrides)):
        if _key(o) == key and "=" in o:
            return f"{key}={o.split('=', 1)[1]}"
    return key


def _did_you_mean(key: str) -> str:
    names = list(known_fields()) + ([] if "." in key else list(groups()))
    best = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
    if not best and "." in key:  # a misspelt section: compare the leaf under every section
        leaf = key.rsplit(".", 1)[1]
        best = difflib.get_close_matches(key, [n for n in names if n.endswith("." + leaf)], n=1, cutoff=0.5)
    if not best:
        return ""
    return f" (did you mean {best[0]}{'=' if best[0] in groups() else ''}?)"


_TYPE_RULES = (("converted to Integer", "must be an integer"), ("converted to Float", "must be a number"),
               ("is not a valid bool", "must be true or false"), ("is not Optional", "must not be null"),
               ("is not a subclass of", "is a section, not a value; set its fields"))


def explain(e: BaseException, overrides: Sequence[str]) -> str:
    """One line for an exception raised by Hydra's composition of ``overrides``."""
    msg = str(e)
    cause = e.__cause__ or e.__context__
    m = re.search(r"Could not find '([^'/]+)/([^']+)'", msg)
    if m:  # an unknown option of a config group
        group, option = m.group(1), m.group(2)
        opts = groups().get(group, [])
        best = difflib.get_close_matches(option, opts, n=1, cutoff=0.5)
        hint = f" (did you mean {group}={best[0]}?)" if best else ""
        return f"{group}={option}: no such option{hint}; choose one of {', '.join(opts)} (conf/{group}/)"
    if type(e).__name__ == "OverrideParseException":
        bad = next((o for o in overrides if o in msg), None)
        if bad is not None and "=" not in bad:
            return f"override {bad!r} is not key=value (e.g. train.max_steps=100)"
        return f"cannot parse override {bad or ''!r}: {one_line(cause or e)}"
    if "Ambiguous value for argument" in msg:
        bad = re.search(r"argument '([^']*)'", msg)
        return (f"{bad.group(1) if bad else 'override'}: a comma makes a sweep; write key=[a,b] for a list, "
                "quote the value for a string, or add -m to sweep")
    full_key = getattr(cause, "full_key", None) or getattr(e, "full_key", None)
    if "Could not override" in msg or "No match in the defaults list" in msg:
        key = re.search(r"override '([^']+)'", msg)
        key = key.group(1) if key else (full_key or "?")
        return f"{key}: no such field{_did_you_mean(key)}; {HELP_HINT}"
    if full_key:
        reason = one_line(cause or e).split("; full_key")[0].split("    full_key")[0]
        for needle, rule in _TYPE_RULES:
            if needle in reason:
                reason = rule
                break
        if "does not support deletion" in reason:
            return f"~{full_key}: a schema field cannot be deleted; set a value instead"
        f = known_fields().get(full_key)
        if f is None:  # a section: name one of its fields
            f0 = next((n for n in known_fields() if n.startswith(full_key + ".")), None)
            return f"{_with_value(overrides, full_key)} {reason}" + (f", e.g. {f0}=..." if f0 else "")
        head = _with_value(overrides, full_key)
        doc = f" ({f.type}: {f.doc})" if f.doc else ""
        return f"{head}{' ' if '=' in head else ': '}{reason}{doc}"
    return one_line(e)


def compose(overrides: Sequence[str], run_as: Optional[str] = None) -> DictConfig:
    """conf/config.yaml composed with ``overrides``. Without ``run_as``, Hydra's ``hydra.*``
    overrides are left to Hydra and the result has no ``hydra`` node; with ``run_as`` (the Hydra
    job name), the result is the whole run config a Hydra app gets (``hydra`` node included, its
    overrides applied), composed once for both the checks and the run."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    if run_as is None:
        overrides = [o for o in overrides if not _key(o).startswith(("hydra.", "hydra/"))]
    for o in overrides:  # '+key=value' adds keys; the schema has every key there is
        if o.startswith("+") and "=" in o and _key(o) not in known_fields() and _key(o) not in groups():
            raise ConfigError(f"{_key(o)}: no such field{_did_you_mean(_key(o))}; {HELP_HINT}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=run_as or "app"):
            cfg = GlobalHydra.instance().hydra.compose_config(
                config_name="config", overrides=list(overrides), run_mode=RunMode.RUN, from_shell=False,
                with_log_configuration=False)
            if run_as is None:
                with open_dict(cfg):
                    del cfg["hydra"]
            return cfg
    except Exception as e:  # noqa: BLE001  (Hydra and OmegaConf errors of every kind)
        raise ConfigError(explain(e, overrides)) from None
    finally:
        GlobalHydra.instance().clear()


def task_config(cfg: DictConfig) -> DictConfig:
    """A copy of a run config (:func:`compose` with ``run_as``) without its ``hydra`` node."""
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


# ---- validation ---------------------------------------------------------------------------------
def split_launcher(cfg: DictConfig) -> tuple:
    """(a copy of cfg without ``launcher``, the validated LauncherConfig)."""
    cfg = cfg.copy()
    node = None
    if "launcher" in cfg:
        with open_dict(cfg):
            node = cfg.pop("launcher")
    base = OmegaConf.structured(LauncherConfig)
    launcher = OmegaConf.to_object(OmegaConf.merge(base, node) if node is not None else base)
    return cfg, launcher.validate()


def default_threads(env: Mapping[str, str] = os.environ) -> Tuple[int, str]:
    """(threads per rank, how they were chosen): the cores this process may use divided by the
    ranks on this node (LOCAL_WORLD_SIZE), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))
    n = max(1, cores // local)
    return n, f"{cores} cores / {local} local ranks"


def resolve_defaults(job: JobConfig, env: Mapping[str, str] = os.environ) -> List[str]:
    """Fill the fields whose default depends on the run (train.threads=0, a warmup longer than
    the run); returns one notice line per choice made."""
    notices = []
    t, o = job.train, job.optim
    if t.threads == 0:
        t.threads, how = default_threads(env)
        notices.append(f"train.threads={t.threads} per rank ({how}; set train.threads to change)")
    if (isinstance(o.warmup_steps, int) and isinstance(t.max_steps, int) and 0 < t.max_steps <= o.warmup_steps):
        new = t.max_steps // 10
        notices.append(f"optim.warmup_steps={o.warmup_steps} >= train.max_steps={t.max_steps}: "
                       f"warming up for {new} steps (train.max_steps // 10)")
        o.warmup_steps = new
    return notices


def to_job(cfg: DictConfig, world_size: Optional[int] = None, notices: Optional[list] = None,
           env: Mapping[str, str] = os.environ) -> JobConfig:
    """The validated JobConfig of ``cfg`` on ``world_size`` ranks (default: WORLD_SIZE or 1);
    the defaults it resolved are appended to ``notices``."""
    cfg, _ = split_launcher(cfg)
    try:
        job = OmegaConf.to_object(cfg)
    except Exception as e:  # noqa: BLE001  (interpolation and type errors of OmegaConf)
        raise ConfigError(explain(e, [])) from None
    assert isinstance(job, JobConfig)
    if world_size is None:
        world_size = int(env.get("WORLD_SIZE", "1"))
    found = resolve_defaults(job, env)
    if notices is not None:
        notices += found
    job.validate(world_size=world_size)
    t, dp = job.train, job.parallel.resolved_dp(world_size)
    if t.global_batch_size % (t.micro_batch_size * dp):  # the trainer's rule, checked before ranks start
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be a multiple of "
                          f"train.micro_batch_size x dp = {t.micro_batch_size} x {dp}")
    return job


def check_local(job: JobConfig) -> None:
    """What this machine must provide for the job: CUDA when asked for, apex / DeepSpeed when asked
    for (model.norm_impl=apex, optim.offload_impl=deepspeed), the dataset and tokenizer files, the
    checkpoint to resume from. Reads, never writes."""
    from ..data.config import DEMOS, resolve_dataset

    if job.train.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but CUDA is not available; use train.device=cpu or auto")
    from ..model.norm import norm_impl_error  # optional kernels asked for: present on this machine?
    from ..optim.config import offload_error

    err = norm_impl_error(job.model.norm_impl) or offload_error(job.optim)
    if err:
        raise ConfigError(err)
    if job.data.path not in DEMOS:
        _, tok = resolve_dataset(job.data)
        from ..data.tokenizer import load_tokenizer

        n = load_tokenizer(tok).vocab_size
        if n > job.model.vocab_size:
            raise ConfigError(f"tokenizer {tok} has {n} tokens but model.vocab_size={job.model.vocab_size}; "
                              "raise model.vocab_size or use the tokenizer the model was built for")
    if job.train.init_from_hf:
        from ..interop.hf_load import check_hf_dir

        check_hf_dir(job.train.init_from_hf)
    r = job.train.resume
    if r not in ("none", "auto") and not os.path.isdir(os.path.expanduser(r)):
        raise ConfigError(f"train.resume={r}: no such checkpoint directory; give RUN_DIR/checkpoints/step_XXXXXXXX, "
                          "'auto' (the newest in train.run_dir) or 'none'")


def world_of(cfg: DictConfig, env: Mapping[str, str] = os.environ) -> int:
    """The ranks this job runs on: WORLD_SIZE inside torchrun/SLURM, else the launcher's count."""
    if inside_launcher(env):
        return int(env.get("WORLD_SIZE", "1"))
    _, launcher = split_launcher(cfg)
    if launcher.nnodes > 1:
        raise ConfigError(f"launcher.nnodes={launcher.nnodes}: multi-node jobs start through SLURM "
                          "(tools/launch.py --slurm); locally use launcher.nnodes=1")
    return launcher.resolved_nproc(cfg.parallel)


def _check_sweep(overrides: Sequence[str]) -> None:
    """Compose every value of every swept key once (the other keys at their first value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as e:  # noqa: BLE001
        raise ConfigError(explain(e, overrides)) from None
    first = []
    for o in parsed:
        vals = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
        first.append([f"{o.get_key_element()}={v}" for v in vals] if o.value_type is not None else [o.input_line])
    compose([vals[0] for vals in first])
    for i, vals in enumerate(first):
        for v in vals[1:]:
            compose([v if j == i else other[0] for j, other in enumerate(first)])


def prepare(cfg: DictConfig, env: Mapping[str, str] = os.environ, local: bool = True,
            notices: Optional[list] = None) -> JobConfig:
    """The validated JobConfig of a composed ``cfg`` (no ``hydra`` node) on the ranks it runs on
    (:func:`world_of`), checked against this machine unless ``local=False``; the defaults it
    resolved are appended to ``notices``. A user error is a one-line ConfigError (a multi-rank
    layout started as one process says how to start its ranks)."""
    world = None
    try:
        world = world_of(cfg, env)
        job = to_job(cfg, world_size=world, notices=notices, env=env)
        if local:
            check_local(job)
    except ValueError as e:
        msg = one_line(e)
        if world == 1 and "world_size=1" in msg:  # a multi-rank layout started as one process
            msg += ("; to start N ranks: python -m megak3.launch.torchrun --standalone --nproc-per-node N "
                    "-m megak3.train ..., or add launcher.nproc_per_node=N")
        raise ConfigError(msg) from None
    return job


def check(argv: Sequence[str], env: Mapping[str, str] = os.environ, local: bool = True) -> Tuple[int, Optional[str]]:
    """What ``python -m megak3.train ARGV`` says about its input before any work:
    (0, None) or (2, the one-line error). A sweep (``-m``) checks that every value composes;
    Hydra's own flags (``--cfg``, ``--info``, ...) are left to Hydra. ``local=False`` skips
    :func:`check_local` (a config meant for another machine). (``python -m megak3.train`` itself
    checks a single run in :func:`prepare` on the config it runs, composed once.)"""
    argv = list(argv)
    if any(a.startswith("-") and a not in HYDRA_FLAGS_OK for a in argv):
        return 0, None
    overrides = [a for a in argv if a not in HYDRA_FLAGS_OK]
    try:
        if len(overrides) < len(argv):
            _check_sweep(overrides)
        else:
            prepare(compose(overrides), env=env, local=local)
    except ValueError as e:
        return 2, one_line(e)
    return 0, None
