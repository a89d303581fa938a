"""ZeRO-1 ShardedOptimizer (parallel/data_parallel/) against single-process megak3.optim training.

Multi-rank tests run N ranks as threads on torch's threaded process group (real data exchange, no
processes); one test runs two gloo processes to check the collectives the production CPU backend
must support. Every rank trains on its own slice of the same global batch; the reference trains one
model on the whole batch with build_optimizer. Loss contract (see the module docstring): each rank
backpropagates loss_sum_local / global_tokens and DP sums the gradients.
"""
import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megak3.checkpoint import atomic
from megak3.checkpoint.train_state import TrainCheckpoint
from megak3.model.norm import RMSNorm
from megak3.optim import OptimConfig, build_optimizer, lr_at, set_lr
from parallel import testing
from parallel.data_parallel import ShardedOptimizer, assign_owners, plan_buckets
from parallel.grid import Layout
from parallel.plan import ParallelPlan, Shard, canonical_name
from parallel.state import ParallelState

STEPS = 4
CFG = OptimConfig(lr=2e-2, warmup_steps=1, schedule="cosine", grad_clip=0.05)
# grad_clip = 0.05 is below the unclipped norms here (~0.3), so clipping scales every step


# ------------------------------------------------------------------ threaded multi-rank harness
def run_threaded(world_size: int, fn, timeout: float = 60.0) -> list:
    """``fn(rank, group)`` on threaded ranks (parallel.testing.run_threaded)."""
    return testing.run_threaded(world_size, lambda group: fn(dist.get_rank(group), group), timeout)


# ------------------------------------------------------------------ a small model on the naming contract
class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d, bias=False) for _ in range(4))

    def per_head_params(self):
        return {"q_proj.weight": self.heads, "k_proj.weight": self.heads, "v_proj.weight": self.heads}

    def forward(self, x_BTD):
        B, T, D = x_BTD.shape
        q, k, v = (p(x_BTD).view(B, T, self.heads, -1).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, D))


class Experts(nn.Module):
    def __init__(self, E, d, m):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, m, d) * d ** -0.5)
        self.w3 = nn.Parameter(torch.randn(E, m, d) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(E, d, m) * m ** -0.5)

    def forward(self, x_TD, p_TE):  # dense soft mixture: every expert sees every token
        h_ETm = F.silu(torch.einsum("td,emd->etm", x_TD, self.w1)) * torch.einsum("td,emd->etm", x_TD, self.w3)
        return torch.einsum("etm,edm,te->td", h_ETm, self.w2, p_TE)


class MoE(nn.Module):
    def __init__(self, d, E, m):
        super().__init__()
        self.gate = nn.Linear(d, E, bias=False)
        self.experts = Experts(E, d, m)

    def forward(self, x_BTD):
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        return self.experts(x_TD, self.gate(x_TD).softmax(-1)).view_as(x_BTD)


class Layer(nn.Module):
    def __init__(self, d, heads, E, m):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d), RMSNorm(d)
        self.self_attn, self.mlp = Attention(d, heads), MoE(d, E, m)

    def forward(self, h):
        h = h + self.self_attn(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, layers=2, E=4, m=16):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, E, m) for _ in range(layers))
        self.norm, self.lm_head = RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids, labels):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h)).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def tiny_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return TinyLM().to(dtype)


def tiny_loss_sum(model, ids, labels):
    return model(ids, labels)


def k3_model():
    from conftest import SMALL_MODEL
    from megak3.config import load_model_config
    from megak3.model.k3 import build_model
    torch.manual_seed(0)
    return build_model(load_model_config("k3_tiny", **{**SMALL_MODEL, "num_layers": 4, "vocab_size": 128}))


def k3_loss_sum(model, ids, labels):
    return model(ids, labels=labels).loss_sum


def make_batches(vocab, rows, seq, steps, seed=1):
    """Per step (input_ids, labels) [rows, seq]; some labels are -100 so ranks hold unequal token counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(4, vocab, (rows, seq), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        labels[torch.rand(rows, seq, generator=g) < 0.3] = -100
        labels[0, : seq // 2] = -100  # rank 0 always has fewer tokens
        out.append((ids, labels))
    return out


def fp32_newton_schulz(opt):
    """bf16 NS makes equal-up-to-rounding inputs differ by bf16 steps; compare the math in fp32."""
    for g in opt.param_groups:
        if "ns_dtype" in g:
            g["ns_dtype"] = "float32"


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def reference_run(model, loss_fn, batches, cfg=CFG, micro=1):
    """Single-process training (build_optimizer) on the whole batch: params after each step, grad norms.

    ``micro`` > 1 accumulates the global-mean gradient over that many row slices (grad accumulation,
    the same slices the DP ranks get), so the reference gradient is rounded like the DP sum.
    """
    opt = build_optimizer(model, cfg)
    fp32_newton_schulz(opt)
    params, norms = [], []
    for step, (ids, labels) in enumerate(batches):
        tokens = (labels != -100).sum()
        for ids_m, labels_m in zip(ids.chunk(micro), labels.chunk(micro)):
            (loss_fn(model, ids_m, labels_m) / tokens).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)))
        set_lr(opt, lr_at(step, cfg, len(batches)))
        opt.step()
        opt.zero_grad()
        params.append(snapshot(model))
    return params, norms


def dp_train(rank, group, model, loss_fn, batches, cfg=CFG, opt_cls=ShardedOptimizer, bucket_bytes=2048,
             steps=None, opt=None):
    """One rank: own rows [rank·b, (rank+1)·b) of each global batch; returns params, norms, optimizer."""
    world = group.size()
    opt = opt or opt_cls(model, cfg, group, bucket_bytes=bucket_bytes)
    fp32_newton_schulz(opt)
    params, norms = [], []
    for step in range(len(batches)) if steps is None else steps:
        ids, labels = batches[step]
        b = ids.shape[0] // world
        ids, labels = ids[rank * b:(rank + 1) * b], labels[rank * b:(rank + 1) * b]
        tokens = (labels != -100).sum().reshape(1)
        dist.all_reduce(tokens, group=group)  # global token count: the loss is the global token mean
        (loss_fn(model, ids, labels) / tokens[0]).backward()
        opt.reduce_gradients()
        norms.append(float(opt.clip_grad_norm_(cfg.grad_clip)))
        set_lr(opt, lr_at(step, cfg, len(batches)))
        opt.step()
        opt.zero_grad()
        params.append(snapshot(model))
    return params, norms, opt


def max_rel_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)


# ------------------------------------------------------------------ tests
def test_ownership_balanced_deterministic_and_layout_exact():
    model = k3_model()
    numels = [p.numel() for p in model.parameters()]
    for world in (2, 4, 8):
        owners = assign_owners(numels, world)
        assert owners == assign_owners(numels, world)
        load = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world)]
        # greedy LPT: no rank exceeds the mean by more than the largest parameter
        assert max(load) - sum(load) / world <= max(numels), load
        print(f"dp={world}: numel per rank max/min = {max(load)}/{min(load)} = {max(load) / min(load):.3f}")
        buckets = plan_buckets(numels, owners, world, bucket_numel=4096)
        seen = []
        for seg_len, entries in buckets:
            for r in range(world):
                spans = sorted((off, off + numels[i]) for i, o, off in entries if o == r)
                assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and (not spans or spans[-1][1] <= seg_len)
            assert all(owners[i] == o for i, o, _ in entries)
            seen += [i for i, _, _ in entries]
        assert sorted(seen) == list(range(len(numels)))  # every param in exactly one bucket
        padding = 1 - sum(numels) / sum(world * s for s, _ in buckets)
        assert padding < 0.25, padding


@pytest.mark.parametrize("world", [2, 4])
def test_parity_with_single_process(world):
    base = tiny_model()
    batches = make_batches(64, rows=4, seq=12, steps=STEPS)
    ref_params, ref_norms = reference_run(copy.deepcopy(base), tiny_loss_sum, batches)
    # same global-mean gradient accumulated over the ranks' row slices: rounded like the DP sum
    acc_params, acc_norms = reference_run(copy.deepcopy(base), tiny_loss_sum, batches, micro=world)
    res = run_threaded(world, lambda r, g: dp_train(r, g, copy.deepcopy(base), tiny_loss_sum, batches)[:2])
    for rank, (params, norms) in enumerate(res):
        for step in range(STEPS):
            assert max_rel_diff(params[step], ref_params[step]) <= 1e-5, (rank, step)  # measured ~1.5e-6
            assert max_rel_diff(params[step], acc_params[step]) <= 1e-6, (rank, step)  # measured 0
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        assert norms == pytest.approx(acc_norms, rel=1e-6)
    assert all(n > CFG.grad_clip for n in ref_norms)  # clipping was active


def test_parity_real_k3_tiny():
    """The real model (KDA + MLA Per-Head Muon, stacked experts, AttnRes, norms) at dp=2.

    The reference accumulates the global-mean gradient over the same two row slices, so both sides
    see gradients rounded alike; what is left is the optimizer, which must then agree to ~1e-7.
    (Against a whole-batch backward the difference is ~5e-6 here: AdamW's first steps are
    ~lr·sign(g), which turns batch-split rounding of near-zero gradients, e.g. dt_bias, into that.)
    """
    base = k3_model()
    batches = make_batches(128, rows=2, seq=16, steps=3)
    ref_params, ref_norms = reference_run(copy.deepcopy(base), k3_loss_sum, batches, micro=2)
    res = run_threaded(2, lambda r, g: dp_train(r, g, copy.deepcopy(base), k3_loss_sum, batches,
                                                bucket_bytes=64 * 1024)[:2])
    for params, norms in res:
        for step in range(3):
            assert max_rel_diff(params[step], ref_params[step]) <= 1e-6, step
        assert norms == pytest.approx(ref_norms, rel=1e-6)


class SkipReduction(ShardedOptimizer):
    """Broken on purpose: each owner keeps only its local gradient (no sum over ranks)."""

    def _reduce_scatter(self, out, flat, group):
        out.copy_(flat.view(group.size(), -1)[group.rank()])


def test_broken_reduction_breaks_parity():
    base = tiny_model()
    batches = make_batches(64, rows=4, seq=12, steps=2)
    ref_params, ref_norms = reference_run(copy.deepcopy(base), tiny_loss_sum, batches)
    res = run_threaded(2, lambda r, g: dp_train(r, g, copy.deepcopy(base), tiny_loss_sum, batches,
                                                opt_cls=SkipReduction)[:2])
    for params, norms in res:
        assert max_rel_diff(params[0], ref_params[0]) > 1e-3
        assert norms[0] != pytest.approx(ref_norms[0], rel=1e-3)


def test_state_dict_round_trip_and_layout_check():
    base = tiny_model()
    batches = make_batches(64, rows=4, seq=12, steps=STEPS)

    def fn(rank, group):
        straight = dp_train(rank, group, copy.deepcopy(base), tiny_loss_sum, batches)[0]
        model = copy.deepcopy(base)
        _, _, opt = dp_train(rank, group, model, tiny_loss_sum, batches, steps=range(2))
        saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
        resumed = copy.deepcopy(base)
        resumed.load_state_dict(saved_model)
        opt2 = ShardedOptimizer(resumed, CFG, group, bucket_bytes=2048)
        opt2.load_state_dict(saved_opt)
        after = dp_train(rank, group, resumed, tiny_loss_sum, batches, steps=range(2, STEPS), opt=opt2)[0]
        with pytest.raises(ValueError, match="saved by rank"):  # another rank's shard
            ShardedOptimizer(copy.deepcopy(base), CFG, group).load_state_dict({**saved_opt, "rank": [1 - rank]})
        return straight, after, saved_opt

    res = run_threaded(2, fn)
    for straight, after, _ in res:
        for k in straight[-1]:
            assert torch.equal(after[-1][k], straight[-1][k]), k
    assert res[0][2]["ownership"] == res[1][2]["ownership"]
    assert res[0][2]["muon"]["state"] and res[0][2]["adamw"]["state"]  # the shard really holds state
    fresh = ShardedOptimizer(copy.deepcopy(base), CFG, None)
    with pytest.raises(ValueError, match="does not match this layout"):
        fresh.load_state_dict(res[1][2])  # saved at dp=2, loading at dp=1


def test_different_models_on_ranks_are_rejected():
    def fn(rank, group):
        model = tiny_model()
        if rank == 1:
            model.extra = nn.Linear(4, 4, bias=False)
        ShardedOptimizer(model, CFG, group)

    with pytest.raises(ValueError, match="see different models"):
        run_threaded(2, fn)


def test_optimizer_state_bytes_per_rank():
    base = tiny_model()
    batches = make_batches(64, rows=4, seq=12, steps=1)
    world = 4
    ref = build_optimizer(copy.deepcopy(base), CFG)
    reps = run_threaded(world, lambda r, g: dp_train(r, g, copy.deepcopy(base), tiny_loss_sum, batches)[2]
                        .memory_report())
    n_adam = [sum(1 for i, s in enumerate(ref.specs) if s.optimizer == "adamw"
                  and assign_owners([t.param.numel() for t in ref.specs], world)[i] == r) for r in range(world)]
    total_state = sum((4 if s.optimizer == "muon" else 8) * s.param.numel() for s in ref.specs)
    largest = max(s.param.numel() for s in ref.specs)
    for r, rep in enumerate(reps):
        print(f"rank {r}: main {rep['main_param_bytes']} B, state {rep['optimizer_state_bytes']} B, "
              f"expected total/dp {rep['expected_state_bytes']:.0f} B, imbalance {rep['imbalance']:.3f}")
        # measured = analytic for the owned params (+ one 4-byte AdamW step counter per param)
        assert rep["optimizer_state_bytes"] == rep["owned_expected_state_bytes"] + 4 * n_adam[r]
        assert rep["expected_state_bytes"] == total_state / world
        # whole-parameter ownership: off total/dp by at most the largest parameter
        assert abs(rep["owned_numel"] - rep["total_numel"] / world) <= largest
        assert abs(rep["optimizer_state_bytes"] - total_state / world) <= 8 * largest + 4 * n_adam[r]
    assert sum(rep["owned_numel"] for rep in reps) == reps[0]["total_numel"]


def test_single_process_equals_build_optimizer_and_bf16_main_copies():
    base = tiny_model()
    batches = make_batches(64, rows=2, seq=8, steps=2)
    ref_params, _ = reference_run(copy.deepcopy(base), tiny_loss_sum, batches)
    model = copy.deepcopy(base)
    opt = ShardedOptimizer(model, CFG, None)
    fp32_newton_schulz(opt)
    for step, (ids, labels) in enumerate(batches):
        (tiny_loss_sum(model, ids, labels) / (labels != -100).sum()).backward()
        opt.reduce_gradients()
        opt.clip_grad_norm_(CFG.grad_clip)
        set_lr(opt, lr_at(step, CFG, len(batches)))
        opt.step()
        opt.zero_grad()
    assert max_rel_diff(snapshot(model), ref_params[-1]) == 0.0

    # bf16 model: every rank ends with the bf16 rounding of the owner's fp32 main copy
    bf = tiny_model(dtype=torch.bfloat16)

    def fn(rank, group):
        m = copy.deepcopy(bf)
        _, _, o = dp_train(rank, group, m, tiny_loss_sum, batches)
        for i, main in o.main.items():
            assert main.dtype == torch.float32 and main.data_ptr() != o.specs[i].param.data_ptr()
            assert torch.equal(o.specs[i].param, main.to(torch.bfloat16))
        assert set(o.state_dict()["main_params"]) == {o.specs[i].name for i in o.main}
        return snapshot(m)

    a, b = run_threaded(2, fn)
    assert all(torch.equal(a[k], b[k]) for k in a) and max_rel_diff(a, snapshot(bf)) > 0


def test_expert_params_on_their_own_group():
    """edp_group path: experts get separate ownership and buckets; result unchanged (edp = dp ranks here)."""
    base = tiny_model()
    batches = make_batches(64, rows=4, seq=12, steps=2)
    ref_params, ref_norms = reference_run(copy.deepcopy(base), tiny_loss_sum, batches)

    def fn(rank, group):
        edp = dist.new_group(ranks=[0, 1])
        model = copy.deepcopy(base)
        opt = ShardedOptimizer(model, CFG, group, edp_group=edp, bucket_bytes=2048)
        assert {opt.groups[opt.group_of[i]] is edp for i, s in enumerate(opt.specs)
                if ".mlp.experts." in s.name} == {True}
        assert {b.group_id for b in opt.buckets} == {0, 1}
        return dp_train(rank, group, model, tiny_loss_sum, batches, opt=opt)[:2]

    for params, norms in run_threaded(2, fn):
        assert max_rel_diff(params[-1], ref_params[-1]) <= 1e-5
        assert norms == pytest.approx(ref_norms, rel=1e-5)


def test_param_without_gradient_is_left_alone():
    """A param no rank produced a gradient for keeps grad None: no update, no weight decay (as single-process)."""
    base = tiny_model()
    base.unused = nn.Linear(8, 8, bias=False)  # Muon + weight decay if it were stepped
    batches = make_batches(64, rows=4, seq=12, steps=2)
    ref_params, _ = reference_run(copy.deepcopy(base), tiny_loss_sum, batches, micro=2)
    assert torch.equal(ref_params[-1]["unused.weight"], base.unused.weight)
    for params, _ in run_threaded(2, lambda r, g: dp_train(r, g, copy.deepcopy(base), tiny_loss_sum, batches)[:2]):
        assert max_rel_diff(params[-1], ref_params[-1]) <= 1e-6


class GatedExtraLM(TinyLM):
    """TinyLM with a layer that only rows starting with an even token id run (Muon weight + AdamW
    bias): whether it gets a gradient depends on the batch, as the vision tower's does."""

    def __init__(self, declare=True):
        super().__init__()
        self.extra = nn.Linear(32, 32, bias=True)
        self.declare = declare

    def batch_dependent_parameters(self):
        return list(self.extra.parameters()) if self.declare else []

    def forward(self, input_ids, labels):
        h = self.embed_tokens(input_ids)
        if int(input_ids[0, 0]) % 2 == 0:  # host batch: a data-dependent branch
            h = h + self.extra(h)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.norm(h)).float()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def _gated_batches():
    """4 steps of 4 rows; rank r (2 ranks) gets rows 2r, 2r+1 and runs ``extra`` when row 2r starts
    even: step 0 rank 0 only, step 1 no rank, step 2 both, step 3 rank 1 only (and step 1 again
    after it has state: it must stay untouched)."""
    batches = make_batches(64, rows=4, seq=12, steps=5)
    for (ids, _), (r0, r1) in zip(batches, [(1, 0), (0, 0), (1, 1), (0, 1), (0, 0)]):
        ids[0, 0], ids[2, 0] = 4 if r0 else 5, 6 if r1 else 7
    return batches


def test_batch_dependent_param_is_reduced_without_host_sync_and_left_alone_when_unused():
    """A declared batch-dependent param: updated when any rank had a gradient (the sum of theirs),
    left alone (value, Muon momentum, Adam moments and step) when none had; equals single-process
    training over the same micro-batches, and reduce_gradients reads nothing on the host after
    its first call (the static-presence check)."""
    import test_host_syncs

    base = GatedExtraLM()
    batches = _gated_batches()
    ref_params, ref_norms = reference_run(copy.deepcopy(base), tiny_loss_sum, batches, micro=2)
    assert torch.equal(ref_params[1]["extra.weight"], ref_params[0]["extra.weight"])   # step 1: untouched
    assert not torch.equal(ref_params[2]["extra.weight"], ref_params[1]["extra.weight"])

    def fn(rank, group):
        model = copy.deepcopy(base)
        opt = ShardedOptimizer(model, CFG, group, bucket_bytes=2048)
        params, norms, _ = dp_train(rank, group, model, tiny_loss_sum, batches, opt=opt, steps=[0])
        with test_host_syncs.HostSyncSpy() as spy:
            more = dp_train(rank, group, model, tiny_loss_sum, batches, opt=opt, steps=range(1, 5))
        return params + more[0], norms + more[1], [e for e in spy.events if "grads.py" in e[1]]

    for params, norms, events in run_threaded(2, fn):
        assert events == []
        for step in range(5):
            assert max_rel_diff(params[step], ref_params[step]) <= 1e-5, step
        assert torch.equal(params[4]["extra.weight"], params[3]["extra.weight"])
        assert norms == pytest.approx(ref_norms, rel=1e-5)


def test_undeclared_batch_dependent_param_is_refused():
    """The static rule is checked at the first step: a param with a gradient on one rank only that
    the model does not declare raises, naming it (instead of a silently lost gradient)."""
    base = GatedExtraLM(declare=False)
    batches = _gated_batches()
    with pytest.raises(Exception, match="extra.weight"):
        run_threaded(2, lambda r, g: dp_train(r, g, copy.deepcopy(base), tiny_loss_sum, batches, steps=[0]))


def _gloo_worker(rank, world, init_file, out_dir):
    import datetime
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        base = tiny_model()
        batches = make_batches(64, rows=4, seq=12, steps=3)
        params, norms, _ = dp_train(rank, dist.group.WORLD, base, tiny_loss_sum, batches)
        torch.save({"params": params, "norms": norms}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_gloo_processes(tmp_path):
    """The production CPU backend: reduce_scatter_single / all_gather_single / all_reduce on gloo."""
    import torch.multiprocessing as mp
    # fork, not spawn: the ranks inherit the imported torch (a spawn re-imports it, ~2 s CPU per rank)
    ctx = mp.start_processes(_gloo_worker, args=(2, str(tmp_path / "rdv"), str(tmp_path)), nprocs=2,
                             join=False, start_method="fork")
    deadline = time.monotonic() + 90
    while not ctx.join(timeout=5):  # returns each time a rank exits; raises if one failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("gloo ranks did not finish within 90 s")
    base = tiny_model()
    batches = make_batches(64, rows=4, seq=12, steps=3)
    ref_params, ref_norms = reference_run(copy.deepcopy(base), tiny_loss_sum, batches, micro=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for step in range(3):
            assert max_rel_diff(got["params"][step], ref_params[step]) <= 1e-6, (rank, step)
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-6)


class NoData:
    """The batcher position a TrainCheckpoint saves (these tests pick their batches by step)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        assert state == {}


def checkpoint_for(model, opt, root, ps=None, tp_dim=None) -> TrainCheckpoint:
    """The trainer's checkpoint adapter for ``model`` / ``opt`` on ``ps`` (one process by default),
    with a plan whose boxes split each param in ``tp_dim`` (canonical name -> dim) into ``ps.tp_size``
    chunks, chunk ``ps.tp_rank`` held here, and hold every other tensor whole."""
    ps = ps or ParallelState.single()
    tensors = {}
    for n, t in model.state_dict().items():
        n, shape, dim = canonical_name(n), tuple(t.shape), (tp_dim or {}).get(canonical_name(n))
        if dim is None:
            tensors[n] = Shard(shape, (0,) * len(shape), shape)
        else:
            full = tuple(s * ps.tp_size if d == dim else s for d, s in enumerate(shape))
            offsets = tuple(s * ps.tp_rank if d == dim else 0 for d, s in enumerate(shape))
            tensors[n] = Shard(full, offsets, shape, axis="tp", dim=dim)
    plan = ParallelPlan(ps=ps, sequence_parallel=False, tensors=tensors)
    return TrainCheckpoint(root, model, opt, plan, ps, NoData(), "cpu", {"tp": ps.tp_size}, {})


def train_tiny(model, opt, batches, steps):
    fp32_newton_schulz(opt)
    for step in steps:
        ids, labels = batches[step]
        (tiny_loss_sum(model, ids, labels) / (labels != -100).sum()).backward()
        opt.reduce_gradients()
        opt.clip_grad_norm_(CFG.grad_clip)
        set_lr(opt, lr_at(step, CFG, STEPS))
        opt.step()
        opt.zero_grad()
    return snapshot(model)


def test_checkpoint_round_trip_single_process(tmp_path):
    """TrainCheckpoint.save after 2 steps -> TrainCheckpoint.load into a fresh model and optimizer
    resumes bit-exactly; before the first step every param is exported with empty state, and loading
    a checkpoint saved then empties the optimizer again; a checkpoint of another model (a larger
    vocabulary) is a ValueError naming the tensor."""
    base = tiny_model()
    batches = make_batches(64, rows=2, seq=8, steps=STEPS)
    model = copy.deepcopy(base)
    opt = ShardedOptimizer(model, CFG, None)
    empty = opt.export_state()
    assert set(empty["state"]) == {s.name for s in opt.specs} and all(v == {} for v in empty["state"].values())
    checkpoint_for(model, opt, tmp_path).save(0)
    ref_model = copy.deepcopy(base)
    ref = train_tiny(ref_model, ShardedOptimizer(ref_model, CFG, None), batches, range(STEPS))
    train_tiny(model, opt, batches, range(2))
    checkpoint_for(model, opt, tmp_path).save(2)
    resumed = tiny_model(seed=1)  # other weights: everything comes from the checkpoint
    opt2 = ShardedOptimizer(resumed, CFG, None)
    ck2 = checkpoint_for(resumed, opt2, tmp_path)
    assert ck2.load(tmp_path / atomic.step_dirname(2))["step"] == 2
    assert max_rel_diff(train_tiny(resumed, opt2, batches, range(2, STEPS)), ref) == 0.0
    ck2.load(tmp_path / atomic.step_dirname(0))  # back to "never stepped"
    assert not opt2.muon.state and not opt2.adamw.state
    torch.manual_seed(0)
    other = TinyLM(vocab=128)
    checkpoint_for(other, ShardedOptimizer(other, CFG, None), tmp_path / "other").save(1)
    with pytest.raises(ValueError, match="embed_tokens.weight has shape .* different model config"):
        ck2.load(tmp_path / "other" / atomic.step_dirname(1))


def test_checkpoint_load_reads_each_tp_rank_its_box(tmp_path):
    """A checkpoint saved in one process (vocabulary 128) loads on 2 TP ranks whose plan splits the
    vocab-parallel embedding and lm_head along dim 0 (vocabulary 64 each): each rank's model tensors
    and the optimizer state of the params it owns are chunk tp_rank of the saved ones; replicated
    params and scalars are taken whole."""
    torch.manual_seed(0)
    full_model = TinyLM(vocab=128)
    opt = ShardedOptimizer(full_model, CFG, None)
    fp32_newton_schulz(opt)
    ids, labels = make_batches(128, rows=2, seq=8, steps=1)[0]
    (tiny_loss_sum(full_model, ids, labels) / (labels != -100).sum()).backward()
    opt.reduce_gradients()
    set_lr(opt, lr_at(0, CFG, STEPS))
    opt.step()
    checkpoint_for(full_model, opt, tmp_path).save(1)
    saved, saved_model = opt.export_state()["state"], copy.deepcopy(full_model.state_dict())
    dims = {"embed_tokens.weight": 0, "lm_head.weight": 0}

    def load(rank, group):
        model = tiny_model(seed=1)
        o = ShardedOptimizer(model, CFG, None)
        o.set_tensor_parallel(group, {s.name: dims.get(s.name) for s in o.specs})
        ps = ParallelState(layout=Layout(world_size=2, tp=2), rank=rank, world_size=2, tp_group=group,
                           tp_size=2, tp_rank=rank)
        checkpoint_for(model, o, tmp_path, ps, dims).load(tmp_path / atomic.step_dirname(1))
        return o.export_state()["state"], copy.deepcopy(model.state_dict())

    for rank, (got, got_model) in enumerate(run_threaded(2, load)):
        assert got_model.keys() == saved_model.keys()
        for n, v in saved_model.items():
            want = v.chunk(2, dims[n])[rank] if n in dims else v
            assert torch.equal(got_model[n], want), (rank, n)
        for n, st in saved.items():
            assert got[n].keys() == st.keys() and st, n
            for k, v in st.items():
                want = v.chunk(2, dims[n])[rank] if n in dims and v.ndim else v
                assert torch.equal(torch.as_tensor(got[n][k]), torch.as_tensor(want)), (rank, n, k)
    assert any(n in dims for n in saved) and any(n not in dims for n in saved)


def test_norm_partition_sums_squares_over_ranks_holding_different_params():
    """Pipeline-style (every param) and EP-style (experts only) partitions give the full model's norm."""
    class Net(nn.Module):
        def __init__(self, part):
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)             # a 'dense' param, different per rank
            block = nn.Module()                               # named like K3: layers.0.mlp.experts.w
            block.mlp = nn.Module()
            block.mlp.experts = nn.Module()
            block.mlp.experts.w = nn.Parameter(torch.zeros(2, 3, 4))
            self.layers = nn.ModuleList([block])

    torch.manual_seed(0)
    grads = {r: (torch.randn(4, 4), torch.randn(2, 3, 4)) for r in range(2)}
    shared_dense = torch.randn(4, 4)

    def fn(rank, group):
        out = {}
        for mode in ("all", "experts"):
            net = Net(rank)
            net.a.weight.grad = (grads[rank][0] if mode == "all" else shared_dense).clone()
            net.layers[0].mlp.experts.w.grad = grads[rank][1].clone()
            opt = ShardedOptimizer(net, CFG, None)
            opt.add_norm_partition(group, experts_only=(mode == "experts"))
            opt.reduce_gradients()
            out[mode] = float(opt.clip_grad_norm_(float("inf")))
        return out

    res = run_threaded(2, fn)
    full_all = torch.cat([g.reshape(-1) for r in range(2) for g in grads[r]]).norm()
    full_exp = torch.cat([shared_dense.reshape(-1)] + [grads[r][1].reshape(-1) for r in range(2)]).norm()
    for r in range(2):
        assert res[r]["all"] == pytest.approx(float(full_all), rel=1e-6)
        assert res[r]["experts"] == pytest.approx(float(full_exp), rel=1e-6)
