"""Tensor/sequence parallelism against the single-process nn.Linear / nn.Embedding / F.cross_entropy
with the same full weights: the autograd mappings of parallel/tensor_parallel/collectives.py, the
production TP mechanism of parallel/parallelize.py (plain nn.Linear layers sharded in place by
_shard_linear inside a TPRegion, sync_partial_grads, VocabParallelHead and the vocab-parallel loss)
and parallel/tensor_parallel/vocab.py (embedding, cross entropy).

Multi-rank cases run tp ranks as threads of this process on torch's threaded process group (real
data exchange, milliseconds); one case repeats the SP transformer-block check on 2 gloo
subprocesses, the backend production CPU runs use. Tolerance: 1e-6 relative (vector norm).
"""
import copy
import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from megak3.config import load_model_config
from megak3.model.mla import GatedMLA
from parallel.parallelize import (
    TPRegion,
    VocabParallelHead,
    _shard_attention,
    _shard_linear,
    _vocab_parallel_loss,
    sync_partial_grads,
)
from parallel.plan import ParallelPlan
from parallel.state import ParallelState
from parallel.tensor_parallel import collectives as C
from parallel.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy
from parallel.testing import run_threaded

B, T, D, FF, V = 2, 8, 16, 32, 24  # T, FF, V divisible by 4
_RNG_LOCK = threading.Lock()


# --------------------------------------------------------------------------- harness


def assert_close(got, want, tol=1e-6, what=""):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def check_all(got: dict, want: dict, prefix="", tol=1e-6):
    assert got.keys() == want.keys()
    for k in want:
        assert_close(got[k], want[k], tol=tol, what=prefix + k)


def rank_of(group):
    return dist.get_rank(group)


# --------------------------------------------------------------------------- mappings
@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_forward_backward(tp):
    """Each mapping's forward and backward against the hand-written definition, on distinct
    per-rank data (rank r's input is X[r], its upstream grad G[r])."""
    torch.manual_seed(0)
    X = torch.randn(tp, B, T, D)
    G = torch.randn(tp, B, T, D)
    Xs = X.sum(0)  # value the reductions must produce
    Gs = G.sum(0)

    def chunk(t, r, dim):
        return t.chunk(tp, dim)[r]

    def cat_ranks(f, dim):  # concatenation over ranks q of f(q)
        return torch.cat([f(q) for q in range(tp)], dim)

    # name: (mapping, rank r's input, rank r's upstream grad, expected output, expected input grad)
    cases = {
        "copy_to_tp": (C.copy_to_tp, lambda r: X[r], lambda r: G[r],
                       lambda r: X[r], lambda r: Gs),
        "reduce_from_tp": (C.reduce_from_tp, lambda r: X[r], lambda r: G[r],
                           lambda r: Xs, lambda r: G[r]),
        "scatter_to_tp": (C.scatter_to_tp, lambda r: X[0], lambda r: chunk(G[r], r, -1),
                          lambda r: chunk(X[0], r, -1), lambda r: cat_ranks(lambda q: chunk(G[q], q, -1), -1)),
        "gather_from_tp_dim1": (lambda x, g: C.gather_from_tp(x, g, dim=1), lambda r: chunk(X[r], r, 1),
                                lambda r: G[r],
                                lambda r: cat_ranks(lambda q: chunk(X[q], q, 1), 1), lambda r: chunk(G[r], r, 1)),
        "scatter_to_sp": (C.scatter_to_sp, lambda r: X[0], lambda r: chunk(G[r], r, 1),
                          lambda r: chunk(X[0], r, 1), lambda r: cat_ranks(lambda q: chunk(G[q], q, 1), 1)),
        "gather_from_sp": (C.gather_from_sp, lambda r: chunk(X[r], r, 1), lambda r: G[r],
                           lambda r: cat_ranks(lambda q: chunk(X[q], q, 1), 1), lambda r: chunk(Gs, r, 1)),
        "gather_from_sp_dim0": (lambda x, g: C.gather_from_sp(x, g, dim=0), lambda r: X[r],
                                lambda r: torch.cat([G[r]] * tp, 0),
                                lambda r: cat_ranks(lambda q: X[q], 0), lambda r: Gs),
        "reduce_scatter_to_sp": (C.reduce_scatter_to_sp, lambda r: X[r], lambda r: chunk(G[r], r, 1),
                                 lambda r: chunk(Xs, r, 1), lambda r: cat_ranks(lambda q: chunk(G[q], q, 1), 1)),
    }

    def rank_fn(group):
        r, out = rank_of(group), {}
        for name, (apply, x_of, g_of, _, _) in cases.items():
            x = x_of(r).clone().requires_grad_()
            y = apply(x, group)
            y.backward(g_of(r))
            out[name] = (y.detach(), x.grad)
        return out

    for r, got in enumerate(run_threaded(tp, rank_fn)):
        for name, (_, _, _, want_y, want_dx) in cases.items():
            assert_close(got[name][0], want_y(r), what=f"rank {r} {name} fwd")
            assert_close(got[name][1], want_dx(r), what=f"rank {r} {name} bwd")


def test_backward_collectives_do_not_mutate_shared_grads():
    """Autograd hands one grad tensor to both inputs of an add; an in-place all-reduce in
    copy_to_tp's backward would corrupt the other branch (x.grad would be 2 * sum)."""
    G = torch.randn(2, 4, 3)

    def rank_fn(group):
        r = rank_of(group)
        x = torch.ones(4, 3, requires_grad=True)
        (C.copy_to_tp(x, group) + x).backward(G[r])
        return x.grad

    for r, dx in enumerate(run_threaded(2, rank_fn)):
        assert_close(dx, G.sum(0) + G[r], what=f"rank {r}")


def test_sync_replicated_grads_sums_per_dtype():
    def rank_fn(group):
        r = rank_of(group)
        a, b, c = (nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2, dtype=torch.float64)),
                   nn.Parameter(torch.zeros(1)))
        a.grad, b.grad = torch.full((3,), r + 1.0), torch.full((2, 2), 10.0 * (r + 1), dtype=torch.float64)
        with C.CollectiveCounter() as cc:
            C.sync_replicated_grads([a, b, c], group)  # c has no grad: skipped
        return a.grad, b.grad, c.grad, cc.counts()

    for a, b, c, counts in run_threaded(2, rank_fn):
        assert torch.equal(a, torch.full((3,), 3.0)) and torch.equal(b, torch.full((2, 2), 30.0, dtype=torch.float64))
        assert c is None and counts == {"all_reduce": 2}


# --------------------------------------------------------------------------- TP regions (production)
# The production mechanism (parallel/parallelize.py): a module's plain nn.Linear layers are sharded
# in place by _shard_linear (dim 0: column-parallel output rows; dim 1: row-parallel input columns)
# and the module is wrapped in a TPRegion that owns the two collectives of the Megatron pattern.
class MLP(nn.Module):
    """down(gelu(up(x))) with plain bias-free nn.Linear layers, like the production FFNs. It keeps
    its hidden activations with their grads, so a test can check each linear on its own: ``h`` is
    the column layer's output, ``a`` the row layer's input."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)

    def forward(self, x):
        self.h = self.up(x)
        self.a = F.gelu(self.h)
        if self.a.requires_grad:
            self.h.retain_grad()
            self.a.retain_grad()
        return self.down(self.a)


def tp_region(dense: MLP, group, sp: bool, sp_dim: int = 1) -> TPRegion:
    """What parallelize_tp does to an FFN, on a copy of ``dense`` (which must not have run yet:
    its kept activations could not be copied): up column-parallel, down row-parallel, rank and
    size taken from the group as parallelize_tp does."""
    inner = copy.deepcopy(dense)
    rank, size = C.group_rank(group), C.group_size(group)
    _shard_linear(inner.up, 0, rank, size)
    _shard_linear(inner.down, 1, rank, size)
    return TPRegion(inner, group, sp, sp_dim)


def _dense(module, x, g):
    """Output, input grad and parameter grads of a single-process module under upstream grad g; run
    on a copy, so ``module`` itself stays unrun (for :func:`tp_region`). Returns the copy too."""
    module = copy.deepcopy(module)
    x = x.clone().requires_grad_()
    y = module(x)
    y.backward(g)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}, module


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_region_column_and_row_match_dense(tp, sp):
    """Each half of a TPRegion(MLP) against the same dense MLP, forward and backward:
    column (enter mapping + up sharded on dim 0): its output h is this rank's feature columns of the
    dense h, the region's input grad is the dense one (SP: this rank's tokens), up's weight grad is
    its rows of the dense one; row (down sharded on dim 1 + exit mapping): the region output is the
    dense output (SP: this rank's tokens), down's input grad is this rank's columns of the dense
    one, down's weight grad its columns of the dense one."""
    torch.manual_seed(1)
    dense = MLP()
    X, G = torch.randn(B, T, D), torch.randn(B, T, D)
    y_ref, dx_ref, dp_ref, ran = _dense(dense, X, G)

    def rank_fn(group):
        r = rank_of(group)
        region = tp_region(dense, group, sp)
        mlp = region.inner
        assert mlp.up.weight.shape == (FF // tp, D) and mlp.down.weight.shape == (D, FF // tp)
        assert (mlp.up.out_features, mlp.down.in_features) == (FF // tp, FF // tp)
        x = (X.chunk(tp, 1)[r] if sp else X).clone().requires_grad_()
        y = region(x)
        y.backward(G.chunk(tp, 1)[r] if sp else G)
        return {"col_out": mlp.h.detach(), "col_dx": x.grad, "col_dw": mlp.up.weight.grad,
                "row_out": y.detach(), "row_dx": mlp.a.grad, "row_dw": mlp.down.weight.grad}

    for r, got in enumerate(run_threaded(tp, rank_fn)):
        check_all(got, {"col_out": ran.h.detach().chunk(tp, -1)[r],
                        "col_dx": dx_ref.chunk(tp, 1)[r] if sp else dx_ref,
                        "col_dw": dp_ref["up.weight"].chunk(tp, 0)[r],
                        "row_out": y_ref.chunk(tp, 1)[r] if sp else y_ref,
                        "row_dx": ran.a.grad.chunk(tp, -1)[r],
                        "row_dw": dp_ref["down.weight"].chunk(tp, 1)[r]}, f"rank {r} ")


class DenseBlock(nn.Module):
    """x + mlp(norm(x)): the single-process twin of a transformer FFN block."""

    def __init__(self):
        super().__init__()
        self.norm, self.mlp = nn.RMSNorm(D), MLP()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TPBlock(nn.Module):
    """The same block as parallelize_tp builds it: the MLP in a TPRegion (column -> row); under SP
    the residual stream and the norm are token-sharded."""

    def __init__(self, dense: DenseBlock, group, sp: bool):
        super().__init__()
        self.norm = copy.deepcopy(dense.norm)
        self.mlp = tp_region(dense.mlp, group, sp)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def block_rank_case(group, tp, sp):
    """Run the TP block on this rank; (what it holds, what it should hold). Shared by the threaded
    and gloo tests; the data are rebuilt from a seed on every rank."""
    with _RNG_LOCK:  # threaded ranks share the global generator
        torch.manual_seed(3)
        dense = DenseBlock()
        X, G = torch.randn(B, T, D), torch.randn(B, T, D)
    r = rank_of(group)
    block = TPBlock(dense, group, sp)
    x = (X.chunk(tp, 1)[r] if sp else X).clone().requires_grad_()
    y = block(x)
    y.backward(G.chunk(tp, 1)[r] if sp else G)
    # the norm saw only this rank's tokens under SP: parallelize_tp lists it as partial; without SP
    # its grad is already complete and nothing is listed
    plan = ParallelPlan(ParallelState.single(), sp, partial_grad=["norm.weight"] if sp else [])  # partial_grad is read
    sync_partial_grads(block, plan, group)
    got = {"y": y.detach(), "dx": x.grad, "d_norm": block.norm.weight.grad,
           "d_up": block.mlp.inner.up.weight.grad, "d_down": block.mlp.inner.down.weight.grad}

    y_ref, dx_ref, dp_ref, _ = _dense(dense, X, G)
    want = {"y": y_ref.chunk(tp, 1)[r] if sp else y_ref, "dx": dx_ref.chunk(tp, 1)[r] if sp else dx_ref,
            "d_norm": dp_ref["norm.weight"], "d_up": dp_ref["mlp.up.weight"].chunk(tp, 0)[r],
            "d_down": dp_ref["mlp.down.weight"].chunk(tp, 1)[r]}
    return got, want


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_column_row_block_matches_dense(tp, sp):
    for r, (got, want) in enumerate(run_threaded(tp, lambda g: block_rank_case(g, tp, sp))):
        check_all(got, want, f"rank {r} ")


def test_shard_linear_keeps_whole_head_blocks():
    """parallelize's sharding of a head-major attention module: tp must divide the heads (checked
    before anything is split), and each rank's contiguous chunk is then whole heads: heads
    [r*H/tp, (r+1)*H/tp) of the rows of q_b/kv_b/g_proj and of the columns of o_proj."""
    H = 6
    torch.manual_seed(12)
    full = GatedMLA(load_model_config("k3_tiny", **{"mla.num_heads": H}))
    untouched = copy.deepcopy(full)
    with pytest.raises(ValueError, match=f"parallel.tp=4 does not divide model.mla.num_heads={H}"):
        _shard_attention(full, "layers.1.self_attn", 0, 4)
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), untouched.parameters()))
    with pytest.raises(ValueError, match="cannot split dim 0 of size 6 into 4"):
        _shard_linear(nn.Linear(5, 6, bias=False), 0, 0, 4)
    with pytest.raises(ValueError, match="bias-free linears only"):
        _shard_linear(nn.Linear(4, 8), 0, 0, 2)
    for tp in (2, 3):
        shards = []
        for r in range(tp):
            m = copy.deepcopy(full)
            dims = _shard_attention(m, "layers.1.self_attn", r, tp)
            assert m.num_heads == H // tp
            shards.append((m, {n.removesuffix(".weight"): d for n, d in dims.items() if d is not None}))
        for name, dim in shards[0][1].items():
            w = getattr(full, name).weight
            per_head = w.unflatten(dim, (H, w.shape[dim] // H))
            for r, (m, _) in enumerate(shards):
                lin = getattr(m, name)
                heads = per_head.narrow(dim, r * H // tp, H // tp).flatten(dim, dim + 1)
                assert torch.equal(lin.weight, heads), f"tp {tp} rank {r} {name}"
                assert (lin.out_features, lin.in_features) == tuple(lin.weight.shape)
            assert torch.equal(torch.cat([getattr(m, name).weight for m, _ in shards], dim), w)


def test_shards_are_chunks_of_single_process_weights():
    """Every rank builds the single-process modules from the same seed and keeps chunk r:
    _shard_linear (dim 0: output rows, dim 1: input columns), VocabParallelHead (vocabulary rows)
    and VocabParallelEmbedding, whose __init__ draws the full table like nn.Embedding."""
    torch.manual_seed(7)
    lin, emb, head = nn.Linear(D, FF, bias=False), nn.Embedding(V, D), nn.Linear(D, V, bias=False)

    def rank_fn(group):
        r, tp = rank_of(group), C.group_size(group)
        with _RNG_LOCK:  # ranks are threads sharing the global generator
            torch.manual_seed(7)
            col = nn.Linear(D, FF, bias=False)
            e = VocabParallelEmbedding(V, D, group)  # drawn after a linear, as emb was
            h = VocabParallelHead(nn.Linear(D, V, bias=False), group, r, tp, sequence_parallel=False)
        row = copy.deepcopy(col)
        _shard_linear(col, 0, r, tp)
        _shard_linear(row, 1, r, tp)
        return col.weight, row.weight, e.weight, h.weight

    for r, (cw, rw, ew, hw) in enumerate(run_threaded(2, rank_fn)):
        assert torch.equal(cw, lin.weight.chunk(2, 0)[r]) and torch.equal(rw, lin.weight.chunk(2, 1)[r])
        assert torch.equal(ew, emb.weight.chunk(2, 0)[r]) and torch.equal(hw, head.weight.chunk(2, 0)[r])


# --------------------------------------------------------------------------- vocabulary parallel
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_vocab_parallel_embedding_matches_dense(tp, sp):
    torch.manual_seed(4)
    dense = nn.Embedding(V, D, padding_idx=5)
    ids = torch.randint(0, V, (B, T))
    ids[0, :3] = torch.tensor([0, V - 1, 5])  # both ends of the vocabulary and the padding row
    G = torch.randn(B, T, D)
    y_ref = dense(ids)
    y_ref.backward(G)

    def rank_fn(group):
        r = rank_of(group)
        emb = VocabParallelEmbedding.from_embedding(dense, group, sequence_parallel=sp)
        y = emb(ids)
        y.backward(G.chunk(tp, 1)[r] if sp else G)
        return {"y": y.detach(), "dw": emb.weight.grad}

    for r, got in enumerate(run_threaded(tp, rank_fn)):
        assert torch.equal(got["dw"], dense.weight.grad.chunk(tp, 0)[r])  # row grads: exact sums
        check_all(got, {"y": y_ref.detach().chunk(tp, 1)[r] if sp else y_ref.detach(),
                        "dw": dense.weight.grad.chunk(tp, 0)[r]}, f"rank {r} ")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_vocab_parallel_cross_entropy_matches_dense(tp, reduction):
    torch.manual_seed(5)
    N = 12
    logits = 8 * torch.randn(N, V)
    logits[1] += 1000.0  # naive exp would overflow: the global max must be subtracted
    logits[2, 3] = 90.0  # a single dominant logit owned by rank 0
    target = torch.randint(0, V, (N,))
    target[[0, 5, 9]] = -100  # ignored
    target[3], target[4] = 0, V - 1
    upstream = torch.randn(N) if reduction == "none" else torch.tensor(1.7)

    full = logits.clone().requires_grad_()
    loss_ref = F.cross_entropy(full, target, ignore_index=-100, reduction=reduction)
    loss_ref.backward(upstream)

    def rank_fn(group):
        x = logits.chunk(tp, -1)[rank_of(group)].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target, group, ignore_index=-100, reduction=reduction)
        loss.backward(upstream)
        return {"loss": loss.detach(), "dx": x.grad}

    # 2e-5: the ranks are threads of one process; a thread's fp32 exp-sum was seen 5e-6 off (1 run in ~20)
    for r, got in enumerate(run_threaded(tp, rank_fn)):
        check_all(got, {"loss": loss_ref.detach(), "dx": full.grad.chunk(tp, -1)[r]}, f"rank {r} ", tol=2e-5)


@pytest.mark.parametrize("sp", [False, True])
def test_embedding_lm_head_cross_entropy_pipeline(sp):
    """VocabParallelEmbedding -> VocabParallelHead -> the production vocab-parallel loss (sum, count)."""
    tp = 2
    torch.manual_seed(6)
    emb, head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    ids = torch.randint(0, V, (B, T))
    labels = torch.randint(0, V, (B, T))
    labels[:, -1] = -100
    loss_ref = F.cross_entropy(head(emb(ids)).view(-1, V), labels.view(-1), reduction="sum")
    loss_ref.backward()

    def rank_fn(group):
        r = rank_of(group)
        tp_emb = VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=sp)
        tp_head = VocabParallelHead(head, group, r, tp, sequence_parallel=sp)
        logits_local = tp_head(tp_emb(ids))  # [B, T, V/tp]
        assert logits_local.shape == (B, T, V // tp)
        loss, n = _vocab_parallel_loss(logits_local, labels, group)
        assert n == B * (T - 1)
        loss.backward()
        return {"loss": loss.detach(), "d_emb": tp_emb.weight.grad, "d_head": tp_head.weight.grad}

    for r, got in enumerate(run_threaded(tp, rank_fn)):
        check_all(got, {"loss": loss_ref.detach(), "d_emb": emb.weight.grad.chunk(tp, 0)[r],
                        "d_head": head.weight.grad.chunk(tp, 0)[r]}, f"rank {r} ")


# --------------------------------------------------------------------------- collective counts
@pytest.mark.parametrize("sp", [False, True])
def test_collective_counts(sp):
    """Collectives per forward and per backward, in issue order; the sharded linears inside a
    region issue none (the region's two are its enter and exit mappings)."""
    tp = 2
    torch.manual_seed(8)
    X = torch.randn(B, T, D)
    ids = torch.randint(0, V, (B, T))
    dense = MLP()

    def fwd_bwd(make_input, layer):
        x = make_input()
        with C.CollectiveCounter() as fwd:
            y = layer(x)
        with C.CollectiveCounter() as bwd:
            y.sum().backward()
        return fwd, bwd

    def rank_fn(group):
        r = rank_of(group)
        x_in = (lambda: X.chunk(tp, 1)[r].clone().requires_grad_()) if sp else (lambda: X.clone().requires_grad_())
        emb = VocabParallelEmbedding(V, D, group, sequence_parallel=sp)
        head = VocabParallelHead(nn.Linear(D, V, bias=False), group, r, tp, sequence_parallel=sp)
        out = {"region": fwd_bwd(x_in, tp_region(dense, group, sp)),
               "head": fwd_bwd(x_in, head),
               "emb": fwd_bwd(lambda: ids, emb)}
        logits = torch.randn(B * T, V // tp, requires_grad=True)
        out["ce"] = fwd_bwd(lambda: logits, lambda z: vocab_parallel_cross_entropy(z, ids.view(-1), group))
        return {k: ([kind for kind, _ in f.events], [kind for kind, _ in b.events],
                    {size for _, size in f.events + b.events}) for k, (f, b) in out.items()}

    # region: forward enter then exit; backward exit's then enter's
    want_sp = {"region": (["all_gather", "reduce_scatter"], ["all_gather", "reduce_scatter"]),
               "head": (["all_gather"], ["reduce_scatter"]), "emb": (["reduce_scatter"], ["all_gather"]),
               "ce": (["all_reduce", "all_reduce"], [])}
    want_tp = {"region": (["all_reduce"], ["all_reduce"]), "head": ([], ["all_reduce"]),
               "emb": (["all_reduce"], []), "ce": (["all_reduce", "all_reduce"], [])}
    want = want_sp if sp else want_tp
    for got in run_threaded(tp, rank_fn):
        for k, (f, b, sizes) in got.items():
            assert (f, b) == want[k], f"{k}: forward {f}, backward {b}; want {want[k]}"
            assert sizes == {tp}


def test_size_one_group_is_identity_without_collectives():
    """group=None with no process group at all (any collective would raise), then a real size-1 group."""
    assert not dist.is_initialized()
    torch.manual_seed(9)
    dense, head, emb = MLP(), nn.Linear(D, V, bias=False), nn.Embedding(V, D)
    X, G, ids = torch.randn(B, T, D), torch.randn(B, T, D), torch.randint(0, V, (B, T))
    logits, target = torch.randn(B * T, V), ids.view(-1)
    y_ref, dx_ref, dp_ref, _ = _dense(dense, X, G)
    mappings = [C.copy_to_tp, C.reduce_from_tp, C.scatter_to_tp, C.gather_from_tp, C.scatter_to_sp,
                C.gather_from_sp, C.reduce_scatter_to_sp]

    def rank_fn(group):
        with C.CollectiveCounter() as cc:
            assert all(m(X, group) is X for m in mappings)
            for sp in (False, True):
                region = tp_region(dense, group, sp)
                x = X.clone().requires_grad_()
                y = region(x)
                y.backward(G)
                assert torch.equal(y, y_ref) and torch.equal(x.grad, dx_ref)
                assert torch.equal(region.inner.up.weight.grad, dp_ref["up.weight"])
                assert torch.equal(region.inner.down.weight.grad, dp_ref["down.weight"])
                plan = ParallelPlan(ParallelState.single(), sp, partial_grad=["inner.up.weight"])
                sync_partial_grads(region, plan, group)
                C.sync_replicated_grads(region.parameters(), group)
                assert torch.equal(region.inner.up.weight.grad, dp_ref["up.weight"])
            assert torch.equal(VocabParallelHead(head, group, 0, 1, sequence_parallel=True)(X), head(X))
            assert torch.equal(VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=True)(ids), emb(ids))
            ce = vocab_parallel_cross_entropy(logits, target, group, reduction="mean")
            assert_close(ce, F.cross_entropy(logits, target))
        return cc.events

    assert rank_fn(None) == []
    assert run_threaded(1, rank_fn) == [[]]


def test_subgroups_use_group_rank():
    """World of 4 split into TP groups {0,1} and {2,3} under SP: shards, token chunks and vocabulary
    ranges follow the rank inside the group, not the global rank."""
    torch.manual_seed(10)
    dense, emb = MLP(), nn.Embedding(V, D)
    X = torch.randn(2, B, T, D)  # one input per TP group
    ids = torch.randint(0, V, (2, B, T))
    y_ref = [_dense(dense, X[g], torch.zeros(B, T, D))[0] for g in range(2)]

    def rank_fn(world):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        gid = dist.get_rank(world) // 2
        group = groups[gid]
        r = dist.get_rank(group)
        region = tp_region(dense, group, sp=True)
        tp_emb = VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=True)
        with torch.no_grad():
            return gid, r, region(X[gid].chunk(2, 1)[r]), tp_emb(ids[gid])

    for gid, r, y, e in run_threaded(4, rank_fn):
        assert_close(y, y_ref[gid].chunk(2, 1)[r], what=f"group {gid} rank {r} region")
        assert_close(e, emb(ids[gid]).detach().chunk(2, 1)[r], what=f"group {gid} rank {r} embedding")


# --------------------------------------------------------------------------- gloo
def _gloo_worker(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        for sp in (False, True):
            got, want = block_rank_case(dist.group.WORLD, world_size, sp)
            check_all(got, want, f"gloo rank {rank} sp={sp} ")
        # vocab-parallel CE with the MAX all-reduce, on gloo
        torch.manual_seed(11)
        logits, target = 5 * torch.randn(6, V), torch.tensor([0, 3, -100, V - 1, 7, 12])
        full = logits.clone().requires_grad_()
        F.cross_entropy(full, target, reduction="sum").backward()
        x = logits.chunk(world_size, -1)[rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(x, target, dist.group.WORLD)
        loss.backward()
        assert_close(loss.detach(), F.cross_entropy(logits, target, reduction="sum"), what="gloo ce")
        assert_close(x.grad, full.grad.chunk(world_size, -1)[rank], what="gloo ce grad")
    finally:
        dist.destroy_process_group()


def test_gloo_two_ranks(tmp_path):
    """The TP and SP blocks and the vocab-parallel CE on 2 real gloo subprocesses.

    fork, not spawn: a spawned child re-imports torch (5-10 s each on a 2-core box); a forked one
    inherits it. Safe here: no process group and no helper thread is alive in this process.
    """
    ctx = mp.start_processes(_gloo_worker, args=(2, str(tmp_path / "rendezvous")), nprocs=2, join=False,
                             start_method="fork")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("gloo ranks did not finish within 120 s")
