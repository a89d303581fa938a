"""The planner's context parallelism (issue 17 item 5): CP memory and traffic formulas against
hand-computed values and against the bytes the real KDA / MLA layers send under CP (comm_log,
threaded ranks), cp = 1 plans unchanged, no T^2 term under CP, validation, and the million-token
--min-gpus layouts (cp > 1, fitting). The hand counts are of contiguous MLA (``cp_balance=False``,
pinned; the balanced schedule, the default, has its terms in tests/test_cp_balance.py); the
comm_log comparison runs both schedules."""
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megak3.config import load_model_config
from megak3.launch import planner as P
from megak3.launch.hardware import load_hardware
from test_plan import _tool  # tools/plan.py loaded as a module

TINY = {"vision.enabled": False}


def test_cp_traffic_and_memory_by_hand():
    """k3_tiny (KDA H=4, K=V=64, conv 4; MLA H=4, latent 64+16), cp=4, T=1024, one row, fp32:
    tools/bench_long_context.py measured 768 KiB (scan) + 18 KiB (halo) per KDA layer and 480 KiB
    per MLA layer, forward + backward, per rank."""
    cfg = load_model_config("k3_tiny", **TINY)
    pc = P.PlanConfig(cp=4, world_size=4, seq_len=1024, precision="fp32", cp_balance=False).resolved()
    kda, mla = P.cp_layer_figures(cfg, pc, "kda"), P.cp_layer_figures(cfg, pc, "mla")
    assert kda["scan_fwd"] == kda["scan_bwd"] == 3 * 1 * 4 * 64 * (64 + 64) * 4          # (cp-1) B H K (K+V) fp32
    assert kda["halo_fwd"] == kda["halo_bwd"] == 3 * 1 * 4 * (2 * 64 + 64) * 4           # (W-1) B H (2K+V)
    assert kda["sent_fwd"] + kda["sent_bwd"] == 768 * 1024 + 18 * 1024
    assert mla["latent_fwd"] == mla["latent_bwd"] == 3 * 256 * 80 * 4                   # (cp-1) T/cp L
    assert mla["sent_fwd"] + mla["sent_bwd"] == 480 * 1024
    # at T = 4K the KDA bytes stay, the MLA latent grows 4x (1.88 MiB)
    pc4 = replace(pc, seq_len=4096)
    assert P.cp_layer_figures(cfg, pc4, "kda")["sent_fwd"] == kda["sent_fwd"]
    assert 2 * P.cp_layer_figures(cfg, pc4, "mla")["sent_fwd"] == 1966080
    # memory: MLA prefix keys of the last rank (all 1024 keys): latent 80 + normed 64 (fp32), rstd,
    # fp32 K (32+16) and V (32) of 4 heads, int64 doc id
    assert mla["prefix_bytes_per_key"] == 80 * 4 + 64 * 4 + 4 + 4 * (32 + 16 + 32) * 4 + 8
    assert mla["saved"] == mla["prefix_bytes_per_key"] * 1024
    # KDA: identity block's chunk states + zero value block and u + own and gathered summaries
    c = P.ACT_COEF["fp32"]["kda"]["HKK_C"]
    t = 1024 / 4
    summaries = (4 + 1) * 4 * 64 * 128 * 4
    assert kda["summaries"] == summaries
    assert kda["saved"] == pytest.approx(c * 4 * 64 ** 2 / 64 * t + 2 * t * 4 * 64 * 4 + summaries)
    assert kda["kda_states"] == math.ceil(256 / 64) * 4 * 64 * 128 * 4
    # per step: every KDA / MLA layer, per micro-batch, forward twice under recompute
    n_kda, n_mla = cfg.layer_kinds().count("kda"), cfg.layer_kinds().count("mla")
    comm = P.comm_per_step(cfg, pc, 0)
    m = pc.micro_batches
    assert comm["cp_kda"] == n_kda * m * (2 * kda["sent_fwd"] + kda["sent_bwd"])
    assert comm["cp_mla"] == n_mla * m * (2 * mla["sent_fwd"] + mla["sent_bwd"])
    no = P.comm_per_step(cfg, replace(pc, activation_checkpointing=False), 0)
    assert no["cp"] == n_kda * m * (kda["sent_fwd"] + kda["sent_bwd"]) + n_mla * m * (mla["sent_fwd"] + mla["sent_bwd"])
    # TP shares the KDA heads; every TP rank gathers the whole (replicated) MLA latent
    tp2 = P.PlanConfig(tp=2, cp=4, world_size=8, seq_len=1024, precision="fp32", cp_balance=False).resolved()
    assert P.cp_layer_figures(cfg, tp2, "kda")["scan_fwd"] == kda["scan_fwd"] / 2
    assert P.cp_layer_figures(cfg, tp2, "mla")["latent_fwd"] == mla["latent_fwd"]


def test_cp_tokens_per_rank_and_no_quadratic_term():
    """Every per-token term sees seq_len / cp tokens; KDA and MLA layer bytes are linear in T
    under CP (the MLA HT coefficient, T^2 in total, is dropped: CP runs the chunked attention)."""
    cfg = load_model_config("k3_tiny", **TINY)
    base = dict(world_size=4, seq_len=2048, precision="bf16")
    one = P.PlanConfig(world_size=4, seq_len=512, precision="bf16").resolved()   # dp 4, T/4 tokens
    cp4 = P.PlanConfig(cp=4, **base).resolved()
    for i, kind in enumerate(cfg.layer_kinds()):
        a, b = P.layer_activations(cfg, one, i), P.layer_activations(cfg, cp4, i)
        for part in ("mlp", "attn_res", "norms"):
            assert b[part] == pytest.approx(a[part]), (i, part)
        feats = P.module_features(cfg, kind, tokens_per_seq=2048, tp=1)
        feats["HT"] = 0.0
        local = P._bytes(kind, feats, "bf16") * 512
        assert b["attention"] == pytest.approx(local + P.cp_layer_figures(cfg, cp4, kind)["saved"])
        # affine in T (a fixed part: the KDA summaries): f(4T) - f(2T) = 2 (f(2T) - f(T)), no T^2
        f1, f2, f4 = (P.layer_activations(cfg, replace(cp4, seq_len=n), i)["total"] for n in (2048, 4096, 8192))
        assert f4 - f2 == pytest.approx(2 * (f2 - f1)), (i, kind)
    # QB margins, MoonEP and TP traffic per rank: tokens / cp
    ep = P.PlanConfig(cp=4, ep=4, world_size=4, seq_len=2048).resolved()
    ep1 = P.PlanConfig(ep=4, world_size=4, seq_len=512, global_batch_size=ep.global_batch_size * 4).resolved()
    assert P.stage_memory(cfg, ep, 0)["moonep_buffers"] == P.stage_memory(cfg, ep1, 0)["moonep_buffers"]
    assert P.comm_per_step(cfg, ep, 0)["ep"] == pytest.approx(
        P.comm_per_step(cfg, ep1, 0)["ep"] * ep.micro_batches / ep1.micro_batches)
    # dense ZeRO-1 over dp x cp: cp=2 x dp=2 owns what dp=4 owns; experts fold over cp x dp
    a = P.stage_memory(cfg, P.PlanConfig(cp=2, world_size=4, seq_len=512).resolved(), 0)
    b = P.stage_memory(cfg, P.PlanConfig(world_size=4, seq_len=512).resolved(), 0)
    assert a["optimizer_state"] == b["optimizer_state"] and a["params"] == b["params"]
    e = P.PlanConfig(cp=2, ep=2, world_size=8, seq_len=512).resolved()
    assert e.dp == 4 and e.edp == 4 and e.dp_cp == 8
    for r in (0, 3, 6):
        x = P.per_rank_figures(cfg, P.PlanConfig(cp=2, world_size=8, seq_len=512), 0, r)
        y = P.per_rank_figures(cfg, P.PlanConfig(world_size=8, seq_len=512), 0, r)
        assert x["optimizer_state_bytes"] == y["optimizer_state_bytes"] and x["checkpoint_bytes"] == y["checkpoint_bytes"]


def test_cp1_plans_unchanged():
    """cp = 1 (the default) plans exactly as before CP was added. A regression pin: the 12-digit
    values were recorded from the planner of commit ab7a108 (its own output, so they prove only that
    nothing moved); the hand-derived figures below each pin are the independent check. The default
    search at seq 4096 tries cp = 1 only."""
    full, tiny = load_model_config("k3_full"), load_model_config("k3_tiny", **TINY)
    hw = load_hardware("h200")
    p = P.make_plan(full, P.PlanConfig(tp=8, pp=16, ep=64, world_size=2048), hw)
    # re-pinned when MoonEP's replica buffers became shared across layers (one per rank under
    # activation checkpointing): the old pin minus (MoE layers of the worst stage - 1) buffers
    w = p["memory"]
    assert 58273294919.28 - w["total"] == pytest.approx((w["moe_layers"] - 1) * w["moonep_replica_buffers"],
                                                       rel=1e-12)
    assert p["memory"]["total"] == pytest.approx(49024854599.28, rel=1e-12)
    assert p["time"]["step_s"] == pytest.approx(9.832800537536773, rel=1e-12)
    want = {"dp": 16871715714.0, "ep": 133177540608.0, "pp": 8455716864.0, "qb": 638582958.0,
            "tp": 236760072192.0, "tp_grad_sync": 2567775616.0}
    assert {k: p["comm_bytes_per_step"][k] for k in want} == pytest.approx(want, rel=1e-12)
    assert p["comm_bytes_per_step"]["cp"] == 0 and p["time"]["cp_s"] == 0 and p["layout"]["cp"] == 1
    # by hand: stage 0 sends per micro-batch its output and the attention-residual blocks (93 layers /
    # 12 per block = 8 finished + the partial), [4096 / tp=8 tokens (SP), 7168] bf16, and receives
    # their gradients: 64 micro-batches (1024 sequences / dp=16)
    assert full.attn_res_block_size == 12 and full.hidden_size == 7168
    assert p["layout"]["micro_batches"] == 1024 // 16 == 64
    assert want["pp"] == 2 * 64 * (8 + 1) * (4096 // 8) * 7168 * 2
    p = P.make_plan(tiny, P.PlanConfig(tp=2, world_size=4, precision="fp32", seq_len=256, micro_batch_size=2), hw)
    assert p["memory"]["total"] == pytest.approx(275076560.0, rel=1e-12)
    assert p["time"]["step_s"] == pytest.approx(0.6262176562868604, rel=1e-12)
    # by hand: QB histograms [32 experts x 4096 bins] int64 + 8 B, per MoE layer (8 of 9), reduced
    # over tp=2 then dp=2 (ring all-reduce: 2 x (n-1)/n of the payload each)
    assert sum(tiny.is_moe_layer(i) for i in range(tiny.num_layers)) == 8
    assert p["comm_bytes_per_step"]["qb"] == 8 * 2 * (32 * 4096 * 8 + 8) * (1 / 2 + 1 / 2)
    p = P.make_plan(full, P.PlanConfig(tp=8, pp=8, ep=64, world_size=1024, activation_checkpointing=False,
                                       qb_method="exact"), hw)
    assert p["memory"]["total"] == pytest.approx(462452788146.60803, rel=1e-12)
    assert p["time"]["step_s"] == pytest.approx(15.928743309975175, rel=1e-12)
    assert P.cp_degrees(4096, 8, 2048) == [1] and P.cp_degrees(32768, 8, 2048) == [1, 2, 4, 8]
    assert "parallel.cp" not in P.make_plan(full, P.PlanConfig(tp=8, pp=16, ep=64, world_size=2048), hw)[
        "trainer_overrides"]


def test_cp_validation():
    cfg, hw = load_model_config("k3_tiny", **TINY), load_hardware("cpu")
    with pytest.raises(ValueError, match="data.seq_len=1000 must be a multiple of parallel.cp=16"):
        P.make_plan(cfg, P.PlanConfig(cp=16, world_size=16, seq_len=1000), hw)
    with pytest.raises(ValueError, match="data.seq_len=1008 must be a multiple of parallel.cp x "
                                         "parallel.cp_balance_split = 16 x 2"):   # the default: balanced
        P.make_plan(cfg, P.PlanConfig(cp=16, world_size=16, seq_len=1008), hw)
    with pytest.raises(ValueError, match=r"parallel.cp x parallel.tp = 4 x 2"):
        P.make_plan(cfg, P.PlanConfig(cp=4, tp=2, world_size=8, seq_len=12), hw)
    with pytest.raises(ValueError, match=r"parallel.tp\*cp\*pp = 6 does not divide world_size=8"):
        P.make_plan(cfg, P.PlanConfig(cp=3, tp=2, world_size=8, seq_len=1200), hw)
    with pytest.raises(ValueError, match="conv halo"):
        P.make_plan(cfg, P.PlanConfig(cp=8, world_size=8, seq_len=16), hw)
    with pytest.raises(ValueError, match="parallel.cp=0"):
        P.PlanConfig(cp=0).resolved()
    tool = _tool()
    assert tool.main(["model=k3_tiny", "gpu=cpu", "world_size=3", "parallel.cp=3", "data.seq_len=1024"]) == 2
    p = P.make_plan(cfg, P.PlanConfig(cp=2, world_size=8, seq_len=1024), hw)
    assert p["layout"]["dp"] == 4 and p["layout"]["micro_batches"] * 4 == p["layout"]["global_batch_size"]
    assert "parallel.cp=2" in p["trainer_overrides"]


def test_tool_prints_cp(capsys):
    tool = _tool()
    assert tool.main(["model=k3_full", "gpu=h200", "world_size=4096", "parallel.tp=8", "parallel.cp=32",
                      "parallel.pp=16", "parallel.ep=64", "data.seq_len=1048576"]) == 0
    out = capsys.readouterr().out
    assert "layout tp=8 cp=32 pp=16 ep=64 dp=1" in out and "MLA prefix keys" in out
    assert "cp: KDA summaries + halos" in out and "+ cp " in out and "parallel.cp=32" in out


def _measure_layer_bytes(cp, B, T, kind, balance=False):
    """Max over cp threaded ranks of the bytes comm_log records in one forward + backward of a real
    k3_tiny KDA / MLA layer on its CP segment (fp32, packed rows crossing the CP boundaries)."""
    from megak3.model.kda import KimiDeltaAttention
    from megak3.model.mla import GatedMLA
    from parallel.kda_cp import comm_log
    from parallel.context_parallel import ContextParallel
    from parallel.testing import run_threaded

    cfg = load_model_config("k3_tiny", **TINY)
    cu = torch.tensor([0, T // 3, T + 5, 2 * T][: B + 2] if B == 2 else [0, T // 3, T])

    def rank_fn(group):
        torch.manual_seed(0)
        layer = KimiDeltaAttention(cfg) if kind == "kda" else GatedMLA(cfg)
        r = dist.get_rank(group)
        _, _, seq = ContextParallel(group, cp, r, balance=balance).shard(torch.zeros(B, T, dtype=torch.long), None, cu)
        x = torch.randn(B, T // cp, cfg.hidden_size, generator=torch.Generator().manual_seed(r)).requires_grad_()
        with comm_log() as log:
            layer(x, seq).square().mean().backward()
        return log.sent()

    return max(run_threaded(cp, rank_fn, timeout=120))


@pytest.mark.parametrize("balance", [False, True], ids=["contiguous", "balanced"])
@pytest.mark.parametrize("cp,B", [(4, 1), (2, 2)])
def test_cp_bytes_equal_comm_log_of_real_layers(cp, B, balance):
    cfg = load_model_config("k3_tiny", **TINY)
    T = 256
    pc = P.PlanConfig(cp=cp, world_size=cp, micro_batch_size=B, seq_len=T, precision="fp32",
                      cp_balance=balance).resolved()
    kda, mla = P.cp_layer_figures(cfg, pc, "kda"), P.cp_layer_figures(cfg, pc, "mla")
    got_kda = _measure_layer_bytes(cp, B, T, "kda")
    # cp = 2: no rank is in the middle, so none both sends a halo forward and its gradient back
    want_kda = kda["sent_fwd"] + kda["sent_bwd"] - (kda["halo_bwd"] if cp == 2 else 0)
    assert got_kda == want_kda
    assert _measure_layer_bytes(cp, B, T, "mla", balance) == mla["sent_fwd"] + mla["sent_bwd"]


@pytest.mark.slow
def test_million_token_min_gpus_uses_cp():
    """--min-gpus at data.seq_len=1048576 finds a fitting layout with cp > 1 on H200 and B200, and
    (H200) one node fewer fits no layout. The searches cost ~1 min each on a busy 2-core box, so the
    tool's printing of --min-gpus is left to test_readme's seq 32768 command."""
    cfg = load_model_config("k3_full")
    found = {}
    for gpu in ("h200", "b200"):
        hw = load_hardware(gpu)
        base = P.PlanConfig(seq_len=1048576)
        res = P.min_gpus(cfg, hw, base=base)
        p, w = res["plan"], res["world_size"]
        L = p["layout"]
        assert p["fits"] and L["cp"] > 1 and L["seq_len"] == 1048576 and L["world_size"] == w
        assert p["memory"]["total"] <= p["usable_memory"]
        assert L["tp"] * L["cp"] * L["dp"] * L["pp"] == w and f"parallel.cp={L['cp']}" in p["trainer_overrides"]
        assert not res["tried"][res["power_of_two"] // 2]
        if gpu == "h200":
            assert not P.search(cfg, w - hw.gpus_per_node, hw, top=1, base=base)
        found[gpu] = w
    assert found["b200"] < found["h200"]  # more memory per GPU
