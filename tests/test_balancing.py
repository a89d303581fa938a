"""Quantile Balancing (K3_SPEC.md §7.3, §16 item 5) against hand-built batches and the §14 sketch."""
import pytest
import torch

from megak3.model.balancing import QBAccumulator, max_violation, qb_alternating, qb_update


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
def test_histogram_within_one_bin_of_exact(bins):
    b = torch.randn(16, generator=torch.Generator().manual_seed(2)) * 0.05
    exact, hist = QBAccumulator(16, 2, "exact"), QBAccumulator(16, 2, "histogram", bins=bins)
    for s in _batches(5, (200, 311)):
        exact.add(s, b)
        hist.add(s, b)
    assert hist.counts.shape == (16, bins) and int(hist.counts.sum()) == 511 * 16
    width = 2.0 / bins
    err = (hist.cutoffs() - exact.cutoffs()).abs().max().item()
    assert err <= width, (err, width)
    # after mean-centring both, each entry moves by at most one more width
    assert (hist.solve(b) - exact.solve(b)).abs().max().item() <= 2 * width


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
    acc = QBAccumulator(4, 1, "histogram", bins=8)
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
