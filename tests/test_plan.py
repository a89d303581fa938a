"""The planner against independent references: the parameter counter (FLOPs = 6 x active params +
attention), hand-computed ZeRO-1 bytes, the activation coefficients re-measured on widths they were
not fitted on, and the peak tensor memory of real k3_tiny-sized training steps on this machine
(torch.profiler's allocation events, one or more gloo ranks)."""
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megak3.config import load_model_config
from megak3.launch import planner as P
from megak3.launch.hardware import load_hardware
from megak3.model.param_count import count_parameters
from parallel.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TINY = {"vision.enabled": False}
MiB = 2 ** 20


def _tool():
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flops_agree_with_param_counter():
    for name in ("k3_tiny", "k3_full"):
        cfg = load_model_config(name)
        f = P.flops_per_token(cfg, 4096)
        active = count_parameters(cfg)["active"]
        attention = f["mla_scores"] + f["kda_recurrence"]
        assert f["train"] == pytest.approx(6 * active + 3 * attention, rel=1e-9)
        assert f["forward"] - attention == pytest.approx(2 * active, rel=1e-9)
    # hand count, one MLA layer's scores: H * (qk + v) * T per token
    cfg = load_model_config("k3_full")
    n_mla = cfg.layer_kinds().count("mla")
    assert P.flops_per_token(cfg, 1000)["mla_scores"] == n_mla * 96 * (128 + 64 + 128) * 1000


def test_flops_against_torch_flop_counter():
    """An independent count: torch's FlopCounterMode over a real k3_tiny forward (T=64, experts as
    one GEMM per expert so every routed token's FLOPs are counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    from megak3.model.k3 import build_model

    cfg = load_model_config("k3_tiny", **TINY)
    model = build_model(cfg, seed=0)
    for mod in model.modules():
        if hasattr(mod, "use_grouped_mm"):
            mod.use_grouped_mm = "loop"
    T = 64
    with torch.no_grad(), FlopCounterMode(display=False, depth=None) as counter:
        model(torch.randint(0, cfg.vocab_size, (1, T)))
    counts = {mod: {str(op): n for op, n in ops.items()} for mod, ops in counter.get_flop_counts().items()}
    gemm = counts["Global"].get("aten.mm", 0) + counts["Global"].get("aten.addmm", 0)

    def core(kind):  # the attention cores' batched matmuls, per kind of layer
        return sum(counts.get(f"K3Model.layers.{i}.self_attn", {}).get(op, 0)
                   for i, k in enumerate(cfg.layer_kinds()) if k == kind for op in ("aten.bmm", "aten.baddbmm"))

    f = P.flops_per_token(cfg, T)
    # the planner's 2 x active params also counts the few non-GEMM params (norms, convs, A_log: 0.44% here)
    assert 0.99 * f["matmul_forward"] <= gemm / T <= f["matmul_forward"]
    assert f["matmul_forward"] == pytest.approx(f["forward"] - f["mla_scores"] - f["kda_recurrence"], rel=1e-9)
    assert core("mla") / T == 2 * f["mla_scores"]  # the counter counts the causal square in full
    assert core("kda") / T == pytest.approx(f["kda_recurrence"], rel=0.1)  # the chunked form: +8% at C=64


def test_zero1_bytes_by_hand():
    cfg = load_model_config("k3_tiny", **TINY)
    inv = P.inventory(cfg)
    total = sum(n for _, n, *_ in inv)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))  # + the routers' bias buffers
    assert total + n_moe * cfg.moe.num_experts == count_parameters(cfg)["text_total"]
    one = P.stage_memory(cfg, P.PlanConfig(world_size=1, precision="fp32", seq_len=64).resolved(), 0)
    assert one["params"] == 4 * total and one["grads"] == 4 * total and one["main_params"] == 0
    muon = sum(n for _, n, _, _, _, o in inv if o == "muon")
    assert one["optimizer_state"] == 4 * muon + 8 * (total - muon)
    dp4 = P.stage_memory(cfg, P.PlanConfig(world_size=4, precision="fp32", seq_len=64).resolved(), 0)
    assert dp4["optimizer_state"] == pytest.approx(one["optimizer_state"] / 4)
    ep = P.stage_memory(cfg, P.PlanConfig(world_size=4, ep=4, precision="fp32", seq_len=64).resolved(), 0)
    experts = sum(n for _, n, _, _, e, _ in inv if e)
    assert ep["params"] == pytest.approx(4 * (total - experts + experts / 4))
    bf = P.stage_memory(cfg, P.PlanConfig(world_size=2, param_dtype="bf16", seq_len=64).resolved(), 0)
    assert bf["params"] == 2 * total and bf["main_params"] == pytest.approx(4 * total / 2)


def test_activation_coefficients_on_unseen_widths():
    from megak3.launch.calibrate import measure

    for over in ({"hidden_size": 192, "kda.num_heads": 3, "mla.num_heads": 3, "moe.top_k": 3},
                 {"dense_intermediate_size": 384, "moe.latent_size": 96, "kda.head_dim": 48}):
        got, want = {}, {}
        for r in measure(over, seq_len=96):
            c = P.ACT_COEF["fp32"][r["kind"]]
            want[r["kind"]] = want.get(r["kind"], 0) + sum(c[k] * r["features"][k] for k in c)
            got[r["kind"]] = got.get(r["kind"], 0) + r["bytes_per_token"]
        for k in got:
            assert want[k] == pytest.approx(got[k], rel=0.10), (over, k, got[k], want[k])


def _measure_peak(rank, world, tp, dp, ckpt, steps, mbs, seqlen):
    """Peak live tensor bytes of building a k3_tiny-sized model + ZeRO-1 optimizer and training."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from megak3.model.k3 import build_model
    from megak3.optim import OptimConfig
    from parallel.config import ParallelConfig
    from parallel.data_parallel import ShardedOptimizer
    from parallel.parallelize import parallelize, sync_partial_grads
    from parallel.state import ParallelState, init_parallel

    torch.set_num_threads(1)
    cfg = load_model_config("k3_tiny", **TINY)
    par = ParallelConfig(tp=tp, dp=dp, sequence_parallel=tp > 1)
    ps = init_parallel(par) if world > 1 else ParallelState.single()
    tp_group, dp_group = ps.tp_group, ps.dp_group
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_model(cfg, seed=0)
        plan = parallelize(model, ps, par)
        model.gradient_checkpointing = ckpt
        opt = ShardedOptimizer(model, OptimConfig(ns_dtype="float32"), dp_group)
        if tp > 1:
            opt.set_tensor_parallel(tp_group, plan.tp_shard_dim)
        g = torch.Generator().manual_seed(1 + (dist.get_rank(dp_group) if dp_group is not None else 0))
        for _ in range(steps):
            ids = torch.randint(4, cfg.vocab_size, (mbs, seqlen), generator=g)
            if tp_group is not None:
                dist.broadcast(ids, src=dist.get_global_rank(tp_group, 0), group=tp_group)
            out = model(ids, labels=ids)
            (out.loss_sum / out.num_tokens).backward()
            del out
            sync_partial_grads(model, plan, tp_group)
            opt.reduce_gradients()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    cur = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("tp,dp,ckpt", [(1, 1, False), (1, 1, True),
                                        pytest.param(2, 1, False, marks=pytest.mark.slow),
                                        pytest.param(1, 2, False, marks=pytest.mark.slow)])
def test_memory_estimate_within_15_percent_of_measured_peak(tp, dp, ckpt):
    mbs, seqlen = 2, 256
    world = tp * dp
    args = (tp, dp, ckpt, 2, mbs, seqlen)
    peaks = [_measure_peak(0, 1, *args)] if world == 1 else run_distributed(_measure_peak, world, *args,
                                                                            timeout_s=300)
    cfg = load_model_config("k3_tiny", **TINY)
    pc = P.PlanConfig(tp=tp, world_size=world, micro_batch_size=mbs, seq_len=seqlen, global_batch_size=mbs * dp,
                      precision="fp32", activation_checkpointing=ckpt)
    est = P.make_plan(cfg, pc, load_hardware("cpu"))["memory"]["total"]
    measured = max(peaks)
    assert est == pytest.approx(measured, rel=0.15), (est / MiB, measured / MiB)


def test_k3_full_on_2048_h200_and_search(capsys):
    tool = _tool()
    rc = tool.main(["model=k3_full", "parallel.tp=8", "parallel.pp=16", "parallel.ep=64", "world_size=2048",
                    "gpu=h200"])
    out = capsys.readouterr().out
    assert rc == 0 and "FITS" in out and "tokens/s" in out and "MoonEP buffers" in out
    cfg = load_model_config("k3_full")
    p = P.make_plan(cfg, P.PlanConfig(tp=8, pp=16, ep=64, world_size=2048), load_hardware("h200"))
    # more ranks of the same kind -> less memory per rank; no checkpointing -> more activations
    p2 = P.make_plan(cfg, P.PlanConfig(tp=8, pp=16, ep=128, world_size=2048), load_hardware("h200"))
    assert p2["memory"]["params"] < p["memory"]["params"]
    p3 = P.make_plan(cfg, P.PlanConfig(tp=8, pp=16, ep=64, world_size=2048, activation_checkpointing=False),
                     load_hardware("h200"))
    assert p3["memory"]["activations"] > 10 * p["memory"]["activations"] and not p3["fits"]
    assert tool.main(["model=k3_full", "world_size=1024", "gpu=h200", "--search"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[1:]
    assert len(lines) == 3 and all(l.startswith(f"#{i}") for i, l in zip((1, 2, 3), lines))
    tps = [float(l.split(": ")[1].split(" tokens")[0].replace(",", "")) for l in lines]
    assert tps == sorted(tps, reverse=True)


def test_pipeline_schedule_changes_bubble_and_memory():
    """The bubble factor follows the schedule's closed form and the first stage's activations the
    schedule's in-flight count (AFAB all m, interleaved more than 1F1B, ZB-H1 no less than 1F1B)."""
    cfg, hw = load_model_config("k3_full"), load_hardware("h200")
    kw = dict(tp=8, pp=16, ep=64, world_size=2048, global_batch_size=512)
    plans = {s: P.make_plan(cfg, P.PlanConfig(pp_schedule=s, vp=2 if s == "interleaved_1f1b" else 1, **kw), hw)
             for s in ("afab", "1f1b", "interleaved_1f1b", "zb_h1")}
    m = plans["1f1b"]["layout"]["micro_batches"]
    assert plans["1f1b"]["time"]["bubble"] == pytest.approx(1 + 15 / m)
    assert plans["interleaved_1f1b"]["time"]["bubble"] == pytest.approx(1 + 15 / (2 * m))
    assert plans["zb_h1"]["time"]["bubble"] == pytest.approx(1 + 15 / (3 * m))
    # the in-flight part (the transient of the one layer recomputed depends on the stage's layers,
    # which differ under interleaving: vp chunks of the trainer's partition)
    acts = {s: p["stages"][0]["activations"] - p["stages"][0]["backward_transient"] for s, p in plans.items()}
    assert acts["afab"] > acts["interleaved_1f1b"] > acts["1f1b"] and acts["zb_h1"] >= acts["1f1b"]
    assert plans["zb_h1"]["time"]["tokens_per_s"] > plans["1f1b"]["time"]["tokens_per_s"]
    with pytest.raises(ValueError, match="parallel.vp >= 2"):
        P.make_plan(cfg, P.PlanConfig(pp_schedule="interleaved_1f1b", **kw), hw)


def test_bad_input():
    tool = _tool()
    assert tool.main(["parallel.tp=3", "world_size=8", "model=k3_tiny", "gpu=h200"]) == 2
    assert tool.main(["gpu=tpu", "model=k3_tiny"]) == 2
    assert tool.main(["parallel.tp=x"]) == 2
    with pytest.raises(ValueError, match="parallel.tp"):
        P.make_plan(load_model_config("k3_tiny"), P.PlanConfig(tp=3, world_size=3), load_hardware("cpu"))


# ---- issue 16: default layout, one global-batch rule, minimum GPUs, heaviest-stage comm, QB, per-rank figures
def _trainer_shards(cfg, pc, pp_rank, coords, monkeypatch):
    """What the trainer holds on one rank, on the meta device: parallelize_tp, parallelize_ep and
    keep_stage applied to the real model (group sizes/ranks from ``coords`` through a patched
    torch.distributed), ZeRO-1 ownership by assign_owners over the optimizer specs per gradient group
    (as ShardedOptimizer), the checkpoint savers as the trainer picks them."""
    import types

    import torch.distributed as dist

    from megak3.model.k3 import K3Model
    from megak3.optim import OptimConfig, build_optimizer
    from moonep.config import MoonEPConfig
    from parallel.data_parallel import assign_owners
    from parallel.expert_parallel import parallelize_ep
    from parallel.parallelize import parallelize_tp
    from parallel.pipeline import keep_stage, rank_chunks

    groups = {"tp": (pc.tp, coords["tp"]), "ep": (pc.ep, coords["ep"])}
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: groups[g][0])
    monkeypatch.setattr(dist, "get_rank", lambda g=None: groups[g][1])
    with torch.device("meta"):
        model = K3Model(cfg)
    parallelize_tp(model, "tp" if pc.tp > 1 else None, sequence_parallel=pc.tp > 1)
    ep_plan = parallelize_ep(model, types.SimpleNamespace(ep_group="ep", etp_size=1) if pc.ep > 1 else None,
                             MoonEPConfig(enabled=False))
    if pc.pp > 1:
        mine = rank_chunks(cfg, pc.pp, pp_rank, pc.vp, pc.pp_layout, P.split_blocks(cfg, pc))
        keep_stage(model, mine, pp_rank == 0, pp_rank == pc.pp - 1)
    canon = lambda n: n.replace(".inner.", ".")  # noqa: E731
    expert = set(ep_plan.shard_dim) if pc.ep > 1 else set()
    params = list(model.named_parameters())
    specs = build_optimizer(model, OptimConfig()).specs
    # ShardedOptimizer: expert shards on the edp group, the rest on dp; one group when they coincide
    gsize = {"dp": (pc.dp, coords["dp"]), "edp": (pc.edp, coords["edp"])}
    gof = [("edp" if canon(s.name) in expert else "dp") for s in specs]
    state = 0
    for g in dict.fromkeys(gof):
        idx = [i for i, h in enumerate(gof) if h == g]
        size, rank = gsize[g]
        for i, o in zip(idx, assign_owners([specs[i].param.numel() for i in idx], size)):
            if o == rank:
                state += specs[i].param.numel() * (4 if specs[i].optimizer == "muon" else 8)
    saved = sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                if (coords["edp"] if canon(n) in expert else coords["dp"]) == 0)
    n = sum(p.numel() for _, p in params)
    return {"params": n, "param_bytes": sum(p.numel() * p.element_size() for _, p in params),
            "optimizer_state_bytes": state, "checkpoint_bytes": saved + state}


@pytest.mark.parametrize("layout", [dict(tp=2, pp=3, ep=4, world_size=24),      # dp 4, edp 2
                                    dict(tp=2, pp=4, ep=1, world_size=16),      # pp > blocks: split; experts on dp
                                    dict(tp=1, pp=1, ep=8, world_size=8)])
def test_per_rank_figures_equal_the_trainers_meta_shards(layout, monkeypatch):
    from parallel.grid import Layout

    cfg = load_model_config("k3_tiny")  # vision on: the first stage holds it
    pc = P.PlanConfig(**layout).resolved()
    grid = Layout(world_size=pc.world_size, tp=pc.tp, dp=pc.dp, pp=pc.pp, ep=pc.ep)
    per_stage = pc.world_size // pc.pp
    for stage in sorted({0, pc.pp // 2, pc.pp - 1}):
        for r in sorted({0, 1, per_stage - 1}):
            rank = stage * per_stage + r
            coords = grid.coords(rank)
            assert coords["pp"] == stage
            want = _trainer_shards(cfg, pc, stage, coords, monkeypatch)
            got = P.per_rank_figures(cfg, pc, stage, r)
            assert (got["tp_rank"], got["dp_rank"], got["ep_rank"], got["edp_rank"]) == \
                (coords["tp"], coords["dp"], coords["ep"], coords["edp"])
            assert P.per_rank_figures(cfg, pc, coords) == got  # Layout.coords form
            for k, v in want.items():
                assert got[k] == v, (layout, stage, r, k, got[k], v)
            assert got["grad_bytes"] == got["param_bytes"]
    named = [P.per_rank_figures(cfg, pc, s)["stage"] for s in ("first", "middle", "last")]
    assert named == [0, pc.pp // 2, pc.pp - 1]
    with pytest.raises(ValueError, match="rank_in_stage"):
        P.per_rank_figures(cfg, pc, 0, per_stage)


def test_owner_heap_equals_assign_owners():
    import random

    from parallel.data_parallel import assign_owners

    rng = random.Random(0)
    for world in (1, 2, 3, 8):
        numels = [rng.choice([1, 7, 64, 64, 4096, 10 ** 6]) for _ in range(200)]
        assert P._owners(numels, world) == assign_owners(numels, world)


def test_default_layout_is_the_search_winner_with_one_batch_rule(capsys):
    tool = _tool()
    cfg, hw = load_model_config("k3_full"), load_hardware("h200")
    best = P.search(cfg, 512, hw, top=1)[0]
    L = best["layout"]
    assert L["global_batch_default"] and L["tokens_per_step"] == 1024 * 4096 == L["global_batch_size"] * 4096
    # a plain plan of the winning layout assumes the same batch and reproduces its numbers
    same = P.make_plan(cfg, P.PlanConfig(tp=L["tp"], pp=L["pp"], ep=L["ep"], world_size=512,
                                         micro_batch_size=L["micro_batch_size"]), hw)
    assert same["layout"]["global_batch_size"] == L["global_batch_size"]
    assert same["time"]["step_s"] == pytest.approx(best["time"]["step_s"])
    assert tool.main(["model=k3_full", "world_size=512", "gpu=h200"]) == 0
    out = capsys.readouterr().out
    assert "the best layout on 512 x h200 (what --search ranks first)" in out
    assert f"layout tp={L['tp']} pp={L['pp']} ep={L['ep']} " in out
    assert "global batch 1024 sequences x 4096 tokens" in out and "train with: parallel.tp=" in out
    # a given layout that does not fit points to the one that does
    assert tool.main(["model=k3_full", "world_size=512", "gpu=h200", "parallel.tp=1"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "the best one that does on 512 x h200: tp=" in out and "--search" in out
    assert tool.main(["model=k3_full", "world_size=512", "gpu=h200", "--search", "--top=1"]) == 0
    assert "default global batch" in capsys.readouterr().out
    # default batch rule: ~4 Mi tokens, whole micro-batch rounds
    assert P.default_global_batch(4096, 1, 8) == 1024 and P.default_global_batch(8192, 2, 3) == 516
    assert P.default_global_batch(4096, 1, 8, pp=3, pp_schedule="interleaved_1f1b") == 1032


def test_min_gpus(capsys):
    cfg, hw = load_model_config("k3_full"), load_hardware("h200")
    res = P.min_gpus(cfg, hw, base=P.PlanConfig(seq_len=8192))
    w, pow2 = res["world_size"], res["power_of_two"]
    assert res["plan"]["fits"] and res["plan"]["layout"]["world_size"] == w and res["plan"]["layout"]["seq_len"] == 8192
    assert pow2 & (pow2 - 1) == 0 and w <= pow2 and w % hw.gpus_per_node == 0
    assert not res["tried"][pow2 // 2] and not P.search(cfg, w - hw.gpus_per_node, hw, top=1,
                                                         base=P.PlanConfig(seq_len=8192))
    tool = _tool()
    assert tool.main(["model=k3_full", "gpu=h200", "--min-gpus", "data.seq_len=8192"]) == 0
    out = capsys.readouterr().out
    assert f"minimum GPUs for k3_full, seq 8192, h200: {w}" in out and "plan it: python tools/plan.py" in out


def test_comm_counts_heaviest_stage_and_recompute():
    cfg, hw = load_model_config("k3_full"), load_hardware("h200")
    kw = dict(tp=8, pp=32, ep=64, world_size=4096)
    p = P.make_plan(cfg, P.PlanConfig(**kw), hw)
    pc = P.PlanConfig(**kw).resolved()
    per = [P.comm_per_step(cfg, pc, s) for s in range(32)]
    s = p["comm_stage"]
    assert p["comm_bytes_per_step"]["ep"] == per[s]["ep"] == max(c["ep"] for c in per)
    assert p["time"]["step_s"] == max(p["stage_step_s"])
    # stage 0 holds the dense layer 0: fewer MoE layers than the heaviest stage
    n_moe = [sum(cfg.is_moe_layer(i) for i in range(a, b)) for (a, b), in p["layout"]["stage_layers"]]
    assert per[0]["ep"] / per[s]["ep"] == pytest.approx(n_moe[0] / n_moe[s]) and n_moe[0] < n_moe[s]
    # the stages are the trainer's (parallel/pipeline/partition.py), not an even split
    from parallel.pipeline import partition_layers

    assert [[[r.start, r.stop]] for r in partition_layers(cfg, 32, allow_split_blocks=True)] == \
        p["layout"]["stage_layers"]
    # the recompute forward under activation checkpointing: 6 passes of TP / EP collectives, not 4
    no = P.comm_per_step(cfg, replace(pc, activation_checkpointing=False), s)
    assert per[s]["ep"] == pytest.approx(1.5 * no["ep"])
    mid = P.comm_per_step(cfg, replace(pc, activation_checkpointing=False), 15)
    assert per[15]["tp"] == pytest.approx(1.5 * mid["tp"])  # a middle stage: no embedding / lm_head


def test_qb_statistics_memory_and_comm(capsys):
    cfg = load_model_config("k3_full")
    E, L = cfg.moe.num_experts, 6
    pc = P.PlanConfig(tp=8, pp=16, ep=64, world_size=2048, qb_method="histogram").resolved()
    h = P.qb_figures(cfg, pc, L)
    assert h["method"] == "histogram" and h["bins"] == 4096
    assert h["persistent"] == L * (E * 4096 * 8 + 8)
    assert h["comm"] == pytest.approx(L * 2 * (E * 4096 * 8 + 8) * (7 / 8 + 15 / 16))  # tp (SP) then dp
    assert P.qb_figures(cfg, replace(pc, qb_bins=1024), L)["persistent"] == L * (E * 1024 * 8 + 8)
    ex = P.qb_figures(cfg, replace(pc, qb_method="exact"), L)
    t_group = pc.global_batch_size * pc.seq_len
    t_rank = t_group / (16 * 8)
    assert ex["persistent"] == L * t_rank * E * 4 and ex["transient"] == 2 * t_group * E * 4
    assert ex["comm"] == pytest.approx(L * (t_group - t_rank) * E * 4)
    # auto picks the histogram above 64 MiB of margins; an unknown value is a user error
    assert P.qb_method(cfg, replace(pc, qb_method="auto")) == "histogram"
    with pytest.raises(ValueError, match=r"model.moe.qb_method='bogus': choose one of auto, exact, histogram"):
        replace(pc, qb_method="bogus").resolved()
    with pytest.raises(ValueError, match=r"model.moe.qb_method='bogus'"):
        P.qb_method(cfg, replace(pc, qb_method="bogus"))
    from megak3.model.balancing import QB_METHODS
    assert P.QB_METHODS == QB_METHODS  # the planner's copy of the trainer's choices
    tiny = load_model_config("k3_tiny")
    small = P.PlanConfig(world_size=2, seq_len=256, global_batch_size=8, qb_method="auto").resolved()
    assert P.qb_method(tiny, small) == "exact"  # 2048 tokens x 32 experts x 4 B
    # they are in the plan: memory and the step's comm
    p = P.make_plan(cfg, replace(pc, qb_method="histogram"), load_hardware("h200"))
    st = p["memory"]
    assert st["qb_stats"] == _moe_layers_of(st, cfg) * (E * 4096 * 8 + 8) and p["comm_bytes_per_step"]["qb"] > 0
    tool = _tool()
    args = ["model=k3_full", "parallel.tp=8", "parallel.pp=16", "parallel.ep=64", "world_size=2048", "gpu=h200"]
    code = tool.main(args + ["model.moe.qb_method=exact", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == (0 if plan["fits"] else 1) and plan["memory"]["qb_method"] == "exact"
    assert tool.main(args + ["model.moe.qb_method=exact"]) == code
    assert "QB statistics" in capsys.readouterr().out
    assert tool.main(args + ["model.moe.qb_method=bogus"]) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and "model.moe.qb_method='bogus': choose one of auto, exact, histogram" in err[0], err




def _moe_layers_of(stage_mem, cfg):
    return sum(cfg.is_moe_layer(i) for a, b in stage_mem["layers"] for i in range(a, b))


# ---- MoonEP replica buffers and traffic --------------------------------------------------------

def test_moonep_replica_buffers_in_memory_and_comm():
    GiB = 2 ** 30
    """One persistent [E/ep + M, 3 L m] buffer in the compute dtype per rank under activation
    checkpointing (shared by the layers: moonep/moonep.py ReplicaBuffers), one per MoE layer and
    forward in flight without; traffic at most M experts per layer and pass."""
    cfg = load_model_config("k3_full")
    E, L, m = cfg.moe.num_experts, cfg.moe.latent_size, cfg.moe.expert_intermediate_size
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    pc = P.PlanConfig(ep=8, world_size=8, seq_len=1024, global_batch_size=8).resolved()
    st = P.stage_memory(cfg, pc, 0)
    # the default bound M = E/ep = 112: the landing part alone is the 6.9 GiB per layer (bf16)
    assert 112 * 3 * L * m * 2 / GiB == pytest.approx(6.9, abs=0.01)
    assert st["moonep_replica_slots"] == 112
    assert st["moonep_replica_buffers"] == (112 + 112) * 3 * L * m * 2          # one layer's budget per rank
    off = P.stage_memory(cfg, replace(pc, moonep=False), 0)
    assert off["moonep_replica_buffers"] == 0
    assert st["total"] - off["total"] == pytest.approx(st["moonep_replica_buffers"])
    four = P.stage_memory(cfg, replace(pc, max_replicas_per_rank=4), 0)
    assert four["moonep_replica_buffers"] == (112 + 4) * 3 * L * m * 2
    fp32 = P.stage_memory(cfg, replace(pc, precision="fp32"), 0)
    assert fp32["moonep_replica_buffers"] == 2 * st["moonep_replica_buffers"]
    assert P.stage_memory(cfg, P.PlanConfig(world_size=8, seq_len=1024, global_batch_size=8).resolved(),
                          0)["moonep_replica_buffers"] == 0                      # no EP
    # without checkpointing a layer keeps one buffer per forward in flight: 1F1B stage 0 of pp=2 holds 2
    pp = P.PlanConfig(ep=8, pp=2, world_size=16, seq_len=1024, global_batch_size=16,
                      activation_checkpointing=False).resolved()
    s0 = P.stage_memory(cfg, pp, 0)
    n0 = sum(cfg.is_moe_layer(i) for i in P._stage_layer_list(cfg, pp, 0))
    assert s0["in_flight_micro_batches"] == 2
    assert s0["moonep_replica_buffers"] == 2 * n0 * (112 + 112) * 3 * L * m * 2
    # traffic: at most M experts per MoE layer per pass (fwd, recompute fwd, bwd) and micro-batch
    c = P.comm_per_step(cfg, pc, 0)
    assert c["ep_replicas_max"] == 3 * pc.micro_batches * n_moe * 112 * 3 * L * m * 2
    assert P.comm_per_step(cfg, replace(pc, moonep=False), 0)["ep_replicas_max"] == 0
    p = P.make_plan(cfg, pc, load_hardware("h200"))
    assert p["comm_bytes_per_step"]["ep_replicas_max"] == c["ep_replicas_max"]
    with pytest.raises(ValueError, match="moonep.max_replicas_per_rank=785"):
        P.make_plan(cfg, replace(pc, max_replicas_per_rank=E - E // 8 + 1), load_hardware("h200"))
    with pytest.raises(ValueError, match="moonep.max_replicas_per_rank=-1"):
        replace(pc, max_replicas_per_rank=-1).resolved()


def _replica_buffer_case(rank, world, autocast, in_flight):
    import torch.distributed as dist

    from megak3.model.moe import LatentMoE
    from moonep.buffers import BufferPool
    from moonep.config import MoonEPConfig
    from parallel.expert_parallel import parallelize_ep
    from parallel.testing import PARITY_MODEL

    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    torch.manual_seed(11)
    moe = LatentMoE(cfg)
    moe.gate.e_score_correction_bias.copy_(torch.tensor([0.3, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0]))
    plan = parallelize_ep(moe, dist.group.WORLD, MoonEPConfig(), pool=BufferPool())
    d = plan.dispatchers[0]
    g = torch.Generator().manual_seed(rank)
    ys, replicas = [], []
    for _ in range(in_flight):                    # forwards in flight at once, then their backwards
        x = torch.randn(16, cfg.hidden_size, generator=g, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, _ = moe(x)
        ys.append(y)
        replicas.append(d.last["num_replicas"])
    for y in ys:
        y.float().square().sum().backward()
    return d.replica_buffers.nbytes(), d.replica_buffers.allocations, replicas


@pytest.mark.parametrize("autocast,in_flight", [(False, 1), (True, 2)])
def test_moonep_replica_buffer_bytes_equal_a_real_layer(autocast, in_flight):
    from parallel.testing import PARITY_MODEL
    from parallel.testing import run_distributed

    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    pc = P.PlanConfig(ep=2, world_size=2, seq_len=16, global_batch_size=2, activation_checkpointing=False,
                      precision="bf16" if autocast else "fp32").resolved()
    fig = P.moonep_replica_figures(cfg, pc, 1, in_flight)
    for nbytes, allocs, replicas in run_distributed(_replica_buffer_case, 2, autocast, in_flight, timeout_s=300):
        assert all(r > 0 for r in replicas), replicas           # the skew made replicas every call
        assert allocs == fig["buffers"] == in_flight
        assert nbytes == fig["memory"] == in_flight * fig["buffer_bytes"]
