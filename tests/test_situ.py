"""SiTU / SiTU-GLU (K3_SPEC.md §7.2, §16 items 3 and 9) against closed-form bounds and SwiGLU."""
import torch
import torch.nn.functional as F

from megak3.model.ffn import SiTUGLUMLP
from megak3.ops.situ import situ, situ_glu

B1, B2 = 4.0, 25.0


def test_hidden_bounded_by_beta1_beta2():
    g = torch.linspace(-200, 200, 2001)
    h = situ_glu(g[:, None].expand(-1, 2001), g[None, :].expand(2001, -1))
    assert h.abs().max() < B1 * B2
    assert h.abs().max() > 99.9  # the bound is approached at g, u -> +inf (tanh(8) * 100 = 99.99998)
    h64 = situ_glu(g.double()[:, None].expand(-1, 2001), g.double()[None, :].expand(2001, -1))
    assert h64.abs().max() < B1 * B2


def _dsitu(g):
    """dSiTU/dg from the spec's closed form (NEMO _situ_bwd_core), float64."""
    t, s = torch.tanh(g / B1), torch.sigmoid(g)
    return (1 - t * t) * s + B1 * t * s * (1 - s)


def test_situ_minimum():
    g = torch.linspace(-3, 0, 300001, dtype=torch.float64)
    y = situ(g)
    i = int(y.argmin())
    # independent: bisection on the closed-form derivative (negative left of the min, positive right)
    lo, hi = torch.tensor(-2.0, dtype=torch.float64), torch.tensor(-0.5, dtype=torch.float64)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _dsitu(mid) < 0 else (lo, mid)
    assert abs(g[i].item() - lo.item()) < 2e-5
    assert abs(y[i].item() - (-0.2698)) < 1e-3
    assert abs(y[i].item() - situ(lo).item()) < 1e-9
    assert abs(lo.item() - (-1.22)) < 5e-3  # the spec quotes -1.22 to two decimals; the min is at -1.2188


def test_close_to_swiglu_near_zero():
    # |beta tanh(z/beta) - z| <= |z|^3 / (3 beta^2) for all z (alternating Taylor series of tanh).
    g = torch.linspace(-0.1, 0.1, 201, dtype=torch.float64)
    G, U = g[:, None].expand(-1, 201), g[None, :].expand(201, -1)
    d_act = (situ(g) - F.silu(g)).abs()
    assert (d_act <= g.abs() ** 3 / (3 * B1 ** 2) + 1e-15).all()
    # and the bound is tight at leading order: (silu - situ) / (sigmoid(g) g^3 / 48) -> 1
    mask = g.abs() > 0.05
    ratio = (F.silu(g) - situ(g))[mask] / (torch.sigmoid(g) * g ** 3 / (3 * B1 ** 2))[mask]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3)
    d_glu = (situ_glu(G, U) - F.silu(G) * U).abs()
    bound = situ(G).abs() * U.abs() ** 3 / (3 * B2 ** 2) + U.abs() * G.abs() ** 3 / (3 * B1 ** 2)
    assert (d_glu <= bound + 1e-15).all()
    assert d_glu.max() < 1e-4 * 0.1 ** 3 * 100  # O(z^3 / beta^2) with a small constant


def test_dtype_and_fp32_math():
    g = torch.randn(64, dtype=torch.bfloat16) * 3
    u = torch.randn(64, dtype=torch.bfloat16) * 3
    out = situ_glu(g, u)
    assert out.dtype == torch.bfloat16
    ref = situ_glu(g.float(), u.float()).to(torch.bfloat16)  # fp32 math, one rounding at the end
    assert torch.equal(out, ref)


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(6, 5, generator=gen, dtype=torch.float64) * 5).requires_grad_()
    u = (torch.randn(6, 5, generator=gen, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: situ_glu(a, b), (g, u))
    # and the autograd derivative matches the spec's closed form
    x = torch.linspace(-8, 8, 101, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(situ(x).sum(), x)
    assert torch.allclose(gx, _dsitu(x.detach()), atol=1e-12)


def test_shape_mismatch_raises():
    try:
        situ_glu(torch.zeros(2, 3), torch.zeros(3))
    except ValueError as e:
        assert "same shape" in str(e)
    else:
        raise AssertionError("expected ValueError")


def test_shared_experts_split_equals_fused():
    torch.manual_seed(0)
    D, m = 16, 12
    fused = SiTUGLUMLP(D, 2 * m)
    for p in fused.parameters():
        p.data.normal_(0, 0.5)
    halves = [SiTUGLUMLP(D, m) for _ in range(2)]
    for i, h in enumerate(halves):
        rows = slice(i * m, (i + 1) * m)
        h.gate_proj.weight.data.copy_(fused.gate_proj.weight[rows])
        h.up_proj.weight.data.copy_(fused.up_proj.weight[rows])
        h.down_proj.weight.data.copy_(fused.down_proj.weight[:, rows])
    x = torch.randn(10, D)
    assert torch.allclose(fused(x), halves[0](x) + halves[1](x), atol=1e-6)
