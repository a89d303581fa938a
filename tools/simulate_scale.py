#!/usr/bin/env python
"""Simulate one K3 training layout at full scale on this machine and check it against the planner.

    python tools/simulate_scale.py model=k3_full world_size=1024                 # the planner's best layout
    python tools/simulate_scale.py model=k3_full world_size=1024 parallel.tp=8 parallel.pp=16 parallel.ep=64 --json
    python tools/simulate_scale.py model=k3_mini world_size=16 parallel.tp=2 parallel.pp=2 parallel.ep=4 \\
        --materialize --ranks 0                                                 # real shards, peak RSS

For a sample of ranks (the first, a middle and the last pipeline stage, each at data-parallel rank
0, so they are checkpoint savers) this process joins torch's ``fake`` process group as that rank of
``world_size``, builds the model on the meta device, runs the trainer's own
``parallel.parallelize.parallelize`` and reads, from the resulting plan and the ZeRO-1 ownership the
trainer's optimizer would derive: parameters (count, bytes), gradient buffers, optimizer state, the
checkpoint bytes the rank writes and the checkpoint metadata bytes it reads to resume ("meta MB":
manifest, index.json and the index parts of its stage's keys, megak3.checkpoint.key_index.read_bytes
over the keys of the full model and the chunk counts of the rank's plan). The planner
(``megak3.launch.planner.per_rank_figures``) gives the same figures analytically; any that differ by
more than 1% make the exit status 1.

``--materialize`` also allocates and initialises the rank's real shards on the CPU
(``parallel.materialize.materialize``) and prints the resident-memory growth while building,
against the shard bytes (peak RSS after - RSS before; torch's own pages are loaded before).

Arguments are tools/plan.py's (model=, model.FIELD=, world_size=, gpu=, parallel.*, data.seq_len=,
train.*). Exit status 0 when every figure agrees, 1 when one differs by > 1%, 2 on bad input.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GiB = 2 ** 30
FIGURES = ("params", "param_bytes", "grad_bytes", "optimizer_state_bytes", "checkpoint_bytes",
           "checkpoint_meta_read_bytes")


def _plan_tool():
    spec = importlib.util.spec_from_file_location("_plan_tool", Path(__file__).with_name("plan.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sample_ranks(layout, pp: int) -> list:
    """The first global rank whose coordinates are (pp stage s, every other axis 0), for the first,
    middle and last stage."""
    stages = sorted({0, pp // 2, pp - 1})
    out = []
    for s in stages:
        for r in range(layout.world_size):
            c = layout.coords(r)
            if c["pp"] == s and all(v == 0 for k, v in c.items() if k != "pp"):
                out.append(r)
                break
    return out


def zero1_owned(model, optim_cfg, plan) -> list:
    """The trainer's ZeRO-1 ownership, derived without collectives: the optimizer specs grouped by
    gradient group in first-appearance order, owners from ``assign_owners`` per group (exactly what
    ``ShardedOptimizer.__init__`` does). Returns this rank's owned specs."""
    import torch.distributed as dist

    from megak3.optim import build_optimizer
    from parallel.data_parallel import assign_owners

    specs = build_optimizer(model, optim_cfg).specs
    groups, members = [], []
    for i, s in enumerate(specs):
        g = plan.grad_group(s.name)
        gid = next((k for k, h in enumerate(groups) if h is g), None)
        if gid is None:
            gid = len(groups)
            groups.append(g)
            members.append([])
        members[gid].append(i)
    owned = []
    for g, idx in zip(groups, members):
        size = 1 if g is None else dist.get_world_size(g)
        rank = 0 if g is None else dist.get_rank(g)
        owners = assign_owners([specs[i].param.numel() for i in idx], size)
        owned += [specs[i] for i, o in zip(idx, owners) if o == rank]
    return owned


_ALL_KEYS: dict = {}


def checkpoint_meta_read(cfg, model, optim_cfg, plan, esize: dict, world: int) -> int:
    """Metadata bytes this rank reads to resume (megak3.checkpoint.key_index.read_bytes): the manifest,
    index.json (every key of the whole model, from a separate full meta-device build) and the index
    parts of its stage's model and optimizer keys, with each key's chunk count from the rank's plan
    (global / local extent per dim)."""
    import math

    from megak3.model.k3 import build_model
    from megak3.optim import build_optimizer
    from megak3.checkpoint import key_index as shard_index

    if cfg.name not in _ALL_KEYS:  # the checkpoint's keys: every param and persistent buffer
        full = build_model(cfg, device="meta")
        opt = {s.name.replace(".inner.", "."): s.optimizer for s in build_optimizer(full, optim_cfg).specs}
        keys = [f"model/{n.replace('.inner.', '.')}" for n in full.state_dict()]
        keys += [f"optim/{n}/{st}" for n, o in opt.items() for st in shard_index.optimizer_state_names(o)]
        _ALL_KEYS[cfg.name] = (keys, [f"optim_meta/{n}" for n in opt])
    keys, object_keys = _ALL_KEYS[cfg.name]
    opt = {s.name.replace(".inner.", "."): s.optimizer for s in build_optimizer(model, optim_cfg).specs}
    read = {}
    for n, sh in plan.tensors.items():
        chunks = math.prod(g // max(l, 1) for g, l in zip(sh.global_shape, sh.local_shape))
        read[f"model/{n}"] = (sh.global_shape, esize[n], chunks)
        if n in opt:
            for st in shard_index.optimizer_state_names(opt[n]):
                read[f"optim/{n}/{st}"] = (sh.global_shape, 4, chunks)
    return shard_index.read_bytes(keys, read, world, object_keys)["total"]


def measure_rank(cfg, pcfg, moonep_cfg, optim_cfg, world: int, rank: int, materialize_it: bool) -> dict:
    """Build, parallelize (and optionally materialise) one rank under the fake process group."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megak3.metrics.telemetry import peak_rss_bytes, reset_peak_rss, rss_bytes
    from megak3.model.k3 import build_model
    from parallel.materialize import materialize
    from parallel.parallelize import parallelize
    from parallel.state import init_parallel

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        ps = init_parallel(pcfg, model_cfg=cfg)
        t0 = time.perf_counter()
        model = build_model(cfg, device="meta")
        plan = parallelize(model, ps, pcfg, moonep_cfg)
        params = {n: s for n, s in plan.tensors.items() if n not in plan.buffers}
        esize = {n.replace(".inner.", "."): p.element_size() for n, p in model.named_parameters()}
        esize.update({n.replace(".inner.", "."): b.element_size() for n, b in model.named_buffers()})
        param_bytes = sum(s.numel * esize[n] for n, s in params.items())
        owned = zero1_owned(model, optim_cfg, plan)
        meta_read = checkpoint_meta_read(cfg, model, optim_cfg, plan, esize, world)
        state_bytes = sum((4 if s.optimizer == "muon" else 8) * s.param.numel() for s in owned)
        saved_model = sum(s.numel * esize[n] for n, s in plan.tensors.items() if plan.is_saver(n))
        out = {"rank": rank, "coords": {"tp": ps.tp_rank, "pp": ps.pp_rank, "ep": ps.ep_rank, "dp": ps.dp_rank},
               "stage": ps.pp_rank, "layers": [[c.start, c.stop] for c in plan.stage_chunks],
               "params": sum(s.numel for s in params.values()), "param_bytes": param_bytes,
               "grad_bytes": param_bytes, "optimizer_state_bytes": state_bytes,
               "checkpoint_bytes": saved_model + state_bytes, "checkpoint_meta_read_bytes": meta_read,
               "build_s": round(time.perf_counter() - t0, 2)}
        if materialize_it:
            torch.set_num_threads(1)
            before = rss_bytes()
            reset_peak_rss()
            materialize(model, plan, seed=0, std=cfg.init_std, device="cpu")
            peak = peak_rss_bytes()
            shard = plan.local_bytes(model)
            out["materialize"] = {"rss_before": before, "peak_rss": peak, "growth": peak - before,
                                  "shard_bytes": shard, "ratio": (peak - before) / max(shard, 1)}
        return out
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value, as tools/plan.py takes them")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--ranks", default="", help="comma-separated global ranks to simulate (default: first, "
                                                "middle and last pipeline stage)")
    ap.add_argument("--materialize", action="store_true",
                    help="also allocate and initialise the sampled ranks' shards and report peak RSS growth")
    args = ap.parse_args(argv)
    from dataclasses import replace

    from megak3.config import load_model_config
    from megak3.launch import planner
    from megak3.launch.hardware import load_hardware
    from megak3.optim import OptimConfig
    from moonep.config import MoonEPConfig
    from parallel.config import ParallelConfig

    try:
        model, mo, pc, gpu, given = _plan_tool().parse_overrides(args.overrides)
        cfg = load_model_config(model, **mo)
        hw = load_hardware(gpu)
        if not any(k in given for k in ("tp", "pp", "ep", "dp")):  # the planner's best layout
            best = planner.search(cfg, pc.world_size, hw, top=1, base=pc)
            if not best:
                raise ValueError(f"no layout of {pc.world_size} x {hw.name} fits {cfg.name}; "
                                 "give parallel.tp/pp/ep or a larger world_size")
            L = best[0]["layout"]
            pc = replace(pc, tp=L["tp"], pp=L["pp"], ep=L["ep"], micro_batch_size=L["micro_batch_size"],
                         global_batch_size=L["global_batch_size"])
        pc = pc.resolved()
        pcfg = ParallelConfig(tp=pc.tp, pp=pc.pp, ep=pc.ep, dp=pc.dp, vp=pc.vp, pp_schedule=pc.pp_schedule,
                              sequence_parallel=pc.sequence_parallel or pc.tp > 1,
                              pp_split_blocks=planner.split_blocks(cfg, pc),
                              pp_layout=list(pc.pp_layout) if pc.pp_layout else None)
        layout = pcfg.validate(pc.world_size, cfg).to_layout(pc.world_size)
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()] or sample_ranks(layout, pc.pp)
        bad = [r for r in ranks if not 0 <= r < pc.world_size]
        if bad:
            raise ValueError(f"--ranks {bad} outside world_size={pc.world_size}")
    except ValueError as e:
        print(f"simulate_scale: error: {e}", file=sys.stderr)
        return 2

    figures_fn = getattr(planner, "per_rank_figures", None)
    results, worst = [], 0.0
    for r in ranks:
        if args.materialize and len(ranks) > 1:  # a fresh process per rank: peak RSS is per process
            import subprocess

            argv_r = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--ranks")]
            child = subprocess.run([sys.executable, __file__, *argv_r, f"--ranks={r}", "--json"],
                                   capture_output=True, text=True)
            if child.returncode not in (0, 1):
                print(child.stderr, file=sys.stderr, end="")
                return child.returncode
            sim = json.loads(child.stdout)["ranks"][0]["sim"]
        else:
            sim = measure_rank(cfg, pcfg, MoonEPConfig(), OptimConfig(), pc.world_size, r, args.materialize)
        plan_fig = dict(figures_fn(cfg, replace(pc), stage=sim["stage"], rank_in_stage=0)) if figures_fn else {}
        if plan_fig and "checkpoint_bytes" not in plan_fig:
            plan_fig["checkpoint_bytes"] = plan_fig["checkpoint_model_bytes"] + plan_fig["checkpoint_optimizer_bytes"]
        diffs = {}
        for k in FIGURES:
            if k in plan_fig:
                a, b = sim[k], plan_fig[k]
                diffs[k] = abs(a - b) / max(abs(b), 1)
                worst = max(worst, diffs[k])
        results.append({"sim": sim, "planner": {k: plan_fig.get(k) for k in FIGURES}, "rel_diff": diffs})
    ok = bool(figures_fn) and worst <= 0.01
    out = {"model": cfg.name, "world_size": pc.world_size,
           "layout": {"tp": pc.tp, "pp": pc.pp, "ep": pc.ep, "dp": pc.dp, "edp": pc.edp},
           "ranks": results, "max_rel_diff": worst, "agrees": ok}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{cfg.name} on {pc.world_size} ranks: tp={pc.tp} pp={pc.pp} ep={pc.ep} dp={pc.dp} (edp={pc.edp}), "
              f"fake process group, meta device")
        print(f"{'rank':>6} {'stage':>5} {'layers':>12} {'params':>14} {'param GiB':>10} {'grad GiB':>9} "
              f"{'optim GiB':>10} {'ckpt GiB':>9} {'meta MB':>8}   planner (same columns)"
              f"                       max diff")
        for res in results:
            s, p = res["sim"], res["planner"]
            lay = ",".join(f"{a}-{b - 1}" for a, b in s["layers"])
            pl = " ".join("-" if p[k] is None else (f"{p[k] / 1e9:.3f}B" if k == "params" else
                                                    f"{p[k] / 1e6:.3f}" if k == "checkpoint_meta_read_bytes" else
                                                    f"{p[k] / GiB:.2f}") for k in FIGURES)
            print(f"{s['rank']:>6} {s['stage']:>5} {lay:>12} {s['params']:>14,} {s['param_bytes'] / GiB:>10.2f} "
                  f"{s['grad_bytes'] / GiB:>9.2f} {s['optimizer_state_bytes'] / GiB:>10.2f} "
                  f"{s['checkpoint_bytes'] / GiB:>9.2f} {s['checkpoint_meta_read_bytes'] / 1e6:>8.3f}   {pl:<44} "
                  f"{max(res['rel_diff'].values(), default=0):.2%}")
            if "materialize" in s:
                m = s["materialize"]
                print(f"       materialised: shard {m['shard_bytes'] / 2 ** 20:.1f} MiB, RSS growth while building "
                      f"{m['growth'] / 2 ** 20:.1f} MiB = {m['ratio']:.2f} x shard")
        print("agrees with the planner within 1%" if ok else
              ("planner has no per_rank_figures" if not figures_fn else f"DIFFERS from the planner: {worst:.2%}"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
