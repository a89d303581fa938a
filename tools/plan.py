#!/usr/bin/env python
"""Memory / FLOPs / communication / step-time planner for a K3 layout (megak3/launch/planner/).

    python tools/plan.py model=k3_full world_size=2048 gpu=h200                # the best layout on 2048 GPUs
    python tools/plan.py model=k3_full parallel.tp=8 parallel.pp=16 parallel.ep=64 world_size=2048 gpu=h200
    python tools/plan.py model=k3_full world_size=2048 gpu=h200 --search      # top three layouts
    python tools/plan.py model=k3_full gpu=h200 --min-gpus data.seq_len=8192  # smallest GPU count that fits
    python tools/plan.py model=k3_tiny world_size=4 parallel.tp=2 gpu=cpu train.precision=fp32 --json
    python tools/plan.py --calibrate        # re-derive the activation coefficients on this machine

Arguments (key=value): model=NAME and model.FIELD=VALUE (conf/model/), parallel.{tp,pp,ep,dp,cp,
cp_balance,cp_balance_split,sequence_parallel,pp_schedule,vp,pp_split_blocks,pp_layout}, world_size, gpu (conf/hardware/: h100,
h200, b200, cpu), data.seq_len, train.{micro_batch_size,global_batch_size,precision,
activation_checkpointing}, param_dtype (fp32 as the trainer runs, or bf16), model.moe.qb_method
(auto | exact | histogram), model.moe.qb_bins, moonep.{enabled,max_replicas_per_rank}, data.vision_fraction (share of the
tokens that are image tokens, default 0: text only) and data.image_side (pixels of the square images
assumed; default the position grid, 896 at K3): the vision tower's activations on the first stage,
its FLOPs in the step time and its token all-gather under TP, optim.offload (none | cpu: the AdamW
state leaves the device; host memory, PCIe and host-update time are printed). Without parallel.tp/pp/ep/dp/cp
the plan is the best layout --search finds (cp included: powers of two leaving >= 4096 tokens per
CP rank, e.g. --min-gpus data.seq_len=1048576 finds the million-token layouts).
Without train.global_batch_size every plan, search and minimum assumes ~4 Mi tokens per step
(1024 x 4096), rounded up to whole rounds of micro_batch_size x dp, and prints it.
The job config keys above are the fields PlanConfig mirrors (megak3/launch/planner/config.py, each
names its key once); their values are typed and checked by the job config's own dataclasses, with
the trainer's one-line errors. Unset, they take the planner's defaults (a production plan: bf16,
activation checkpointing, SP, micro-batch 1, seq 4096), not the job config's.
Exit status 0; 1 when the layout does not fit (or nothing fits); 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2 ** 30
LAYOUT_KEYS = ("tp", "pp", "ep", "dp", "cp")


def job_from_overrides(items):
    """The JobConfig of its dataclass defaults with ``items`` (job config ``key=value`` strings) set,
    each value typed and checked by the job config's own field types as the trainer's composition
    does (OmegaConf's structured config; its errors in megak3.job.compose's one-line wording). No
    Hydra composition, validation or data checks: a plan needs no dataset."""
    from omegaconf import OmegaConf

    from megak3.job.compose import explain
    from megak3.job.config import JobConfig

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.from_dotlist(items)))
    except Exception as e:  # noqa: BLE001  (OmegaConf's type and parse errors)
        raise ValueError(explain(e, items)) from None


def parse_overrides(items):
    """(model name, model overrides, PlanConfig, gpu name, names of the PlanConfig fields given) from
    key=value strings: the job config keys PlanConfig mirrors (PlanConfig.job_keys()) through
    job_from_overrides and PlanConfig.from_job, the planner's own (PlanConfig.arg_keys()) typed by
    PlanConfig's fields, other model.FIELD keys as the model config's overrides."""
    import typing

    import yaml

    from megak3.launch.planner import PlanConfig

    job_keys, arg_keys = PlanConfig.job_keys(), PlanConfig.arg_keys()
    types = typing.get_type_hints(PlanConfig)
    model, model_over, job_items, kw, gpu = "k3_full", {}, [], {}, "h200"
    for it in items:
        if "=" not in it:
            raise ValueError(f"argument {it!r} is not key=value (e.g. parallel.tp=8)")
        k, v = it.split("=", 1)
        if k == "model":
            model = v
        elif k == "gpu":
            gpu = v
        elif k in job_keys:
            job_items.append(it)
        elif k in arg_keys:
            typ = types[arg_keys[k]]
            try:
                kw[arg_keys[k]] = typ(v)
            except ValueError:
                raise ValueError(f"{k}={v!r} must be {typ.__name__}") from None
        elif k.startswith("model."):
            model_over[k[6:]] = yaml.safe_load(v)
        else:
            raise ValueError(f"unknown key {k!r}; use one of model, model.FIELD, gpu, "
                             f"{', '.join(list(arg_keys) + list(job_keys))}")
    given = {job_keys[it.split("=", 1)[0]] for it in job_items}
    job = job_from_overrides(job_items)
    pc = PlanConfig.from_job(job, keys=[it.split("=", 1)[0] for it in job_items], **kw)
    return model, model_over, pc, gpu, given | set(kw)


def _g(b):
    return f"{b / GiB:8.2f} GiB"


def _layers(chunks):
    return ", ".join(f"{a}-{b - 1}" for a, b in chunks)


def batch_line(L) -> str:
    src = ("default: ~4 Mi tokens per step, set train.global_batch_size= to change"
           if L["global_batch_default"] else "train.global_batch_size")
    return (f"global batch {L['global_batch_size']} sequences x {L['seq_len']} tokens = "
            f"{L['tokens_per_step'] / 1e6:.2f} M tokens per step ({src})")


def _cp(L) -> str:
    return f" cp={L['cp']}" if L.get("cp", 1) > 1 else ""


def short_line(p) -> str:
    L, t = p["layout"], p["time"]
    return (f"tp={L['tp']}{_cp(L)} pp={L['pp']} ep={L['ep']} dp={L['dp']} micro_batch={L['micro_batch_size']} "
            f"global_batch={L['global_batch_size']}: {t['tokens_per_s']:,.0f} tokens/s, step {t['step_s']:.2f} s, "
            f"MFU {100 * t['mfu']:.1f}%, {p['memory']['total'] / GiB:.1f} GiB/rank")


def format_plan(p) -> str:
    L, m, t, f, c = p["layout"], p["memory"], p["time"], p["flops_per_token"], p["comm_bytes_per_step"]
    lines = [f"layout tp={L['tp']}{_cp(L)} pp={L['pp']} ep={L['ep']} dp={L['dp']} (edp={L['edp']}) on {L['world_size']} x "
             f"{p['hardware']}; sp={L['sequence_parallel']} micro_batch={L['micro_batch_size']} x seq {L['seq_len']} "
             f"({L['micro_batches']} micro-batches per step, {L['pp_schedule']}"
             f"{' vp=' + str(L['vp']) if L['vp'] > 1 else ''}"
             f"{', stages split inside AttnRes blocks' if L['pp_split_blocks'] else ''}), "
             f"act ckpt={L['activation_checkpointing']}, {L['precision']} activations, {L['param_dtype']} params",
             batch_line(L),
             f"memory per rank (stage {m['stage']}, layers {_layers(m['layers'])}, "
             f"{m['in_flight_micro_batches']:g} micro-batches in flight):",
             f"  params           {_g(m['params'])}   ({m['local_params'] / 1e9:.2f} B local)",
             f"  grads            {_g(m['grads'])}",
             f"  main fp32 copies {_g(m['main_params'])}",
             f"  optimizer state  {_g(m['optimizer_state'])}   (ZeRO-1: Muon momentum / AdamW moments, owned share"
             + ("; AdamW's in host memory" if "host_bytes" in m else "") + ")",
             f"  activations      {_g(m['activations'])}   (without checkpointing: {_g(m['activations_no_checkpointing']).strip()})"]
    lines += [f"    no-ckpt, per micro-batch {k:<14} {_g(v)}" for k, v in m["activations_by_kind_per_micro_batch"].items()]
    cps = m.get("cp_saved_per_micro_batch", {})
    if L.get("cp", 1) > 1:
        lines.append(f"    CP, per micro-batch: KDA summaries/identity block {_g(cps.get('kda', 0)).strip()}, MLA "
                     f"prefix keys {_g(cps.get('mla', 0)).strip()} ("
                     + ("gathered latent + one expanded key block and the computed query blocks, balanced schedule"
                        if L.get("cp_balance") else f"latent + fp32 K/V of the last CP rank's {L['seq_len']} keys")
                     + "; inside the above)")
    if "vision" in p:
        v = p["vision"]
        h, w = v["image_patches"]
        where = "inside activations" if m["stage"] == 0 else "stage 0, not the stage above"
        kept = "blocks recomputed" if L["activation_checkpointing"] else "not checkpointed"
        lines.append(f"  vision tower     {_g(v['activations_stage0'])}   ({where}; {kept}: {v['images_per_rank']} "
                     f"image(s) of {h}x{w} patches per rank per micro-batch x {p['stages'][0]['in_flight_micro_batches']:g} "
                     f"in flight, {v['activation_bytes_per_image'] / GiB:.2f} GiB each)")
    lines += [f"  KDA chunk states {_g(m['kda_states'])}   (inside activations)",
              f"  MoonEP buffers   {_g(m['moonep_buffers'])}",
              f"  MoonEP replicas  {_g(m['moonep_replica_buffers'])}   ({m['moonep_replica_buffer_count']} persistent "
              f"[E/ep + {m['moonep_replica_slots']} slots, 3 x latent x expert width] buffer(s) shared by the MoE "
              f"layers, compute dtype)",
              f"  QB statistics    {_g(m['qb_stats'])}   ({m['qb_method']}, {m['moe_layers']} MoE layers"
              + (f"; + {m['qb_transient'] / GiB:.2f} GiB gathered at the step end" if m["qb_transient"] else "") + ")",
              f"  autocast copies  {_g(m['autocast_weight_copies'])}",
              f"  comm buckets     {_g(m['comm_buffers'])}",
              f"  bwd transient    {_g(m['backward_transient'])}",
              f"  total            {_g(m['total'])}   of {p['usable_memory'] / GiB:.1f} GiB usable -> "
              f"{'FITS' if p['fits'] else 'DOES NOT FIT'}"]
    if "host_bytes" in m:
        lines.append(f"  host memory      {_g(m['host_bytes'])}   (optim.offload=cpu: AdamW moments "
                     f"{m['optimizer_state_host'] / GiB:.2f} GiB + fp32 weight/grad copies; per step "
                     f"{m['pcie_bytes_per_step'] / GiB:.2f} GiB over PCIe, {m['host_update_bytes_per_step'] / GiB:.2f} "
                     f"GiB through host memory)")
    lines += [
              f"FLOPs per token (forward): {f['forward'] / 1e9:.1f} G = matmul {f['matmul_forward'] / 1e9:.1f} G "
              f"(2 x {f['active_params'] / 1e9:.2f} B active) + MLA scores {f['mla_scores'] / 1e9:.2f} G + KDA "
              f"{f['kda_recurrence'] / 1e9:.2f} G; training {f['train'] / 1e9:.1f} G/token"
              + (f"; vision {f['vision_per_patch_forward'] / 1e9:.2f} G per patch" if "vision_per_patch_forward" in f else ""),
              f"comm per rank per step (stage {p['comm_stage']}, the slowest"
              f"{', recompute forward counted' if L['activation_checkpointing'] else ''}): "
              + ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in c.items() if k != "cp" or L.get("cp", 1) > 1)
              + (f" (cp: KDA summaries + halos {p['cp_comm_bytes_per_step']['kda'] / GiB:.2f} GiB, MLA latent "
                 f"{p['cp_comm_bytes_per_step']['mla'] / GiB:.2f} GiB)" if L.get("cp", 1) > 1 else ""),
              f"step time {t['step_s']:.2f} s = (compute {t['compute_s']:.2f} + tp {t['tp_s']:.2f} + ep {t['ep_s']:.2f} "
              + (f"+ cp {t['cp_s']:.2f} " if L.get("cp", 1) > 1 else "")
              + f"+ pp {t['pp_s']:.2f}) x bubble {t['bubble']:.2f} + tp grad sync {t['tp_grad_sync_s']:.2f} "
              f"+ dp exposed {t['dp_exposed_s']:.2f} + QB {t['qb_s']:.2f}"
              + (f" + offload {t['offload_s']:.2f}" if "offload_s" in t else "") + "; "
              f"{t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f}%",
              f"train with: {p['trainer_overrides']}"]
    if "vision" in p:
        v = p["vision"]
        lines.insert(-1, f"vision: {100 * v['fraction']:g}% of tokens, {v['tokens_per_image']} tokens per "
                         f"{v['image_side']}px image, {v['images_per_step']:g} images per step ({v['images_per_s']:,.1f}/s); "
                         f"{v['flops_per_patch_forward'] / 1e9:.2f} GFLOP per patch forward, stage-0 compute "
                         f"+{v['compute_s']:.3f} s, TP token gather {v['gather_bytes_per_step'] / GiB:.2f} GiB per step")
    return "\n".join(lines)


def _cmd(model, gpu, extra, world=None):
    parts = ["python tools/plan.py", f"model={model}", f"gpu={gpu}"] + ([f"world_size={world}"] if world else [])
    return " ".join(parts + extra.split())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value settings (see above)")
    ap.add_argument("--search", action="store_true", help="print the top layouts for world_size, fastest first")
    ap.add_argument("--top", type=int, default=3, help="how many layouts --search prints (default 3)")
    ap.add_argument("--min-gpus", action="store_true",
                    help="the smallest GPU count (powers of two, then multiples of the node size) on which some "
                         "layout fits this model, sequence length and hardware, with that layout")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    ap.add_argument("--calibrate", action="store_true", help="re-derive the activation coefficients (CPU, ~1 min)")
    args = ap.parse_intermixed_args(argv)
    from dataclasses import replace

    from megak3.config import load_model_config
    from megak3.launch import planner
    from megak3.launch.hardware import load_hardware

    if args.calibrate:
        from megak3.launch.calibrate import fit

        print(json.dumps({p: fit(p) for p in ("fp32", "bf16")}, indent=1))
        return 0
    try:
        model, mo, pc, gpu, given = parse_overrides(args.overrides)
        cfg = load_model_config(model, **mo)
        hw = load_hardware(gpu)
        extras = " ".join(a for a in args.overrides if not a.startswith(("model=", "gpu=", "world_size=")))
        base = replace(pc, **{k: getattr(planner.PlanConfig, k) for k in LAYOUT_KEYS})  # the layout's defaults
        replace(base, global_batch_size=0).resolved()  # bad precision / schedule values fail before any search
        if args.min_gpus:
            res = planner.min_gpus(cfg, hw, base=replace(base, world_size=1))
            if args.json:
                print(json.dumps(res, default=str))
                return 0 if res else 1
            if res is None:
                print(f"no layout up to 131072 x {hw.name} fits {cfg.name} at seq {base.seq_len}", file=sys.stderr)
                return 1
            p, w = res["plan"], res["world_size"]
            print(f"minimum GPUs for {cfg.name}, seq {base.seq_len}, {hw.name}: {w} "
                  f"(smallest power of two: {res['power_of_two']})")
            print(f"  layout: {short_line(p)}")
            print(f"  {batch_line(p['layout'])}")
            print("  tried: " + ", ".join(f"{k} {'fits' if v else 'no'}" for k, v in res["tried"].items()))
            print(f"  plan it: {_cmd(model, gpu, p['trainer_overrides'], w)}")
            return 0
        if args.search:
            plans = planner.search(cfg, base.world_size, hw, top=args.top, base=base)
            if not plans:
                print(f"no layout of {base.world_size} x {hw.name} fits {cfg.name}; find the smallest GPU count "
                      f"with: {_cmd(model, gpu, extras + ' --min-gpus')}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(plans, default=str))
            else:
                print(f"{cfg.name} on {base.world_size} x {hw.name}, seq {base.seq_len}; "
                      + ("each layout at its default global batch (~4 Mi tokens per step)" if not base.global_batch_size
                         else f"global batch {base.global_batch_size}"))
                for i, p in enumerate(plans, 1):
                    print(f"#{i} {short_line(p)}")
            return 0
        layout_given = any(k in given for k in LAYOUT_KEYS)
        if not layout_given:
            best = planner.search(cfg, base.world_size, hw, top=1, base=base)
            if not best:
                print(f"no layout of {base.world_size} x {hw.name} fits {cfg.name} at seq {base.seq_len}; the smallest "
                      f"GPU count that fits: {_cmd(model, gpu, extras + ' --min-gpus')}", file=sys.stderr)
                return 1
            p = best[0]
        else:
            p = planner.make_plan(cfg, pc, hw)
    except ValueError as e:
        print(f"plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(p, default=str))
        return 0 if p["fits"] else 1
    if not layout_given:
        print(f"no parallel.tp/pp/ep/dp/cp given: the best layout on {base.world_size} x {hw.name} (what --search ranks "
              f"first); give parallel.* to plan another")
    print(format_plan(p))
    if not p["fits"]:
        W = p["layout"]["world_size"]
        best = planner.search(cfg, W, hw, top=1, base=base)
        if best:
            print(f"this layout does not fit; the best one that does on {W} x {hw.name}: {short_line(best[0])}\n"
                  f"  (all: {_cmd(model, gpu, extras_without_layout(args.overrides) + ' --search', W)})")
        else:
            print(f"this layout does not fit and no layout of {W} x {hw.name} does; the smallest GPU count that fits: "
                  f"{_cmd(model, gpu, extras_without_layout(args.overrides) + ' --min-gpus')}")
    return 0 if p["fits"] else 1


def extras_without_layout(overrides) -> str:
    drop = ("model=", "gpu=", "world_size=", "parallel.tp=", "parallel.pp=", "parallel.ep=", "parallel.dp=",
            "parallel.cp=")
    return " ".join(a for a in overrides if not a.startswith(drop))


if __name__ == "__main__":
    sys.exit(main())
