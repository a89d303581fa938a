#!/usr/bin/env python
"""Print every process group of every axis of a parallel layout (dense and expert grids).

    python tools/layout.py world_size=64 parallel.tp=4 parallel.pp=2 parallel.ep=8
    python tools/layout.py world_size=8 parallel.tp=2 parallel.cp=2 parallel.order=tp-cp-ep-dp-pp --ranks
    python tools/layout.py world_size=16 parallel.tp=2 parallel.pp=4 model=none --json

Keys: world_size (default 1); parallel.{tp,cp,dp,pp,ep,etp,order} (dp=0 or absent: derived as
world_size / (tp*cp*pp)); model=NAME (conf/model/NAME.yaml, default k3_full; `none` skips the
model divisibility checks) and model.FIELD=VALUE overrides. --ranks adds a table of every rank's
coordinates (world_size <= 64); --json prints {layout, dense, expert, coords} instead of text.
An invalid layout prints one line naming the field and exits with status 2.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.config import ParallelConfig  # noqa: E402

_INT_FIELDS = ("tp", "cp", "dp", "pp", "ep", "etp")


class _UsageError(ValueError):
    pass


def _int(key: str, val: str) -> int:
    try:
        return int(val)
    except ValueError:
        raise _UsageError(f"{key}={val!r} must be an integer") from None


def _parse(argv):
    world, par, model, overrides, flags = 1, {}, "k3_full", {}, set()
    for arg in argv:
        if arg in ("--json", "--ranks"):
            flags.add(arg)
            continue
        key, sep, val = arg.partition("=")
        if not sep:
            raise _UsageError(f"expected key=value, --json or --ranks, got {arg!r}")
        if key == "world_size":
            world = _int(key, val)
        elif key.startswith("parallel.") and key[9:] in _INT_FIELDS:
            par[key[9:]] = _int(key, val)
        elif key == "parallel.order":
            par["order"] = val
        elif key == "model":
            model = val
        elif key.startswith("model."):
            overrides[key[6:]] = val
        else:
            raise _UsageError(f"unknown argument {key!r}; use world_size=, parallel.{{tp,cp,dp,pp,ep,"
                              "etp,order}=, model=NAME or model.FIELD=")
    if world < 1:
        raise _UsageError(f"world_size={world} must be >= 1")
    return world, ParallelConfig(**par), model, overrides, flags


def _fmt(groups) -> str:
    return " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)


def _text(layout, model: str, ranks: bool) -> str:
    L = layout
    lines = [f"world_size={L.world_size} order={L.order} model={model}",
             f"dense  grid: tp={L.tp} cp={L.cp} dp={L.dp} pp={L.pp}",
             f"expert grid: etp={L.etp} ep={L.ep} edp={L.edp} pp={L.pp}"]
    for title, groups in (("dense", L.dense_groups()), ("expert", L.expert_groups())):
        lines.append(f"{title} groups:")
        for axis, gs in groups.items():
            body = "(every rank alone)" if len(gs[0]) == 1 else _fmt(gs)
            lines.append(f"  {axis:<9}{len(gs):>4} x {len(gs[0]):<4} {body}")
    if ranks:
        axes = ("tp", "cp", "dp", "pp", "etp", "ep", "edp")
        lines.append("rank " + " ".join(f"{a:>4}" for a in axes))
        for r in range(L.world_size):
            c = L.coords(r)
            lines.append(f"{r:>4} " + " ".join(f"{c[a]:>4}" for a in axes))
    return "\n".join(lines)


def main(argv) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        world, cfg, model, overrides, flags = _parse(argv)
        model_cfg = None
        if model != "none":
            from megak3.config import load_model_config

            model_cfg = load_model_config(model, **overrides)
        layout = cfg.validate(world, model_cfg).to_layout(world)
        if "--ranks" in flags and world > 64 and "--json" not in flags:
            raise _UsageError(f"--ranks prints a table for world_size <= 64, not {world}")
    except ValueError as e:
        print(f"layout: {e}", file=sys.stderr)
        return 2
    if "--json" in flags:
        out = {"layout": {"world_size": world, "tp": layout.tp, "cp": layout.cp, "dp": layout.dp,
                          "pp": layout.pp, "ep": layout.ep, "etp": layout.etp, "edp": layout.edp,
                          "order": layout.order, "model": model},
               "dense": layout.dense_groups(), "expert": layout.expert_groups(),
               "coords": [layout.coords(r) for r in range(world)]}
        print(json.dumps(out))
    else:
        print(_text(layout, model, "--ranks" in flags))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
