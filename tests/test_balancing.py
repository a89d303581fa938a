"""Quantile Balancing (K3_SPEC.md §7.3, §16 item 5) against hand-built batches and the §14 sketch."""
import pytest
import torch

from megak3.model.balancing import (QB_EXACT_MAX_BYTES, QBAccumulator, max_violation, qb_alternating, qb_update,
                                   resolve_qb_method)


def loads(s_TE, b_E, k):
    return torch.bincount((s_TE + b_E).topk(k, dim=1).indices.reshape(-1), minlength=s_TE.shape[1])


def topk_gap(s_TE, b_E, k):
    """Smallest distance between a token's k-th and (k+1)-th biased score (> 0: no ties decide)."""
    v = (s_TE + b_E).topk(k + 1, dim=1).values
    return (v[:, k - 1] - v[:, k]).min().item()


def sketch_qb_update(s, b, k):  # K3_SPEC.md §14, verbatim semantics
    m, n = s.shape
    q = (m * k) // n
    alpha = (s + b).topk(k + 1, dim=1).values[:, -1:]
    b_hat = -(s - alpha).topk(q + 1, dim=0).values[-1]
    return b_hat - b_hat.mean()


# m=8 tokens, n=4 experts, k=1 (q=2); plain top-1 gives loads (4, 3, 1, 0) like the report's Fig.5.
TOY = torch.tensor([[0.89, 0.17, 0.35, 0.81], [0.76, 0.40, 0.72, 0.53], [0.12, 0.72, 0.55, 0.01],
                    [0.56, 0.20, 0.07, 0.03], [0.58, 0.30, 0.62, 0.08], [0.44, 0.95, 0.53, 0.08],
                    [0.78, 0.26, 0.35, 0.28], [0.10, 0.77, 0.67, 0.66]], dtype=torch.float64)


def test_report_toy_balances():
    zero = torch.zeros(4, dtype=torch.float64)
    assert loads(TOY, zero, 1).tolist() == [4, 3, 1, 0]
    b = qb_update(TOY, zero, 1)
    assert loads(TOY, b, 1).tolist() == [2, 2, 2, 2]
    assert topk_gap(TOY, b, 1) > 0.01  # balanced by a clear margin, not by a tie-break
    b_alg1 = qb_alternating(TOY, 1, iters=1)
    assert torch.allclose(b_alg1, b, atol=1e-12)
    for iters in (2, 3, 4):  # balance is kept by further alternations
        assert loads(TOY, qb_alternating(TOY, 1, iters), 1).tolist() == [2, 2, 2, 2]


def alg1_reference(s, k, iters):  # App C Alg.1 as transcribed in K3_SPEC.md §7.3
    m, n = s.shape
    q = (m * k) // n
    beta = torch.zeros(1, n, dtype=s.dtype)
    for _ in range(iters):
        alpha = (s - beta).sort(dim=1, descending=True).values[:, k:k + 1]
        beta = (s - alpha).sort(dim=0, descending=True).values[q:q + 1]
    b = -beta[0]
    return b - b.mean()


@pytest.mark.parametrize("iters", [1, 3])
def test_alternating_matches_alg1(iters):
    gen = torch.Generator().manual_seed(4)
    s = torch.sigmoid(torch.randn(256, 12, generator=gen, dtype=torch.float64) + torch.linspace(0, 2, 12))
    assert torch.allclose(qb_alternating(s, 3, iters), alg1_reference(s, 3, iters), atol=1e-12)
    assert torch.allclose(qb_alternating(TOY, 1, iters), alg1_reference(TOY, 1, iters), atol=1e-12)


def test_toy_first_step_by_hand():
    zero = torch.zeros(4, dtype=torch.float64)
    # column-wise 3rd-largest margin with b = 0, worked out by hand from TOY:
    #   alpha = [0.81, 0.72, 0.55, 0.20, 0.58, 0.53, 0.35, 0.67]
    #   col0 margins: .08,.04,-.43,.36,0,-.09,.43,-.57 -> 3rd = .08 ; col1: -.64,-.32,.17,0,-.28,.42,-.09,.10 -> .10
    #   col2: -.46,0,0,-.13,.04,0,0,0 -> 0 ;                      col3: 0,-.19,-.54,-.17,-.50,-.45,-.07,-.01 -> -.07
    b_hat = -torch.tensor([0.08, 0.10, 0.0, -0.07], dtype=torch.float64)
    assert torch.allclose(qb_update(TOY, zero, 1), b_hat - b_hat.mean(), atol=1e-12)


def test_fixed_point_and_mean_zero():
    # Build a batch balanced under b (each expert: 2 of 8 tokens, k=1) in which every expert is some
    # unselected token's 2nd choice, so Eq.14 must return b itself (it is already mean-zero).
    gen = torch.Generator().manual_seed(3)
    b = torch.randn(4, generator=gen, dtype=torch.float64) * 0.05
    b -= b.mean()
    v = 0.2 + 0.1 * torch.rand(8, 4, generator=gen, dtype=torch.float64)  # biased scores s + b
    for e in range(4):
        v[2 * e, e] = v[2 * e + 1, e] = 0.8 + 0.01 * e
        v[2 * e, (e + 1) % 4] = 0.6
        v[2 * e + 1, (e + 2) % 4] = 0.55
    s = v - b
    assert loads(s, b, 1).tolist() == [2, 2, 2, 2]
    new = qb_update(s, b, 1)
    assert torch.allclose(new, b, atol=1e-12)
    new32 = qb_update(s.float(), b.float(), 1)
    assert torch.allclose(new32.double(), b, atol=1e-6)
    assert abs(new32.mean().item()) < 1e-7


def test_matches_spec_sketch_and_mean_zero():
    gen = torch.Generator().manual_seed(0)
    s = torch.sigmoid(torch.randn(300, 16, generator=gen))
    b = torch.randn(16, generator=gen) * 0.1
    new = qb_update(s, b, 3)
    assert torch.equal(new, sketch_qb_update(s, b, 3))
    assert abs(new.mean().item()) < 1e-7


def test_skewed_batch_four_iterations():
    gen = torch.Generator().manual_seed(0)
    m, n, k = 4096, 64, 4
    s = torch.sigmoid(torch.randn(m, n, generator=gen) + torch.linspace(0, 3, n))  # later experts favoured
    b = torch.zeros(n)
    vio = [max_violation(loads(s, b, k)).item()]
    for _ in range(4):
        b = qb_update(s, b, k)
        vio.append(max_violation(loads(s, b, k)).item())
    assert vio[0] > 3.0, vio
    assert vio[-1] < 0.15, vio  # measured 3.81 -> 0.28 -> 0.14 -> 0.09 -> 0.07
    assert vio[1] < 0.5 * vio[0]


def test_max_violation():
    assert max_violation(torch.tensor([2, 2, 2, 2])).item() == 0.0
    assert abs(max_violation(torch.tensor([4, 3, 1, 0])).item() - 1.0) < 1e-7  # 4 / 2 - 1
    assert max_violation(torch.zeros(4, dtype=torch.int64)).item() == 0.0


def _batches(seed, sizes, n=16):
    gen = torch.Generator().manual_seed(seed)
    return [torch.sigmoid(torch.randn(t, n, generator=gen) * 1.5) for t in sizes]


def test_accumulate_two_microbatches_equals_concat():
    b = torch.randn(16, generator=torch.Generator().manual_seed(1)) * 0.05
    s1, s2 = _batches(0, (97, 160))
    acc = QBAccumulator(16, 2, method="exact")
    acc.add(s1, b)
    acc.add(s2, b)
    assert acc.num_tokens == 257
    assert torch.equal(acc.solve(b), qb_update(torch.cat([s1, s2]), b, 2))
    acc.reset()
    assert acc.num_tokens == 0
    assert torch.equal(acc.solve(b), b)  # nothing observed: bias unchanged


@pytest.mark.parametrize("bins", [64, 4096])
@pytest.mark.parametrize("scale", [0.05, 2.0])
def test_histogram_within_one_bin_of_exact(bins, scale):
    # scale 2.0: a bias far beyond the sigmoid score range, whose quantiles leave [-1, 1)
    b = torch.randn(16, generator=torch.Generator().manual_seed(2)) * scale
    b -= b.mean()
    exact, hist = QBAccumulator(16, 2, "exact"), QBAccumulator(16, 2, "histogram", bins=bins)
    fixed = QBAccumulator(16, 2, "histogram", bins=bins, lo=-1.0, hi=1.0)
    for s in _batches(5, (200, 311)):
        for acc in (exact, hist, fixed):
            acc.add(s, b)
    assert hist.counts.shape == (16, bins) and int(hist.counts.sum()) == 511 * 16
    width = float(hist.bin_width)  # the range follows the bias: (2 + max b - min b) / bins
    assert width == pytest.approx((2.0 + float(b.max() - b.min())) / bins, rel=1e-6)
    err = (hist.cutoffs() - exact.cutoffs()).abs().max().item()
    assert err <= width, (err, width)
    # after mean-centring both, each entry moves by at most one more width
    assert (hist.solve(b) - exact.solve(b)).abs().max().item() <= 2 * width
    fixed_err = (fixed.cutoffs() - exact.cutoffs()).abs().max().item()
    if scale == 0.05:  # every quantile inside [-1, 1): the fixed range is within ITS (finer) bin width too
        assert fixed_err <= fixed.bin_width, (fixed_err, fixed.bin_width)
    else:              # quantiles beyond -1 are clamped into the outer bin: what the bias-following range avoids
        assert exact.cutoffs().min().item() < -1 and fixed_err > 0.1, fixed_err


def test_histogram_empty_and_device():
    b = torch.tensor([0.1, -0.1, 0.0, 0.0])
    hist = QBAccumulator(4, 1, "histogram", bins=16)
    assert torch.equal(hist.solve(b), b)              # nothing added: bias unchanged, no range needed
    meta = QBAccumulator(4, 1, "histogram", bins=16, device="meta")
    assert meta.counts.device.type == "meta" and meta.device.type == "meta"
    meta.add(torch.rand(5, 4, device="meta"), torch.zeros(4, device="meta"))
    meta.reset()                                       # reset keeps the state's device
    assert meta.counts.device.type == meta.token_count.device.type == "meta"
    acc = QBAccumulator(4, 1, "exact")
    acc.add(torch.rand(6, 4, device="meta"), torch.zeros(4, device="meta"))
    assert acc.device.type == "meta" and acc.num_tokens == 6  # the host count: no sync needed
    acc.reset()
    assert acc.device.type == "meta" and acc.margins().device.type == "meta" and acc.num_tokens == 0


def test_resolve_qb_method_auto_threshold():
    assert QB_EXACT_MAX_BYTES == 64 * 2**20
    E = 1024
    edge = QB_EXACT_MAX_BYTES // (4 * E)               # 16384 tokens x 1024 experts x 4 B = exactly 64 MiB
    assert resolve_qb_method("auto", edge, E) == "exact"
    assert resolve_qb_method("auto", edge + 1, E) == "histogram"
    assert resolve_qb_method("auto", 4 * 2**20, 896) == "histogram"   # 4M tokens x 896 experts: 14 GB exact
    assert resolve_qb_method("auto", 4 * 64, 8) == "exact"            # the test models
    for m in ("exact", "histogram"):
        assert resolve_qb_method(m, 10**9, 896) == m                  # explicit choices are kept
    with pytest.raises(ValueError, match="qb_method"):
        resolve_qb_method("median", 1, 8)
    with pytest.raises(ValueError, match="resolve_qb_method"):
        QBAccumulator(8, 2, "auto")


def _reduce_on_ranks(rank, world_size, method, sizes):
    import torch.distributed as dist

    from parallel.collective_check import check_collective_devices
    from parallel.moe_stats import reduce_balancer

    b = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.05
    acc = QBAccumulator(16, 2, method, bins=256)
    for s in _batches(11 + rank, sizes[rank]):
        acc.add(s, b)
    with check_collective_devices("cpu") as chk:  # every tensor on the accumulator's device, none meta
        reduce_balancer(acc, dist.group.WORLD)
        out = acc.solve(b)
    chk.assert_clean()
    assert chk.records and acc.num_tokens == sum(map(sum, sizes))
    return out


@pytest.mark.parametrize("method", ["exact", "histogram"])
def test_reduce_balancer_equals_one_accumulator(method):
    from parallel.testing import run_distributed

    sizes = [(60, 40), (70,)]  # unequal token counts per rank: the exact gather pads
    got = run_distributed(_reduce_on_ranks, 2, method, sizes, timeout_s=60)
    b = torch.randn(16, generator=torch.Generator().manual_seed(3)) * 0.05
    one = QBAccumulator(16, 2, method, bins=256)
    for rank in range(2):
        for s in _batches(11 + rank, sizes[rank]):
            one.add(s, b)
    assert torch.equal(got[0], got[1])  # every rank computes the same bias
    torch.testing.assert_close(got[0], one.solve(b), rtol=0, atol=1e-6)


def test_histogram_state_sums_like_one_accumulator():
    # what a data-parallel all-reduce does: sum state_tensors of two "ranks" == one accumulator
    b = torch.zeros(16)
    s1, s2 = _batches(7, (120, 80))
    r0, r1, both = (QBAccumulator(16, 2, "histogram", bins=512) for _ in range(3))
    r0.add(s1, b)
    r1.add(s2, b)
    both.add(s1, b)
    both.add(s2, b)
    for t0, t1 in zip(r0.state_tensors(), r1.state_tensors()):
        t0 += t1
    assert torch.equal(r0.counts, both.counts) and r0.num_tokens == 200
    assert torch.equal(r0.solve(b), both.solve(b))
    with pytest.raises(ValueError, match="histogram"):
        QBAccumulator(16, 2, "exact").state_tensors()


def test_histogram_clamps_out_of_range_margins():
    acc = QBAccumulator(4, 1, "histogram", bins=8, lo=-1.0, hi=1.0)  # a fixed range clamps
    s = torch.tensor([[0.9, 0.1, 0.2, 0.3]])
    acc.add(s, torch.tensor([0.0, -5.0, -5.0, -5.0]))  # alpha = 0.3 - 5: every margin is > 4
    assert acc.counts[:, -1].tolist() == [1, 1, 1, 1]
    acc.add(s, torch.tensor([5.0, 5.0, 0.0, 0.0]))     # alpha = 0.1 + 5: every margin is < -4
    assert acc.counts[:, 0].tolist() == [1, 1, 1, 1] and acc.counts.sum().item() == 8


def test_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        QBAccumulator(8, 2, method="median")
    with pytest.raises(ValueError, match="top_k"):
        qb_update(torch.rand(4, 3), torch.zeros(3), 3)
    with pytest.raises(ValueError, match="bias_E"):
        qb_update(torch.rand(4, 3), torch.zeros(4), 1)
