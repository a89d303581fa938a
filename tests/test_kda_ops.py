"""KDA kernels (megak3/ops/kda/) against an explicit-matrix reference written here from K3_SPEC §4.2.

All fp32 on CPU (fp64 for gradcheck); small shapes so the file runs in a few seconds.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import megak3.ops.kda.chunk_intra as kda_mod
import megak3.ops.kda.chunked as kda_chunked
from megak3.ops.kda import chunk_kda, kda, kda_gate, recurrent_kda

TOL = 1e-5


def make_inputs(B, T, H, K, V, seed=0, gate="lower_bound", dtype=torch.float32):
    """L2-normalised q, k; g from the K3 gate with random z (or a forced pattern); beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    g = kda_gate(2 * torch.randn(B, T, H * K, generator=gen), A_log, 0.1 * torch.randn(H * K, generator=gen))
    if gate == "min":
        g = torch.full_like(g, -5.0)
    elif gate == "mix":  # channels flip between the bound and almost no decay
        g = torch.where(torch.rand(g.shape, generator=gen) < 0.5, torch.full_like(g, -5.0), torch.full_like(g, -1e-4))
    elif gate == "beyond":  # outside the K3 range: forces the explicit-tile path
        g = torch.full_like(g, -12.0) * torch.rand(g.shape, generator=gen)
    beta = torch.rand(B, T, H, generator=gen) * 0.98 + 0.01
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def reference_kda(q, k, v, g, beta, scale=None, S0=None):
    """S_t = (I - b k k^T) Diag(alpha) S_{t-1} + b k v^T,  o_t = S_t^T q_t scale; per head, fp64 matrices."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    S_final = torch.zeros(B, H, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, V, dtype=torch.float64) if S0 is None else S0[b, h].double()
            for t in range(T):
                kt, bt = k[b, t, h][:, None], beta[b, t, h]
                S = (eye - bt * kt @ kt.T) @ torch.diag(g[b, t, h].exp()) @ S + bt * kt @ v[b, t, h][None, :]
                o[b, t, h] = S.T @ (q[b, t, h] * scale)
            S_final[b, h] = S
    return o, S_final


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def test_recurrent_matches_explicit_reference():
    q, k, v, g, beta = make_inputs(2, 23, 2, 8, 5)
    S0 = torch.randn(2, 2, 8, 5)
    o, S = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_ref, S_ref = reference_kda(q, k, v, g, beta, S0=S0)
    assert o.dtype == torch.float32 and o.shape == (2, 23, 2, 5)
    assert max_err(o, o_ref) < TOL and max_err(S, S_ref) < TOL
    o2, _ = recurrent_kda(q, k, v, g, beta, scale=0.7)
    assert max_err(o2, reference_kda(q, k, v, g, beta, scale=0.7)[0]) < TOL


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 15, 64, 100, 200])
def test_chunk_matches_recurrent(T, chunk_size):
    q, k, v, g, beta = make_inputs(2, T, 2, 32, 16, seed=T)
    S0 = torch.randn(2, 2, 32, 16) * 0.5
    o_r, S_r = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_c, S_c = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=chunk_size)
    assert o_c.shape == o_r.shape and S_c.shape == S_r.shape
    assert max_err(o_c, o_r) < TOL and max_err(S_c, S_r) < TOL
    o_c0, S_c0 = chunk_kda(q, k, v, g, beta, chunk_size=chunk_size)
    assert S_c0 is None and max_err(o_c0, recurrent_kda(q, k, v, g, beta)[0]) < TOL


def test_state_handoff_composes():
    """Running [0, 37) then [37, 150) from the first half's final state equals the full run (CP basis)."""
    q, k, v, g, beta = make_inputs(1, 150, 2, 16, 8, seed=3)
    S0 = torch.randn(1, 2, 16, 8)
    o_full, S_full = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=16)
    first = [x[:, :37] for x in (q, k, v, g, beta)]
    second = [x[:, 37:] for x in (q, k, v, g, beta)]
    o1, S1 = chunk_kda(*first, initial_state=S0, output_final_state=True, chunk_size=16)
    o2, S2 = chunk_kda(*second, initial_state=S1, output_final_state=True, chunk_size=16)
    assert max_err(torch.cat([o1, o2], 1), o_full) < TOL and max_err(S2, S_full) < TOL


def test_packed_documents_equal_separate_runs():
    offsets = [0, 5, 5, 70, 133, 200]  # includes an empty document
    q, k, v, g, beta = make_inputs(1, 200, 2, 16, 8, seed=4)
    S0 = torch.randn(5, 2, 16, 8)
    cu = torch.tensor(offsets, dtype=torch.int32)
    o_c, S_c = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu, chunk_size=16)
    o_r, S_r = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, cu_seqlens=cu)
    for n, (s, e) in enumerate(zip(offsets, offsets[1:])):
        doc = [x[:, s:e] for x in (q, k, v, g, beta)]
        o_n, S_n = reference_kda(*doc, S0=S0[n:n + 1]) if e > s else (None, S0[n:n + 1])
        if e > s:
            assert max_err(o_c[:, s:e], o_n) < TOL and max_err(o_r[:, s:e], o_n) < TOL
        assert max_err(S_c[n], S_n[0]) < TOL and max_err(S_r[n], S_n[0]) < TOL
    o_c0, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, chunk_size=64)  # zero initial states
    assert max_err(o_c0, recurrent_kda(q, k, v, g, beta, cu_seqlens=cu)[0]) < TOL


def _count_explicit_path(monkeypatch) -> dict:
    """Counts calls of chunk_kda's explicit-decay path in calls["explicit"]."""
    calls = {"explicit": 0}
    explicit = kda_mod._decays_explicit

    def spy(*args):
        calls["explicit"] += 1
        return explicit(*args)

    monkeypatch.setattr(kda_mod, "_decays_explicit", spy)
    return calls


@pytest.mark.parametrize("gate", ["min", "mix", "beyond"])
def test_extreme_gates(gate, monkeypatch):
    calls = _count_explicit_path(monkeypatch)
    q, k, v, g, beta = make_inputs(1, 256, 2, 32, 32, seed=5, gate=gate)
    o_c, S_c = chunk_kda(q, k, v, g, beta, output_final_state=True, chunk_size=64)
    o_r, S_r = recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert torch.isfinite(o_c).all() and torch.isfinite(S_c).all()
    assert max_err(o_c, o_r) < TOL and max_err(S_c, S_r) < TOL
    assert calls["explicit"] == (1 if gate == "beyond" else 0)  # K3 gates always take the factored path


def test_gate_formula_and_range():
    H, K = 3, 8
    gen = torch.Generator().manual_seed(6)
    z = torch.randn(4, 16, H * K, generator=gen)
    A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(z, A_log, dt_bias)
    assert g.shape == (4, 16, H, K) and g.dtype == torch.float32
    for h in range(H):  # per-head formula, written out
        zh = z[..., h * K:(h + 1) * K] + dt_bias[h * K:(h + 1) * K]
        assert max_err(g[..., h, :], -5.0 / (1 + torch.exp(-math.exp(A_log[h].item()) * zh))) < 1e-6
    assert max_err(kda_gate(z.view(4, 16, H, K), A_log, dt_bias), g) < 1e-7
    assert (g >= -5).all() and (g <= 0).all()  # fp32 sigmoid saturates to exactly 0 / 1 for large |z|
    g_mid = kda_gate(0.1 * z, A_log, 0.1 * dt_bias)
    assert (g_mid > -5).all() and (g_mid < 0).all()
    # C = 16 sub-tile: the reciprocal decay exp(-cumsum(g)) stays <= e^80, finite in bf16
    g_big = kda_gate(100 * torch.randn(2, 64, H * K, generator=gen), A_log, dt_bias)
    recip = torch.exp(-g_big.view(2, 4, 16, H, K).cumsum(2))
    assert (g_big >= -5).all() and (g_big <= 0).all()
    assert recip.max() <= math.exp(80) * (1 + 1e-5) and torch.isfinite(recip.bfloat16()).all()
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(z, A_log, dt_bias, lower_bound=1.0)
    with pytest.raises(ValueError, match="z has shape"):
        kda_gate(z[..., :5], A_log, dt_bias)


@pytest.mark.parametrize("gate", ["lower_bound", "beyond"])
def test_gradcheck_chunk(gate):
    q, k, v, g, beta = make_inputs(1, 10, 2, 4, 3, seed=7, gate=gate, dtype=torch.float64)
    S0 = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
    fn = lambda q, k, v, g, b, s: chunk_kda(q, k, v, g, b, initial_state=s, output_final_state=True, chunk_size=4)
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)


def test_gradcheck_recurrent():
    q, k, v, g, beta = make_inputs(1, 6, 2, 4, 3, seed=8, dtype=torch.float64)
    S0 = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta, S0)]
    fn = lambda q, k, v, g, b, s: recurrent_kda(q, k, v, g, b, initial_state=s, output_final_state=True)
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6)


def test_gradients_chunk_equal_recurrent():
    inputs = make_inputs(2, 50, 2, 16, 8, seed=9)
    S0 = torch.randn(2, 2, 16, 8)
    gen = torch.Generator().manual_seed(10)
    do, dS = torch.randn(2, 50, 2, 8, generator=gen), torch.randn(2, 2, 16, 8, generator=gen)
    grads = []
    for fn in (lambda *a: chunk_kda(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=16),
               lambda *a: recurrent_kda(*a[:5], initial_state=a[5], output_final_state=True)):
        args = [x.clone().requires_grad_() for x in (*inputs, S0)]
        o, S = fn(*args)
        ((o * do).sum() + (S * dS).sum()).backward()
        grads.append([a.grad for a in args])
    for g_c, g_r in zip(*grads):
        assert max_err(g_c, g_r) < 1e-4


def test_dtype_dispatch_and_errors():
    q, k, v, g, beta = make_inputs(1, 40, 2, 16, 8, seed=11)
    o_ref, _ = recurrent_kda(q, k, v, g, beta)
    o_bf, _ = chunk_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, chunk_size=16)
    assert o_bf.dtype == torch.bfloat16 and max_err(o_bf, o_ref) < 5e-2
    o_d, _ = kda(q, k, v, g, beta, chunk_size=16, use_fla=True)  # CPU: falls back to chunk_kda
    assert max_err(o_d, o_ref) < TOL
    with pytest.raises(ValueError, match="B == 1"):
        chunk_kda(*(torch.cat([x, x]) for x in (q, k, v, g, beta)), cu_seqlens=torch.tensor([0, 40]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=24)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 16, 8))
    with pytest.raises(ValueError, match="cu_seqlens"):
        recurrent_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 50]))


@pytest.mark.parametrize("C", [1, 5, 16, 64])
def test_unit_lower_solve(C):
    """(I + L)^-1 rhs by tile inverses + block forward substitution (no-grad and autograd variants)."""
    gen = torch.Generator().manual_seed(12)
    L = (0.3 * torch.randn(3, 2, C, C, generator=gen, dtype=torch.float64)).tril(-1)
    rhs = torch.randn(3, 2, C, 7, generator=gen, dtype=torch.float64)
    eye = torch.eye(C, dtype=torch.float64)
    ref = torch.linalg.solve(eye + L, rhs)
    s = min(C, 16)
    for grad in (False, True):
        assert max_err(kda_mod._solve_unit_lower(L, rhs, s, grad), ref) < 1e-10
    assert max_err(kda_mod._solve_unit_lower(L[:, 1], rhs[:, 1], s, False), ref[:, 1]) < 1e-10  # offset view
    # only the strictly lower triangle is read (the factored scores leave finite junk above it)
    junk = L + torch.triu(torch.full_like(L, 1e30))
    assert max_err(kda_mod._solve_unit_lower(junk, rhs, s, False), ref) < 1e-10
    if C <= 16:
        assert max_err(kda_mod._small_unit_lower_inverse(L), torch.linalg.inv(eye + L)) < 1e-10


def test_small_inverse_no_cancellation():
    """Nearly identical keys, no decay, beta ~ 1 (L ~ all ones below the diagonal): the tile inverse
    stays accurate in fp32 (~1e-7; a Neumann-style product (I - L)(I + L^2)(I + L^4)(I + L^8) passes
    through entries ~3e3 here and is off by ~8e-4), and is exact for L = all ones."""
    gen = torch.Generator().manual_seed(17)
    L = (0.97 + 0.03 * torch.rand(64, 16, 16, generator=gen)).tril(-1)
    ref = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + L.double())
    assert max_err(kda_mod._small_unit_lower_inverse(L), ref) < 1e-6
    ones = torch.ones(16, 16).tril(-1)
    ref1 = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + ones.double()).round()
    assert torch.equal(kda_mod._small_unit_lower_inverse(ones).double(), ref1)


@pytest.mark.parametrize("grad", [False, True])
def test_slabs_carry_state_and_documents(grad, monkeypatch):
    """Slabs forced down to 2 chunks: the state crosses slab boundaries, documents straddle them, and
    only the slab holding out-of-range gates takes the explicit path; all equal the recurrence."""
    monkeypatch.setattr(kda_chunked, "_SLAB_ELEMENTS", 2 * (2 * 16 * 16))  # Z * C * max(K, V) = 2 * 16 * 16
    calls = _count_explicit_path(monkeypatch)
    q, k, v, g, beta = make_inputs(1, 200, 2, 16, 8, seed=14)
    g = g.clone()
    g[:, 100:110] = -12.0 * torch.rand(g[:, 100:110].shape, generator=torch.Generator().manual_seed(15))
    S0 = torch.randn(1, 2, 16, 8)
    offsets = [0, 37, 40, 130, 200]
    cu = torch.tensor(offsets)
    S0_docs = torch.randn(4, 2, 16, 8)
    args = [x.clone().requires_grad_(grad) for x in (q, k, v, g, beta)]
    with torch.set_grad_enabled(grad):
        o_c, S_c = chunk_kda(*args, initial_state=S0, output_final_state=True, chunk_size=16)
        assert calls["explicit"] == 1  # tokens 100..109: chunk 6 of 13, slab 3 of 7
        o_d, S_d = chunk_kda(*args, initial_state=S0_docs, output_final_state=True, cu_seqlens=cu, chunk_size=16)
    o_r, S_r = recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_rd, S_rd = recurrent_kda(q, k, v, g, beta, initial_state=S0_docs, output_final_state=True, cu_seqlens=cu)
    assert max_err(o_c, o_r) < TOL and max_err(S_c, S_r) < TOL
    assert max_err(o_d, o_rd) < TOL and max_err(S_d, S_rd) < TOL
    if grad:  # gradients through the slabbed scan equal the recurrence's
        gen = torch.Generator().manual_seed(16)
        do = torch.randn(o_c.shape, generator=gen)
        g_c = torch.autograd.grad((o_c * do).sum(), args)
        args_r = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]
        g_r = torch.autograd.grad((recurrent_kda(*args_r, initial_state=S0)[0] * do).sum(), args_r)
        for a, b in zip(g_c, g_r):
            assert max_err(a, b) < 1e-4


@pytest.mark.parametrize("T", [64, 100])
def test_chunk_no_grad_path_matches_grad_path(T):
    """Inference (no autograd: in-place temporaries) and training (autograd) paths agree with the reference."""
    q, k, v, g, beta = make_inputs(2, T, 2, 16, 8, seed=13)
    S0 = torch.randn(2, 2, 16, 8)
    o_ref, S_ref = reference_kda(q, k, v, g, beta, S0=S0)
    with torch.no_grad():
        o_n, S_n = chunk_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True, chunk_size=64)
    args = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o_g, S_g = chunk_kda(*args, initial_state=S0, output_final_state=True, chunk_size=64)
    assert o_g.requires_grad and not o_n.requires_grad
    for o, S in ((o_n, S_n), (o_g, S_g)):
        assert max_err(o, o_ref) < TOL and max_err(S, S_ref) < TOL


def test_kda_layer_one_head_one_token():
    """One KDA head (e.g. one per TP rank) and a one-token sequence: the gate pre-activation
    [B, 1, 1*K] must not be read as [..., H, K] (it was: g came out [B, 1, K] and the core refused it)."""
    from megak3.config import load_model_config
    from megak3.model.kda import KimiDeltaAttention
    from megak3.model.seqinfo import make_seq_info
    from tests.conftest import SMALL_MODEL

    torch.manual_seed(0)
    cfg = load_model_config("k3_tiny", **{**SMALL_MODEL, "kda.num_heads": 1})
    from megak3.model.init import init_model

    layer = init_model(KimiDeltaAttention(cfg), seed=0)  # its parameters are made empty: initialise them
    x = torch.randn(2, 3, cfg.hidden_size)
    whole = layer(x, make_seq_info(2, 3, None, x.device))
    first = layer(x[:, :1], make_seq_info(2, 1, None, x.device))
    torch.testing.assert_close(first, whole[:, :1], rtol=1e-5, atol=1e-6)   # causal: token 0 sees only itself
