"""Tensor/sequence-parallel mappings and layers against the single-process nn.Linear / nn.Embedding /
F.cross_entropy with the same full weights.

Multi-rank cases run tp ranks as threads of this process on torch's threaded process group (real
data exchange, milliseconds); one case repeats the SP transformer-block check on 2 gloo
subprocesses, the backend production CPU runs use. Tolerance: 1e-6 relative (vector norm).
"""
import datetime
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)

from parallel.tensor_parallel import collectives as C
from parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    partial_grad_parameters,
    shard_rows,
    vocab_parallel_cross_entropy,
)

B, T, D, FF, V = 2, 8, 16, 32, 24  # T, FF, V divisible by 4
_RNG_LOCK = threading.Lock()


# --------------------------------------------------------------------------- harness
def run_threaded(world_size, fn, timeout=30.0):
    """Run ``fn(world_group)`` on ``world_size`` threaded ranks; per-rank results, rank order."""
    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    results, errors = [None] * world_size, []

    def worker(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = fn(dist.group.WORLD)
        except SystemExit:  # woken up because another rank failed
            pass
        except BaseException as exc:
            errors.append((exc, f"rank {rank}:\n{traceback.format_exc()}"))
            ProcessLocalGroup.exception_handle(exc)  # release ranks waiting in a collective
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            raise TimeoutError(f"threaded ranks still running after {timeout}s (a collective mismatch?)")
    finally:
        ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    if errors:  # re-raise the first failure (its type, for pytest.raises) with every rank's traceback
        exc = errors[0][0]
        exc.add_note("\n".join(trace for _, trace in errors))
        raise exc
    return results


def assert_close(got, want, tol=1e-6, what=""):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def check_all(got: dict, want: dict, prefix=""):
    assert got.keys() == want.keys()
    for k in want:
        assert_close(got[k], want[k], what=prefix + k)


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


# --------------------------------------------------------------------------- linear layers
def _dense(layer, x, g):
    """Output, input grad and parameter grads of a single-process module under upstream grad g."""
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_matches_dense(tp, sp, gather_output):
    torch.manual_seed(1)
    dense = nn.Linear(D, FF, bias=True)
    X, G = torch.randn(B, T, D), torch.randn(B, T, FF)
    y_ref, dx_ref, dp_ref = _dense(dense, X, G)

    def rank_fn(group):
        r = rank_of(group)
        layer = ColumnParallelLinear.from_linear(dense, group, gather_output=gather_output, sequence_parallel=sp)
        assert layer.weight.shape == (FF // tp, D)
        x = (X.chunk(tp, 1)[r] if sp else X).clone().requires_grad_()
        y = layer(x)
        y.backward(G if gather_output else G.chunk(tp, -1)[r])
        return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad}

    for r, got in enumerate(run_threaded(tp, rank_fn)):
        check_all(got, {"y": y_ref if gather_output else y_ref.chunk(tp, -1)[r],
                        "dx": dx_ref.chunk(tp, 1)[r] if sp else dx_ref,
                        "dw": dp_ref["weight"].chunk(tp, 0)[r], "db": dp_ref["bias"].chunk(tp, 0)[r]}, f"rank {r} ")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_matches_dense(tp, sp, input_is_parallel):
    torch.manual_seed(2)
    dense = nn.Linear(FF, D, bias=True)
    X, G = torch.randn(B, T, FF), torch.randn(B, T, D)
    y_ref, dx_ref, dp_ref = _dense(dense, X, G)

    def rank_fn(group):
        r = rank_of(group)
        layer = RowParallelLinear.from_linear(dense, group, input_is_parallel=input_is_parallel, sequence_parallel=sp)
        assert layer.weight.shape == (D, FF // tp)
        x = (X.chunk(tp, -1)[r] if input_is_parallel else X).clone().requires_grad_()
        y = layer(x)
        y.backward(G.chunk(tp, 1)[r] if sp else G)
        # under SP the replicated bias only saw this rank's tokens: its grad is partial
        assert [id(p) for p in partial_grad_parameters(layer)] == ([id(layer.bias)] if sp else [])
        C.sync_replicated_grads(partial_grad_parameters(layer), group)
        return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad}

    for r, got in enumerate(run_threaded(tp, rank_fn)):
        check_all(got, {"y": y_ref.chunk(tp, 1)[r] if sp else y_ref,
                        "dx": dx_ref.chunk(tp, -1)[r] if input_is_parallel else dx_ref,
                        "dw": dp_ref["weight"].chunk(tp, 1)[r], "db": dp_ref["bias"]}, f"rank {r} ")


class DenseBlock(nn.Module):
    """x + down(gelu(up(norm(x)))): the single-process twin of the Megatron MLP block."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.RMSNorm(D), nn.Linear(D, FF, bias=False), nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TPBlock(nn.Module):
    """The same block, Column -> Row; under SP the residual stream and the norm are token-sharded."""

    def __init__(self, dense: DenseBlock, group, sp: bool):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.norm.load_state_dict(dense.norm.state_dict())
        self.up = ColumnParallelLinear.from_linear(dense.up, group, sequence_parallel=sp)
        self.down = RowParallelLinear.from_linear(dense.down, group, sequence_parallel=sp)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


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
    if sp:  # the replicated norm saw only this rank's tokens
        C.sync_replicated_grads(block.norm.parameters(), group)
    got = {"y": y.detach(), "dx": x.grad, "d_norm": block.norm.weight.grad,
           "d_up": block.up.weight.grad, "d_down": block.down.weight.grad}

    y_ref, dx_ref, dp_ref = _dense(dense, X, G)
    want = {"y": y_ref.chunk(tp, 1)[r] if sp else y_ref, "dx": dx_ref.chunk(tp, 1)[r] if sp else dx_ref,
            "d_norm": dp_ref["norm.weight"], "d_up": dp_ref["up.weight"].chunk(tp, 0)[r],
            "d_down": dp_ref["down.weight"].chunk(tp, 1)[r]}
    return got, want


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_column_row_block_matches_dense(tp, sp):
    for r, (got, want) in enumerate(run_threaded(tp, lambda g: block_rank_case(g, tp, sp))):
        check_all(got, want, f"rank {r} ")


def test_sharding_helpers_respect_head_blocks():
    w = torch.arange(6 * 4 * 5.0).view(6 * 4, 5)  # 6 heads of head_dim 4
    assert torch.equal(shard_rows(w, None, block=4), w)
    with pytest.raises(ValueError, match="does not divide the 6 blocks"):
        run_threaded(4, lambda g: shard_rows(w, g, block=4))
    with pytest.raises(ValueError, match="does not divide the 6 blocks"):
        run_threaded(4, lambda g: ColumnParallelLinear(5, 24, g, row_block=4))
    lin = nn.Linear(5, 24)
    shards = run_threaded(2, lambda g: ColumnParallelLinear.from_linear(lin, g, row_block=4).weight)
    assert [s.shape for s in shards] == [(12, 5), (12, 5)]  # 3 whole heads each
    assert torch.equal(torch.cat(shards), lin.weight)


def test_init_reproduces_single_process_weights():
    """__init__ draws the full tensor like nn.Linear / nn.Embedding, then keeps the shard."""
    torch.manual_seed(7)
    lin, emb = nn.Linear(D, FF, bias=True), nn.Embedding(V, D)

    def rank_fn(group):
        with _RNG_LOCK:  # ranks are threads sharing the global generator
            torch.manual_seed(7)
            col = ColumnParallelLinear(D, FF, group, bias=True)
            torch.manual_seed(7)
            row = RowParallelLinear(D, FF, group, bias=True)
            e = VocabParallelEmbedding(V, D, group)  # drawn after a linear, as emb was
        return col.weight, col.bias, row.weight, row.bias, e.weight

    for r, (cw, cb, rw, rb, ew) in enumerate(run_threaded(2, rank_fn)):
        assert torch.equal(cw, lin.weight.chunk(2, 0)[r]) and torch.equal(cb, lin.bias.chunk(2, 0)[r])
        assert torch.equal(rw, lin.weight.chunk(2, 1)[r]) and torch.equal(rb, lin.bias)
        assert torch.equal(ew, emb.weight.chunk(2, 0)[r])


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

    for r, got in enumerate(run_threaded(tp, rank_fn)):
        check_all(got, {"loss": loss_ref.detach(), "dx": full.grad.chunk(tp, -1)[r]}, f"rank {r} ")


@pytest.mark.parametrize("sp", [False, True])
def test_embedding_lm_head_cross_entropy_pipeline(sp):
    """VocabParallelEmbedding -> column-parallel lm_head (gather_output=False) -> vocab-parallel CE."""
    tp = 2
    torch.manual_seed(6)
    emb, head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    ids = torch.randint(0, V, (B, T))
    labels = torch.randint(0, V, (B, T))
    labels[:, -1] = -100
    loss_ref = F.cross_entropy(head(emb(ids)).view(-1, V), labels.view(-1), reduction="sum")
    loss_ref.backward()

    def rank_fn(group):
        tp_emb = VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=sp)
        tp_head = ColumnParallelLinear.from_linear(head, group, sequence_parallel=sp)
        logits_local = tp_head(tp_emb(ids))  # [B, T, V/tp]
        loss = vocab_parallel_cross_entropy(logits_local.view(-1, V // tp), labels.view(-1), group)
        loss.backward()
        return {"loss": loss.detach(), "d_emb": tp_emb.weight.grad, "d_head": tp_head.weight.grad}

    for r, got in enumerate(run_threaded(tp, rank_fn)):
        check_all(got, {"loss": loss_ref.detach(), "d_emb": emb.weight.grad.chunk(tp, 0)[r],
                        "d_head": head.weight.grad.chunk(tp, 0)[r]}, f"rank {r} ")


# --------------------------------------------------------------------------- collective counts
@pytest.mark.parametrize("sp", [False, True])
def test_collective_counts(sp):
    tp = 2
    torch.manual_seed(8)
    X = torch.randn(B, T, D)
    ids = torch.randint(0, V, (B, T))

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
        col = ColumnParallelLinear(D, FF, group, sequence_parallel=sp)
        row = RowParallelLinear(FF, D, group, sequence_parallel=sp)
        emb = VocabParallelEmbedding(V, D, group, sequence_parallel=sp)
        out = {"col": fwd_bwd(x_in, col),
               "row": fwd_bwd(lambda: torch.randn(B, T, FF // tp, requires_grad=True), row),
               "emb": fwd_bwd(lambda: ids, emb)}
        logits = torch.randn(B * T, V // tp, requires_grad=True)
        out["ce"] = fwd_bwd(lambda: logits, lambda z: vocab_parallel_cross_entropy(z, ids.view(-1), group))
        return {k: (f.counts(), b.counts(), {s for _, s in f.events + b.events}) for k, (f, b) in out.items()}

    want_sp = {"col": ({"all_gather": 1}, {"reduce_scatter": 1}), "row": ({"reduce_scatter": 1}, {"all_gather": 1}),
               "emb": ({"reduce_scatter": 1}, {"all_gather": 1}), "ce": ({"all_reduce": 2}, {})}
    want_tp = {"col": ({}, {"all_reduce": 1}), "row": ({"all_reduce": 1}, {}),
               "emb": ({"all_reduce": 1}, {}), "ce": ({"all_reduce": 2}, {})}
    want = want_sp if sp else want_tp
    for got in run_threaded(tp, rank_fn):
        for k, (f, b, sizes) in got.items():
            assert (f, b) == want[k], f"{k}: forward {f}, backward {b}; want {want[k]}"
            assert sizes == {tp}


def test_size_one_group_is_identity_without_collectives():
    """group=None with no process group at all (any collective would raise), then a real size-1 group."""
    assert not dist.is_initialized()
    torch.manual_seed(9)
    lin, emb = nn.Linear(D, FF, bias=True), nn.Embedding(V, D)
    X, ids = torch.randn(B, T, D), torch.randint(0, V, (B, T))
    logits, target = torch.randn(B * T, V), ids.view(-1)
    mappings = [C.copy_to_tp, C.reduce_from_tp, C.scatter_to_tp, C.gather_from_tp, C.scatter_to_sp,
                C.gather_from_sp, C.reduce_scatter_to_sp]

    def rank_fn(group):
        with C.CollectiveCounter() as cc:
            assert all(m(X, group) is X for m in mappings)
            col = ColumnParallelLinear.from_linear(lin, group, gather_output=True, sequence_parallel=True)
            row = RowParallelLinear.from_linear(nn.Linear(FF, D), group, input_is_parallel=False)
            assert torch.equal(col(X), lin(X))
            assert row(col(X)).shape == (B, T, D)
            assert torch.equal(VocabParallelEmbedding.from_embedding(emb, group, sequence_parallel=True)(ids), emb(ids))
            ce = vocab_parallel_cross_entropy(logits, target, group, reduction="mean")
            assert_close(ce, F.cross_entropy(logits, target))
            C.sync_replicated_grads(lin.parameters(), group)
        return cc.events

    assert rank_fn(None) == []
    assert run_threaded(1, rank_fn) == [[]]


def test_subgroups_use_group_rank():
    """World of 4 split into TP groups {0,1} and {2,3}: shards follow the rank inside the group."""
    torch.manual_seed(10)
    dense = nn.Linear(FF, D, bias=False)
    X = torch.randn(2, B, T, FF)  # one input per TP group

    def rank_fn(world):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        gid = dist.get_rank(world) // 2
        group = groups[gid]
        row = RowParallelLinear.from_linear(dense, group, sequence_parallel=True)
        x = X[gid].chunk(2, -1)[dist.get_rank(group)]
        return gid, dist.get_rank(group), row(x)

    for gid, r, y in run_threaded(4, rank_fn):
        assert_close(y, dense(X[gid]).detach().chunk(2, 1)[r], what=f"group {gid} rank {r}")


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
