"""``python -m megak3.train --help``: usage, then every config group with its options and every
field with its type, default value (the default config's) and docstring."""
from __future__ import annotations

from omegaconf import OmegaConf

from ..config import CONF_DIR
from ..job.compose import compose, groups
from ..job.fields import schema_fields, sections
from ..job.launcher import LaunchJobConfig

HEAD = """usage: python -m megak3.train [GROUP=OPTION ...] [FIELD=VALUE ...]
       python -m megak3.train -m FIELD=A,B ...          a sweep: one job (and one torchrun) per value
       python -m megak3.launch.torchrun --standalone --nproc-per-node N -m megak3.train [OVERRIDES ...]

Pretrain a Kimi-K3-architecture model (Hydra app; defaults: conf/config.yaml). Overrides pick a
group's option (parallel=tp2_sp) or set a field (train.max_steps=100). Bad input stops before any
work with one line and exit status 2; a preempted run (SIGTERM / SIGUSR1) saves a checkpoint and
exits 75. Hydra's own flags: --cfg job, --info, --hydra-help."""


def _default_choices() -> dict:
    out = {}
    for item in OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml")).get("defaults", []):
        if isinstance(item, dict):
            out.update(item)
    return out


def usage() -> str:
    cfg = compose([])
    choices = _default_choices()
    fields = schema_fields(LaunchJobConfig)
    lines = [HEAD]
    for name, doc in sections(LaunchJobConfig):
        opts = groups().get(name, [])
        where = f" (conf/{name}/: {', '.join(opts)}; default {choices.get(name)})" if opts else ""
        lines += ["", f"{name}{where}: {doc.replace(f' (conf/{name}/)', '')}"]
        rows = [(f.name, f.type, OmegaConf.select(cfg, f.name), f.doc) for f in fields
                if f.name.split(".", 1)[0] == name]
        width = max(len(f"{n}={v}") for n, _, v, _ in rows)
        for n, tp, v, d in rows:
            v = "null" if v is None else str(v).lower() if isinstance(v, bool) else v
            lines.append(f"  {f'{n}={v}':<{width}}  {tp}: {d}")
    recipes = groups().get("experiment", [])
    if recipes:
        lines += ["", f"experiment (conf/experiment/: {', '.join(recipes)}; default none): a named recipe that sets "
                  "several groups and fields at once (each file's first lines say what it runs); later overrides win"]
    return "\n".join(lines)
