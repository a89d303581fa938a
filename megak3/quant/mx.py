"""OCP Microscaling (MX v1.0) quantization in pure torch: MXFP4 (E2M1) and MXFP8 (E4M3) (K3_SPEC.md §10).

One E8M0 scale ``X = 2^s`` is shared by ``block_size`` (32) consecutive elements along the LAST
dim; each element stores ``v / X`` rounded to the element format. Shapes for ``x [..., N]``:

    fmt="fp4_e2m1":  scales uint8 [..., N/32],  codes uint8 [..., N/2]   (two E2M1 nibbles per byte)
    fmt="fp8_e4m3":  scales uint8 [..., N/32],  codes torch.float8_e4m3fn [..., N]

Rules (bit-exact; tests/test_mx.py checks them against torchao and a scalar reference):

* scale_mode="floor" (OCP §6.3, torchao FLOOR, microxcaling shared_exp_method="max"):
  ``s = floor(log2(amax)) - emax_elem`` (emax 2 for E2M1, 8 for E4M3), clamped to [-127, 127].
  Elements beyond the element's max normal after scaling saturate (to 6 / 448): e.g. amax 7.9 -> 6.
* scale_mode="rceil" (NVIDIA/cuBLAS, torchao RCEIL): ``s = ceil(log2(amax / max_normal))``, clamped
  to [-127, 127]; never saturates (amax 7.9 -> X = 2 -> 8.0). ``amax / max_normal`` is computed in
  fp32: for max_normal 6 and 448 no fp32 amax makes that quotient round onto a power of two it
  does not really reach (the next fp32 above ``max * 2^j`` is more than half an ulp away), so the
  ceil is exact.
* floor/ceil of log2 come from ``torch.frexp`` (exact, subnormals included), never from float log2.
* Elements round to nearest, ties to even (the code with mantissa bit 0), and keep their sign
  (``-0.0`` and negatives that round to 0 encode as negative zero, like torchao).
* ``amax == 0`` -> scale byte 0 (2^-127) and zero codes (sign bits kept).
* A block holding NaN or +-Inf gets the OCP NaN scale byte 0xFF and zero codes; ``dequantize``
  returns NaN for every element of such a block (E8M0 has no Inf, and OCP defines a NaN scale as
  "all elements NaN"). torchao differs here (it does not special-case Inf).
* The last dim must be a multiple of ``block_size``; otherwise ``ValueError`` (pad it yourself:
  zero padding does not change any block's amax).

FP4 nibble order: element ``2i`` is the LOW nibble and ``2i+1`` the HIGH nibble of byte ``i``
(torchao ``pack_uint4``, compressed-tensors ``pack_fp4_to_uint8``: the released K3 ``weight_packed``
layout). ggml's MXFP4 blocks use the same codes and scale byte but put elements ``j`` and ``j+16`` of
a 32-block into one byte (K3_SPEC §10.1, LLAMACPP), so a llama.cpp converter must repack nibbles.
E2M1 code = s e1 e0 m: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 for codes 0..7, bit 3 the sign.
"""
from __future__ import annotations

import torch

FORMATS = ("fp4_e2m1", "fp8_e4m3")
SCALE_MODES = ("floor", "rceil")
EMAX = {"fp4_e2m1": 2, "fp8_e4m3": 8}           # floor(log2(max normal)) of the element format
MAX_NORMAL = {"fp4_e2m1": 6.0, "fp8_e4m3": 448.0}
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding thresholds between consecutive E2M1 magnitudes and what a tie does: a tie goes to the
# neighbour whose code is even (mantissa bit 0). Code = number of thresholds passed.
#   .25: 0|.5 -> 0     .75: .5|1 -> 1      1.25: 1|1.5 -> 1     1.75: 1.5|2 -> 2
#   2.5: 2|3 -> 2      3.5: 3|4 -> 4       5.0:  4|6 -> 4
_E2M1_UP_ON_TIE = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                   (2.5, False), (3.5, True), (5.0, False))


def _check(x: torch.Tensor, fmt: str, block_size: int, scale_mode: str = "floor") -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: choose one of {FORMATS}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode={scale_mode!r}: choose one of {SCALE_MODES}")
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size={block_size} must be a positive even number (OCP MX uses 32)")
    if x.dim() == 0 or x.shape[-1] % block_size:
        raise ValueError(f"MX quantization needs the last dim to be a multiple of block_size={block_size}, "
                         f"got shape {tuple(x.shape)}; pad the last dim with zeros (does not change any "
                         "block's amax) or choose a block_size that divides it")
    if not x.is_floating_point():
        raise ValueError(f"MX quantization needs a floating-point tensor, got {x.dtype}")


def _shared_exponent(amax: torch.Tensor, fmt: str, scale_mode: str) -> torch.Tensor:
    """int32 shared exponent s per block (X = 2^s) from fp32 ``amax`` (finite, >= 0)."""
    if scale_mode == "floor":
        _, e = torch.frexp(amax)                 # amax = m * 2^e, m in [0.5, 1): floor(log2) = e - 1
        s = e - 1 - EMAX[fmt]
    else:
        q = amax / MAX_NORMAL[fmt]
        m, e = torch.frexp(q)
        s = torch.where(m == 0.5, e - 1, e)      # exact power of two: ceil(log2) = e - 1
        # amax / max_normal below fp32's smallest subnormal rounds to 0: log2 < -149, clamped to -127
        s = torch.where(q == 0, torch.full_like(s, -E8M0_BIAS), s)
    s = torch.where(amax == 0, torch.full_like(s, -E8M0_BIAS), s)
    return s.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def _pow2(s: torch.Tensor) -> torch.Tensor:
    """fp32 2^s for int32 s in [-127, 127], built from exponent bits (exact; 2^-127 is subnormal)."""
    bits = torch.where(s > -E8M0_BIAS, (s + E8M0_BIAS) << 23, torch.full_like(s, 1 << 22))
    return bits.view(torch.float32)


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) of fp32 ``y`` by round-to-nearest-even, saturating at +-6."""
    a = y.abs()
    mag = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for thr, up_on_tie in _E2M1_UP_ON_TIE:
        mag += (a >= thr) if up_on_tie else (a > thr)   # values above 6 pass all 7: code 7 = 6.0
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def _block_scale(x: torch.Tensor, fmt: str, block_size: int, scale_mode: str):
    """(xb fp32 [..., nb, bs], shared exponent int32 [..., nb], non-finite mask [..., nb])."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = xb.abs().amax(-1)                               # NaN propagates through amax
    bad = ~torch.isfinite(amax)
    s = _shared_exponent(torch.where(bad, torch.zeros_like(amax), amax), fmt, scale_mode)
    return xb, s, bad


def quantize(x: torch.Tensor, fmt: str, block_size: int = 32, scale_mode: str = "floor"):
    """x [..., N] float -> (scales uint8 [..., N/bs], codes): see the module docstring for layouts."""
    _check(x, fmt, block_size, scale_mode)
    xb, s, bad = _block_scale(x, fmt, block_size, scale_mode)
    # v / 2^s is exact (a power-of-two scaling) except for sub-2^-126 results, which round to 0 anyway.
    y = xb / _pow2(s).unsqueeze(-1)
    y = torch.where(bad.unsqueeze(-1), torch.zeros_like(y), y)
    scales = torch.where(bad, torch.full_like(s, E8M0_NAN), s + E8M0_BIAS).to(torch.uint8)
    if fmt == "fp4_e2m1":
        c = _e2m1_codes(y).reshape(*x.shape[:-1], -1, 2)
        codes = c[..., 0] | (c[..., 1] << 4)              # low nibble = even element
    else:
        # torch's fp32 -> e4m3fn cast rounds to nearest even; clamp first so it saturates at 448
        # instead of producing NaN (the format has no Inf).
        codes = y.clamp(-MAX_NORMAL[fmt], MAX_NORMAL[fmt]).to(torch.float8_e4m3fn).reshape(x.shape)
    return scales, codes


def scales_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(byte-127); byte 0xFF -> NaN."""
    s = scales.to(torch.int32) - E8M0_BIAS
    x = _pow2(s.clamp(max=E8M0_BIAS))
    return torch.where(scales == E8M0_NAN, torch.full_like(x, float("nan")), x)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked E2M1 codes (uint8 0..15) -> fp32 values."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N/2] -> uint8 codes [..., N] (low nibble first)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def dequantize(scales: torch.Tensor, codes: torch.Tensor, fmt: str, block_size: int = 32,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize``: (scales [..., N/bs], codes) -> [..., N] in ``dtype``.

    ``value * 2^s`` is exact in fp32 (and in bf16 for both formats); NaN-scale blocks give NaN.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: choose one of {FORMATS}")
    vals = e2m1_to_float(unpack_fp4(codes)) if fmt == "fp4_e2m1" else codes.float()
    N = vals.shape[-1]
    if scales.shape != vals.shape[:-1] + (N // block_size,) or N % block_size:
        raise ValueError(f"dequantize: scales {tuple(scales.shape)} do not match codes {tuple(codes.shape)} "
                         f"for fmt={fmt} block_size={block_size}")
    vb = vals.reshape(*vals.shape[:-1], N // block_size, block_size)
    return (vb * scales_to_float(scales).unsqueeze(-1)).reshape(vals.shape).to(dtype)


def fake_quant_values(x: torch.Tensor, fmt: str, block_size: int = 32, scale_mode: str = "floor") -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype without packing (no autograd graph)."""
    _check(x, fmt, block_size, scale_mode)
    xb, s, bad = _block_scale(x, fmt, block_size, scale_mode)
    X = _pow2(s).unsqueeze(-1)
    y = xb / X
    if fmt == "fp4_e2m1":
        q = e2m1_to_float(_e2m1_codes(y))
    else:
        q = y.clamp(-MAX_NORMAL[fmt], MAX_NORMAL[fmt]).to(torch.float8_e4m3fn).float()
    q = torch.where(bad.unsqueeze(-1), torch.full_like(q, float("nan")), q * X)
    return q.reshape(x.shape).to(x.dtype)


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: MX fake quantization. Backward: identity (straight-through estimator, dq/dx = 1).

    A Function rather than ``x + (q - x).detach()``: in bf16 that sum is not always exactly q.
    """

    @staticmethod
    def forward(ctx, x, fmt, block_size, scale_mode):
        return fake_quant_values(x, fmt, block_size, scale_mode)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def fake_quant(x: torch.Tensor, fmt: str, block_size: int = 32, scale_mode: str = "floor") -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype, with a straight-through (identity) gradient."""
    return _FakeQuantSTE.apply(x, fmt, block_size, scale_mode)
