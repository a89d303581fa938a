"""Balanced context parallelism for MLA (``parallel.cp_balance``, parallel/context_parallel.py).

Parity: a Gated-MLA layer under the balanced schedule (query blocks moved to the ranks computing them,
K/V expanded per key block, log-sum-exp merge) against the whole-sequence layer in one process: output,
input gradient and every parameter gradient within 1e-5 relative, at cp = 2, 4 and 8, packed (documents
across the CP boundaries, tests/test_context_parallel.py's rows) and unpacked, with key blocks equal to
the query blocks and, at cp 2, misaligned with them. ``latent_attention`` against ``chunked_attention``
of the fully expanded keys (fp64 inputs). Work: per-rank score entries at cp 4 and 8 on k3_tiny-sized
rows within 1.1x of the average (the contiguous placement's last rank is checked to exceed it), and
the largest K/V expansion on any rank is one key block, counted during a real run.
"""
import pytest
import torch
import torch.distributed as dist

from megak3.config import load_model_config
from megak3.model.mla import GatedMLA
from megak3.model.seqinfo import make_seq_info
from megak3.ops.attention import chunked_attention
from megak3.ops.latent_attention import latent_attention
from parallel.context_parallel import ContextParallel, balanced_blocks, mla_score_work
from parallel.testing import PARITY_MODEL as MODEL, run_distributed

B, T = 2, 48
CU = [0, 13, 24, 25, 48, 96]  # as tests/test_context_parallel.py: documents across every cp's cuts


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _layer():
    cfg = load_model_config("k3_tiny", **MODEL)
    torch.manual_seed(7)
    m = GatedMLA(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5))
    m.q_chunk, m.k_chunk = 7, 5  # chunk grids off the CP blocks
    g = torch.Generator().manual_seed(3)
    return m, torch.randn(B, T, cfg.hidden_size, generator=g), torch.randn(B, T, cfg.hidden_size, generator=g)


def _run(m, x, dy, seq):
    m.zero_grad()
    x = x.clone().requires_grad_()
    y = m(x, seq)
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


def _balanced_rank(rank, world, variants):
    m, x, dy = _layer()
    widest = []
    expand = m._expand

    def counting(latent):  # the keys expanded at once, forward and backward
        widest.append(latent.shape[1])
        return expand(latent)

    m._expand = counting
    out = {}
    sl = slice(rank * T // world, (rank + 1) * T // world)
    for packed in (True, False):
        for split, kb in variants:
            hook = ContextParallel(dist.group.WORLD, world, rank, balance=True, split=split)
            _, _, seq = hook.shard(torch.zeros(B, T, dtype=torch.long), None, torch.tensor(CU) if packed else None)
            seq.cp.key_block = kb
            y, gx, grads = _run(m, x[:, sl], dy[:, sl].contiguous(), seq)
            ys, gxs = [torch.empty_like(y) for _ in range(world)], [torch.empty_like(gx) for _ in range(world)]
            dist.all_gather(ys, y.contiguous())
            dist.all_gather(gxs, gx.contiguous())
            for g in grads.values():  # parameter gradients are partial sums over the CP ranks
                dist.all_reduce(g)
            out[packed, split, kb] = (torch.cat(ys, 1), torch.cat(gxs, 1), grads)
    return out, max(widest)


# (query blocks per rank, key block: 0 = the query block) per cp
VARIANTS = {2: ((2, 0), (2, 5), (4, 0)), 4: ((2, 0), (3, 0)), 8: ((2, 0),)}


@pytest.mark.parametrize("cp", list(VARIANTS))
def test_balanced_mla_matches_whole_sequence(cp):
    m, x, dy = _layer()
    refs = {p: _run(m, x, dy, make_seq_info(B, T, torch.tensor(CU) if p else None)) for p in (True, False)}
    results = run_distributed(_balanced_rank, cp, VARIANTS[cp], timeout_s=120)
    for (packed, split, kb), (y, gx, grads) in results[0][0].items():
        y_ref, gx_ref, g_ref = refs[packed]
        assert rel(y, y_ref) < 1e-5, (packed, split, kb)
        assert rel(gx, gx_ref) < 1e-5, (packed, split, kb)
        assert grads.keys() == g_ref.keys()
        for n in g_ref:
            assert rel(grads[n], g_ref[n]) < 1e-5, (packed, split, kb, n, rel(grads[n], g_ref[n]))
    h = T // (min(s for s, _ in VARIANTS[cp]) * cp)
    widest = [w for _, w in results]
    assert max(widest) == max(h, max(k for _, k in VARIANTS[cp])), widest  # one key block, not the prefix
    assert T // cp * cp > max(widest)  # the contiguous placement's last rank would expand all T keys


def test_latent_attention_matches_chunked_attention():
    torch.manual_seed(0)
    Bq, H, L, K, V, Tk, q0, Tq = 2, 3, 5, 4, 6, 20, 8, 12
    W = torch.randn(L, H * (K + V), dtype=torch.float64, requires_grad=True)

    def expand(lat):
        kv = (lat @ W).view(lat.shape[0], lat.shape[1], H, K + V).transpose(1, 2)
        return kv[..., :K], kv[..., K:]

    lat = torch.randn(Bq, Tk, L, dtype=torch.float64, requires_grad=True)
    q = torch.randn(Bq, H, Tq, K, dtype=torch.float64, requires_grad=True)
    doc = torch.tensor([[0] * 5 + [1] * 10 + [2] * 5, [0] * 20])  # row 0: a query block starting mid-document
    for d in (None, doc):
        o = latent_attention(q, lat, expand, [W], 0.5, None if d is None else d[:, q0:], d, q_pos0=q0, k_block=3,
                             q_chunk=5, k_chunk=2)
        g = torch.randn_like(o)
        got = torch.autograd.grad(o, [q, lat, W], g)
        k, v = expand(lat)
        o_ref = chunked_attention(q, k, v, 0.5, d, q_chunk=4, k_chunk=3, q_offset=q0)
        want = torch.autograd.grad(o_ref, [q, lat, W], g)
        assert rel(o, o_ref) < 1e-5
        for a, b in zip(got, want):
            assert rel(a, b) < 1e-5


def test_balanced_blocks_cover_every_block_once():
    for cp in (2, 3, 4, 8, 32):
        for split in (1, 2, 4):
            for work in (None, [(b * 7919) % 13 + 1 for b in range(split * cp)]):
                got = [balanced_blocks(cp, r, work, split) for r in range(cp)]
                assert all(len(g) == split for g in got), (cp, split, got)
                assert sorted(b for g in got for b in g) == list(range(split * cp)), cp
    assert [balanced_blocks(4, r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]  # head-tail


@pytest.mark.parametrize("cp", [4, 8])
def test_per_rank_mla_work_is_balanced(cp):
    """k3_tiny's chunk sizes (256) at T = 64K: one document per row (split 2 and 4) and
    tools/bench_long_context.py's row of three documents (split 4)."""
    Tn = 65536
    bench_cu = sorted({0, Tn // 3 - 5, Tn // 3 - 5 + Tn // 2, Tn})
    for cu, split in ((None, 2), (None, 4), (bench_cu, 4)):
        bal = mla_score_work(Tn, cp, True, cu_seqlens=cu, split=split)
        avg = sum(bal) / cp
        assert max(bal) <= 1.1 * avg, (cu, split, [w / avg for w in bal])
        con = mla_score_work(Tn, cp, False, cu_seqlens=cu)
        assert sum(con) == sum(bal)  # the same score entries, spread differently
        assert max(con) > 1.4 * sum(con) / cp, [w * cp / sum(con) for w in con]  # what balancing fixes


# ---- the production step under cp_balance (megak3.train.parity.run_steps) -----------------------------
def _balanced_steps(rank, world, steps):
    import parallel.context_parallel as cpmod
    from megak3.train.parity import run_steps

    # the parity job's ParallelConfig leaves cp_balance at its default (true): count that it took it
    calls, attend = [0], cpmod.CPShard.balanced_attention

    def counted(self, *a, **k):
        calls[0] += 1
        return attend(self, *a, **k)

    cpmod.CPShard.balanced_attention = counted
    return run_steps(rank, world, 1, 1, False, steps, MODEL, cp=world), calls[0]


def test_training_step_matches_single_process():
    """cp4 through the production RankStep with the default config (cp_balance on): every MLA forward
    takes the balanced schedule; losses, grad norms and the step-0 gradient of every parameter as
    tests/test_context_parallel.py's tolerances."""
    from megak3.train.parity import run_steps

    ref = run_steps(0, 1, 1, 1, False, 2, MODEL)
    got, calls = run_distributed(_balanced_steps, 4, 2, timeout_s=300)[0]
    n_mla = load_model_config("k3_tiny", **MODEL).layer_kinds().count("mla")
    assert calls == 2 * n_mla > 0  # every MLA forward of both steps took the balanced schedule
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= 1e-4, (got["losses"], ref["losses"])
    for a, b in zip(got["grad_norms"], ref["grad_norms"]):
        assert abs(a - b) <= 1e-5 * b, (got["grad_norms"], ref["grad_norms"])
    diff2 = ref2 = 0.0
    for n, g_ref in ref["grads"].items():
        d = float((got["grads"][n].double() - g_ref.double()).norm())
        assert d <= 5e-5 * max(float(g_ref.norm()), 1e-30), n
        diff2, ref2 = diff2 + d * d, ref2 + float(g_ref.double().norm()) ** 2
    assert (diff2 / ref2) ** 0.5 <= 1e-5


def test_planner_cp_balance_terms():
    """The planner under cp_balance: no (2cp-1)/cp factor on the MLA scores (compute down), the MLA CP
    memory is the gathered latent + the computed blocks' q, o, lse (nothing per expanded key)."""
    from megak3.launch.hardware import load_hardware
    from megak3.launch.planner import PlanConfig, layer_activations, make_plan

    cfg, hw = load_model_config("k3_tiny"), load_hardware("h200")
    kw = dict(cp=4, world_size=4, seq_len=65536, precision="fp32")
    con, bal = (make_plan(cfg, PlanConfig(cp_balance=b, **kw), hw) for b in (False, True))
    assert bal["time"]["compute_s"] < 0.75 * con["time"]["compute_s"]
    mla = cfg.layer_kinds().index("mla")
    m, T, t = cfg.mla, 65536, 65536 // 4
    L, qk = m.kv_lora_rank + m.qk_rope_head_dim, m.qk_nope_head_dim + m.qk_rope_head_dim
    want = T * (L * 4 + 8) + t * m.num_heads * (qk + m.v_head_dim + 1) * 4
    assert layer_activations(cfg, PlanConfig(cp_balance=True, **kw).resolved(), mla)["cp_saved"] == want
    assert layer_activations(cfg, PlanConfig(**kw).resolved(), mla)["cp_saved"] == want   # the default
    assert layer_activations(cfg, PlanConfig(cp_balance=False, **kw).resolved(), mla)["cp_saved"] > 2 * want


def test_config_refuses_bad_balance_settings():
    from parallel.config import ParallelConfig
    from parallel.context_parallel import check_context_parallel

    for kw, field in ((dict(cp_balance="yes"), "parallel.cp_balance="), (dict(cp_balance_split=0), "cp_balance_split"),
                      (dict(cp=2, pp=2, cp_balance=True, pp_schedule="zb_h1"), "zb_h1")):
        with pytest.raises(ValueError, match=field):
            ParallelConfig(**kw).validate(4)
    with pytest.raises(ValueError, match="cp_balance_split"):
        check_context_parallel(4, 1, False, 40, balance_split=4)  # 40 is not a multiple of 4 x 4
    check_context_parallel(4, 1, False, 48, balance_split=4)
