"""The planner against independent references: the parameter counter (FLOPs = 6 x active params +
attention), hand-computed ZeRO-1 bytes, the activation coefficients re-measured on widths they were
not fitted on, and the peak tensor memory of real k3_tiny-sized training steps on this machine
(torch.profiler's allocation events, one or more gloo ranks)."""
import importlib.util
import math
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
    from parallel.data_parallel import ShardedOptimizer
    from parallel.parallelize import parallelize_tp, sync_partial_grads
    from parallel.parity import make_groups

    torch.set_num_threads(1)
    cfg = load_model_config("k3_tiny", **TINY)
    tp_group = dp_group = None
    if world > 1:
        tp_group, dp_group = make_groups(tp, dp)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_model(cfg, seed=0)
        plan = parallelize_tp(model, tp_group, sequence_parallel=tp > 1)
        model.gradient_checkpointing = ckpt
        opt = ShardedOptimizer(model, OptimConfig(ns_dtype="float32"), dp_group)
        if tp > 1:
            opt.set_tensor_parallel(tp_group, plan.shard_dim)
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
    lines = capsys.readouterr().out.strip().splitlines()
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
    acts = {s: p["stages"][0]["activations"] for s, p in plans.items()}
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
