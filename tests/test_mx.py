"""megak3/quant/mx.py against the OCP MX rule: K3_SPEC §10.3 worked examples, exhaustive code round
trips, ties, saturation, zero / NaN / Inf blocks, and bit-exact agreement with two independent
references: a NumPy implementation written here from the OCP text, and torchao's ``to_mx``."""
import math

import numpy as np
import pytest
import torch

from megak3.quant import mx

FP4, FP8 = "fp4_e2m1", "fp8_e4m3"


# ---- independent reference (NumPy, float64, grid search; shares no code with mx.py) -------------

def _grid(fmt):
    """Non-negative element magnitudes indexed by code (code parity = mantissa LSB)."""
    if fmt == FP4:
        return np.array([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
    vals = []
    for k in range(127):  # 0x7F is NaN in e4m3fn
        e, m = k >> 3, k & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


def _ref_exponent(amax, fmt, mode):
    emax, maxn = (2, 6.0) if fmt == FP4 else (8, 448.0)
    if amax == 0:
        return -127
    if mode == "floor":
        s = math.frexp(amax)[1] - 1 - emax          # floor(log2 amax), exact for floats
    else:                                            # smallest s with maxn * 2^s >= amax (exact compare)
        s = math.frexp(amax / maxn)[1] - 2
        while maxn * 2.0 ** s < amax:
            s += 1
    return max(-127, min(127, s))


def ref_quantize(x, fmt, mode="floor", bs=32):
    """Returns (scale bytes [nb], codes [n] with sign bit 0x8 / 0x80, dequantized float64 [n])."""
    v = np.asarray(x, dtype=np.float64).reshape(-1, bs)
    grid = _grid(fmt)
    sign_bit = 8 if fmt == FP4 else 0x80
    scales, codes, deq = [], [], []
    for blk in v:
        amax = np.abs(blk).max()
        if not np.isfinite(amax):
            scales.append(255); codes += [0] * bs; deq += [math.nan] * bs
            continue
        s = _ref_exponent(float(amax), fmt, mode)
        scales.append(s + 127)
        y = np.abs(blk) / 2.0 ** s
        d = np.abs(y[:, None] - grid[None, :])
        best = d.min(1, keepdims=True)
        cand = d == best                                     # one or two nearest codes
        even = cand & (np.arange(len(grid)) % 2 == 0)[None, :]
        k = np.where(even.any(1), even.argmax(1), cand.argmax(1))  # tie -> even code
        neg = np.signbit(blk)
        codes += list(k + sign_bit * neg)
        deq += list(np.where(neg, -1, 1) * grid[k] * 2.0 ** s)
    return np.array(scales), np.array(codes), np.array(deq)


def _codes_flat(codes, fmt):
    if fmt == FP4:
        return mx.unpack_fp4(codes).reshape(-1).numpy().astype(np.int64)
    return codes.view(torch.uint8).reshape(-1).numpy().astype(np.int64)


def adversarial(seed=0):
    """Blocks that stress every branch: ties at many scales, saturation, zeros, -0, subnormals, huge."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(8, 32, generator=g) * torch.exp2(torch.randint(-30, 30, (8, 1), generator=g).float())]
    mids = torch.tensor([.25, .75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, 6.5, 0.1])
    for e in (-3, 0, 7, 60):                                    # FP4 ties, shifted by powers of two
        blk = torch.zeros(32); blk[0] = 4.0; blk[1:11] = mids; blk[11:21] = -mids
        rows.append((blk * 2.0 ** e)[None])
    e4 = torch.tensor([448., 464., 480., 1000., 17., 19., 2 ** -9 * 1.5, 2 ** -9 * 2.5, 0.3, -240.5])
    blk = torch.zeros(32); blk[0] = 256.0; blk[1:11] = e4; blk[11:21] = -e4
    rows.append(blk[None])
    rows.append(torch.zeros(1, 32))
    rows.append(-torch.zeros(1, 32))
    rows.append(torch.randn(1, 32, generator=g) * 1e-41)       # fp32 subnormal block -> scale clamps at -127
    rows.append(torch.randn(1, 32, generator=g).clamp(-3, 3) * 1e38)  # near the fp32 top
    rows.append(torch.full((1, 32), 2.0 ** -127))
    return torch.cat(rows)


# ---- worked examples (K3_SPEC §10.3, §16 item 8) ---------------------------------------------

def _block(vals):
    b = torch.zeros(32); b[:len(vals)] = torch.tensor(vals); return b


def test_spec_worked_examples():
    s, c = mx.quantize(_block([5.0]), FP4)
    assert s.tolist() == [127] and mx.dequantize(s, c, FP4)[0].item() == 4.0   # tie 4|6 -> 4
    s, c = mx.quantize(_block([5.0, 1.75, 0.25, 2.5]), FP4)
    assert mx.dequantize(s, c, FP4)[:4].tolist() == [4.0, 2.0, 0.0, 2.0]
    for mode, want in (("floor", 6.0), ("rceil", 8.0)):
        s, c = mx.quantize(_block([7.9, 5.0]), FP4, scale_mode=mode)
        assert mx.dequantize(s, c, FP4)[0].item() == want
    assert mx.dequantize(*mx.quantize(_block([7.9, 5.0]), FP4), FP4)[1].item() == 4.0
    # E4M3: amax 464 -> exponent 8 - 8 = 0, X = 1; 464 saturates to 448 (not NaN)
    s, c = mx.quantize(_block([464.0, -500.0 / 1.1]), FP8)
    assert s.tolist() == [127] and mx.dequantize(s, c, FP8)[:2].tolist() == [448.0, -448.0]


def test_nibble_order_low_is_even():
    s, c = mx.quantize(_block([6.0, -0.5]), FP4)          # codes 7 and 9
    assert c[0].item() == 7 | (9 << 4)


# ---- exhaustive round trips ------------------------------------------------------------------

@pytest.mark.parametrize("s", [-127, -100, -3, 0, 5, 120])
def test_every_fp4_code_round_trips(s):
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)             # one 32-block, all codes twice
    packed = codes[0::2] | (codes[1::2] << 4)
    scales = torch.tensor([s + 127], dtype=torch.uint8)
    x = mx.dequantize(scales, packed, FP4)
    s2, p2 = mx.quantize(x, FP4)
    assert torch.equal(s2, scales) and torch.equal(p2, packed)


@pytest.mark.parametrize("s", [-127, -60, -8, 0, 9, 119])
def test_every_finite_fp8_value_round_trips(s):
    bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)   # 254 finite
    bits = torch.cat([bits, torch.tensor([0x7E, 0xFE], dtype=torch.uint8)])               # pad to 256
    codes = bits.view(torch.float8_e4m3fn).reshape(8, 32)
    codes[:, 0] = torch.tensor(448.0).to(torch.float8_e4m3fn)        # each block's amax = 448 -> scale s
    scales = torch.full((8, 1), s + 127, dtype=torch.uint8)
    x = mx.dequantize(scales, codes, FP8)
    s2, c2 = mx.quantize(x, FP8)
    assert torch.equal(s2, scales) and torch.equal(c2.view(torch.uint8), codes.view(torch.uint8))


# ---- ties, saturation, specials --------------------------------------------------------------

def test_fp4_ties_go_to_even_code():
    x = _block([4.0, .25, .75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5])     # amax 4 -> X = 1
    got = mx.dequantize(*mx.quantize(x, FP4), FP4)[:9].tolist()
    assert got == [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0]


def test_fp8_ties_and_subnormals():
    # amax 256 -> X = 1. 17 lies between 16 and 18 (code mantissas 0 and 1) -> 16; 19 -> 20;
    # 1.5 * 2^-9 between subnormals 1 and 2 (x 2^-9) -> 2 * 2^-9.
    x = _block([256.0, 17.0, 19.0, 1.5 * 2 ** -9, 2 ** -11])
    got = mx.dequantize(*mx.quantize(x, FP8), FP8)[:5].tolist()
    assert got == [256.0, 16.0, 20.0, 2 * 2 ** -9, 0.0]


def test_zero_block_and_signed_zero():
    s, c = mx.quantize(torch.zeros(64), FP4)
    assert s.tolist() == [0, 0] and c.eq(0).all()
    x = -torch.zeros(32)
    for fmt in (FP4, FP8):
        y = mx.dequantize(*mx.quantize(x, fmt), fmt)
        assert y.eq(0).all() and torch.signbit(y).all()


@pytest.mark.parametrize("fmt", [FP4, FP8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_block_gets_nan_scale(fmt, bad):
    x = torch.randn(64)
    x[40] = bad
    s, c = mx.quantize(x, fmt)
    assert s[1].item() == 0xFF and s[0].item() != 0xFF
    y = mx.dequantize(s, c, fmt)
    assert y[32:].isnan().all() and y[:32].isfinite().all()
    assert torch.equal(mx.fake_quant(x, fmt)[:32], y[:32]) and mx.fake_quant(x, fmt)[32:].isnan().all()


def test_bad_shapes_and_names_raise():
    with pytest.raises(ValueError, match="multiple of block_size=32"):
        mx.quantize(torch.randn(4, 48), FP4)
    with pytest.raises(ValueError, match="fmt="):
        mx.quantize(torch.randn(32), "fp6")
    with pytest.raises(ValueError, match="scale_mode="):
        mx.fake_quant(torch.randn(32), FP8, scale_mode="even")


# ---- agreement with the independent references -----------------------------------------------

@pytest.mark.parametrize("fmt", [FP4, FP8])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_matches_numpy_reference(fmt, mode):
    x = torch.cat([adversarial(0), torch.randn(16, 32) * 3])
    x[3, 5] = float("nan")
    s, c = mx.quantize(x, fmt, scale_mode=mode)
    rs, rc, rd = ref_quantize(x.numpy(), fmt, mode)
    assert np.array_equal(s.reshape(-1).numpy(), rs)
    assert np.array_equal(_codes_flat(c, fmt), rc)
    d = mx.dequantize(s, c, fmt).reshape(-1).double().numpy()
    assert np.array_equal(d, rd, equal_nan=True)
    fq = mx.fake_quant(x, fmt, scale_mode=mode).reshape(-1).double().numpy()
    assert np.array_equal(fq, rd, equal_nan=True)


@pytest.mark.parametrize("fmt", [FP4, FP8])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_matches_torchao_to_mx(fmt, mode):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    x = torch.cat([adversarial(1), torch.randn(64, 32) * 0.02])
    # torchao divides by max(X, 2^-126) when the scale clamps to 2^-127, so it differs from OCP on
    # blocks whose amax is below ~2^-118; those blocks are covered by the NumPy reference only.
    x = x[x.abs().amax(1) > 2.0 ** -100]
    dt = torch.float4_e2m1fn_x2 if fmt == FP4 else torch.float8_e4m3fn
    ts, td = mx_tensor.to_mx(x, dt, 32, getattr(ScaleCalculationMode, mode.upper()))
    s, c = mx.quantize(x, fmt, scale_mode=mode)
    assert torch.equal(s.reshape(-1), ts.view(torch.uint8).reshape(-1))
    assert torch.equal(c.view(torch.uint8).reshape(-1), td.view(torch.uint8).reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_equals_dequantize_quantize_and_grad_is_identity(dtype):
    x = (torch.randn(3, 4, 64) * 5).to(dtype).requires_grad_()
    for fmt in (FP4, FP8):
        y = mx.fake_quant(x, fmt)
        assert y.dtype == dtype
        assert torch.equal(y, mx.dequantize(*mx.quantize(x.detach(), fmt), fmt, dtype=dtype))
        g = torch.randn_like(x)
        (gx,) = torch.autograd.grad(y, x, g)
        assert torch.equal(gx, g)
