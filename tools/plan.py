#!/usr/bin/env python
"""Memory / FLOPs / communication / step-time planner for a K3 layout (megak3/launch/planner.py).

    python tools/plan.py model=k3_full parallel.tp=8 parallel.pp=16 parallel.ep=64 world_size=2048 gpu=h200
    python tools/plan.py model=k3_full world_size=2048 gpu=h200 --search      # top three layouts
    python tools/plan.py model=k3_tiny world_size=4 parallel.tp=2 gpu=cpu train.precision=fp32 --json
    python tools/plan.py --calibrate        # re-derive the activation coefficients on this machine

Arguments (key=value): model=NAME and model.FIELD=VALUE (conf/model/), parallel.{tp,pp,ep,dp,
sequence_parallel,pp_schedule,vp}, world_size, gpu (conf/hardware/: h100, h200, b200, cpu), data.seq_len,
train.{micro_batch_size,global_batch_size,precision,activation_checkpointing}, param_dtype
(fp32 as the trainer runs, or bf16). Exit status 0; 1 when the layout does not fit; 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2 ** 30
KEYS = {"parallel.tp": ("tp", int), "parallel.pp": ("pp", int), "parallel.ep": ("ep", int),
        "parallel.dp": ("dp", int), "parallel.sequence_parallel": ("sequence_parallel", "bool"),
        "world_size": ("world_size", int), "data.seq_len": ("seq_len", int),
        "train.micro_batch_size": ("micro_batch_size", int), "train.global_batch_size": ("global_batch_size", int),
        "train.precision": ("precision", str), "train.activation_checkpointing": ("activation_checkpointing", "bool"),
        "param_dtype": ("param_dtype", str), "parallel.pp_schedule": ("pp_schedule", str),
        "parallel.vp": ("vp", int)}


def _bool(key, v):
    if v.lower() in ("true", "1", "yes"):
        return True
    if v.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"{key}={v!r} must be true or false")


def parse_overrides(items):
    """(model name, model overrides, PlanConfig kwargs, gpu name) from key=value strings."""
    model, model_over, kw, gpu = "k3_full", {}, {}, "h200"
    for it in items:
        if "=" not in it:
            raise ValueError(f"argument {it!r} is not key=value (e.g. parallel.tp=8)")
        k, v = it.split("=", 1)
        if k == "model":
            model = v
        elif k.startswith("model."):
            import yaml

            model_over[k[6:]] = yaml.safe_load(v)
        elif k == "gpu":
            gpu = v
        elif k in KEYS:
            name, typ = KEYS[k]
            try:
                kw[name] = _bool(k, v) if typ == "bool" else typ(v)
            except ValueError:
                raise ValueError(f"{k}={v!r} must be {'true/false' if typ == 'bool' else typ.__name__}") from None
        else:
            raise ValueError(f"unknown key {k!r}; use one of model, model.FIELD, gpu, {', '.join(KEYS)}")
    return model, model_over, kw, gpu


def _g(b):
    return f"{b / GiB:8.2f} GiB"


def format_plan(p) -> str:
    L, m, t, f, c = p["layout"], p["memory"], p["time"], p["flops_per_token"], p["comm_bytes_per_step"]
    lines = [f"layout tp={L['tp']} pp={L['pp']} ep={L['ep']} dp={L['dp']} (edp={L['edp']}) on {L['world_size']} x "
             f"{p['hardware']}; sp={L['sequence_parallel']} micro_batch={L['micro_batch_size']} x seq {L['seq_len']}, "
             f"global batch {L['global_batch_size']} ({L['micro_batches']} micro-batches, {L['pp_schedule']}"
             f"{' vp=' + str(L['vp']) if L['vp'] > 1 else ''}), "
             f"act ckpt={L['activation_checkpointing']}, {L['precision']} activations, {L['param_dtype']} params",
             f"memory per rank (stage {m['stage']}, layers {m['layers'][0]}-{m['layers'][1] - 1}, "
             f"{m['in_flight_micro_batches']} micro-batches in flight):",
             f"  params           {_g(m['params'])}   ({m['local_params'] / 1e9:.2f} B local)",
             f"  grads            {_g(m['grads'])}",
             f"  main fp32 copies {_g(m['main_params'])}",
             f"  optimizer state  {_g(m['optimizer_state'])}   (ZeRO-1: Muon momentum / AdamW moments, owned share)",
             f"  activations      {_g(m['activations'])}   (without checkpointing: {_g(m['activations_no_checkpointing']).strip()})"]
    lines += [f"    no-ckpt, per micro-batch {k:<14} {_g(v)}" for k, v in m["activations_by_kind_per_micro_batch"].items()]
    lines += [f"  KDA chunk states {_g(m['kda_states'])}   (inside activations)",
              f"  MoonEP buffers   {_g(m['moonep_buffers'])}",
              f"  autocast copies  {_g(m['autocast_weight_copies'])}",
              f"  comm buckets     {_g(m['comm_buffers'])}",
              f"  bwd transient    {_g(m['backward_transient'])}",
              f"  total            {_g(m['total'])}   of {p['usable_memory'] / GiB:.1f} GiB usable -> "
              f"{'FITS' if p['fits'] else 'DOES NOT FIT'}",
              f"FLOPs per token (forward): {f['forward'] / 1e9:.1f} G = matmul {f['matmul_forward'] / 1e9:.1f} G "
              f"(2 x {f['active_params'] / 1e9:.2f} B active) + MLA scores {f['mla_scores'] / 1e9:.2f} G + KDA "
              f"{f['kda_recurrence'] / 1e9:.2f} G; training {f['train'] / 1e9:.1f} G/token"
              + (f"; vision {f['vision_per_patch_forward'] / 1e9:.2f} G per patch" if "vision_per_patch_forward" in f else ""),
              "comm per rank per step: " + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in c.items()),
              f"step time {t['step_s']:.2f} s = (compute {t['compute_s']:.2f} + tp {t['tp_s']:.2f} + ep {t['ep_s']:.2f} "
              f"+ pp {t['pp_s']:.2f}) x bubble {t['bubble']:.2f} + dp exposed {t['dp_exposed_s']:.2f}; "
              f"{t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f}%"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--search", action="store_true", help="print the top three layouts for world_size")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--calibrate", action="store_true", help="re-derive the activation coefficients (CPU, ~1 min)")
    args = ap.parse_args(argv)
    from megak3.config import load_model_config
    from megak3.launch import planner
    from megak3.launch.hardware import load_hardware

    if args.calibrate:
        from megak3.launch.calibrate import fit

        print(json.dumps({p: fit(p) for p in ("fp32", "bf16")}, indent=1))
        return 0
    try:
        model, mo, kw, gpu = parse_overrides(args.overrides)
        cfg = load_model_config(model, **mo)
        hw = load_hardware(gpu)
        if args.search:
            base = planner.PlanConfig(**{k: v for k, v in kw.items() if k not in ("tp", "pp", "ep", "dp")})
            plans = planner.search(cfg, base.world_size, hw, top=args.top, base=base)
            if not plans:
                print(f"no layout of {base.world_size} x {hw.name} fits {cfg.name}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(plans, default=str))
            else:
                for i, p in enumerate(plans, 1):
                    L, t = p["layout"], p["time"]
                    print(f"#{i} tp={L['tp']} pp={L['pp']} ep={L['ep']} dp={L['dp']} micro_batch={L['micro_batch_size']}: "
                          f"{t['tokens_per_s']:,.0f} tokens/s, step {t['step_s']:.2f} s, MFU {100 * t['mfu']:.1f}%, "
                          f"{p['memory']['total'] / GiB:.1f} GiB/rank")
            return 0
        p = planner.make_plan(cfg, planner.PlanConfig(**kw), hw)
    except ValueError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p, default=str) if args.json else format_plan(p))
    return 0 if p["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
