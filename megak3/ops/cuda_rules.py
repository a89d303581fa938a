"""The CUDA grouped GEMM's rules as a table, and a recorder of the calls that reach it.

``torch._grouped_mm`` (``F.grouped_mm``) runs on CPU without most of the limits its CUDA kernels
have, so a call that works in the CPU tests can fail, or fall back to a host-syncing loop, on the
first GPU. ``GROUPED_MM_RULES`` lists what torch 2.13 checks on CUDA, each rule with where it lives:

* ``aten/src/ATen/native/GroupedMMUtils.h`` ``_grouped_mm_validate_inputs`` and
  ``check_valid_strides_and_return_transposed`` (TORCH_CHECKs before any work);
* ``aten/src/ATen/native/cuda/GroupedBlas.cpp`` ``_grouped_mm_cuda``: the sync-free CUTLASS kernel
  (``bf16bf16_grouped_mm``) only for bf16 operands and output on sm90 / sm100, else
  ``_grouped_mm_fallback`` (``offs.cpu()``: a host sync, one GEMM per group);
* ``aten/src/ATen/native/cuda/GroupMM.cu``: ``group_count < 1024`` (its preparation kernel runs
  one thread per group in one block);
* ``aten/src/ATen/native/cuda/GroupMMCommon.cuh`` ``prepare_grouped_gemm_data``: device asserts on
  the offsets (non-decreasing; empty groups only where K is ragged with A column-major and B
  row-major; 16-byte multiples of the ragged size for some layouts).

``check_grouped_mm(a, b, offs, bias, out_dtype)`` returns the names of the rules a call breaks
(empty: the CUDA fast path takes it, without a host sync). ``record_grouped_mm()`` is a dispatch
mode that keeps every ``aten._grouped_mm`` call made under it (forward, autograd's backward,
deferred weight gradients) as a :class:`GroupedMMCall`, so tests can run the MoE on CPU and check
each call against the table (tests/test_cuda_constraints.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GROUPED_MM_MAX_GROUPS = 1023
"""the most groups one CUDA grouped GEMM call takes (GroupMM.cu: ``group_count < 1024``)"""

GROUPED_MM_RULES = {
    "dtype_bf16": "mat_a, mat_b and the output are bfloat16 (else _grouped_mm_fallback: offs.cpu(), "
                  "a host sync; fp32/fp16 only there, other dtypes refused) [GroupedBlas.cpp]",
    "dims": "mat_a and mat_b are 2-D or 3-D; the contraction dims match unless both are 2-D "
            "[GroupedMMUtils.h]",
    "layout": "each operand is row- or column-major in its last two dims [GroupedMMUtils.h]",
    "stride_16B": "the leading stride of each operand is a multiple of 16 bytes [GroupedMMUtils.h]",
    "data_ptr_16B": "each operand's data pointer is 16-byte aligned [GroupedMMUtils.h]",
    "offs": "offsets present iff an operand is 2-D; then 1-D int32 [GroupedMMUtils.h]",
    "no_bias": "no bias; out_dtype (if given) equals mat_a's dtype [GroupedMMUtils.h]",
    "groups_lt_1024": f"at most {GROUPED_MM_MAX_GROUPS} groups [GroupMM.cu]",
    "offs_monotone": "offsets non-decreasing from 0, the last within the ragged dim [GroupMMCommon.cuh]",
    "empty_groups": "an empty group only where both operands are 2-D (ragged K) with mat_a "
                    "column-major and mat_b row-major, or where one is 3-D [GroupMMCommon.cuh]",
    "ragged_16B": "the ragged size of every group but the last a multiple of 16 bytes where the "
                  "ragged dim is the strided one (2-D/2-D with mat_a row-major or mat_b column-major; "
                  "3-D/2-D) [GroupMMCommon.cuh]",
}


def _layout(m: torch.Tensor) -> Optional[Tuple[bool, int]]:
    """(row_major, leading stride) of the last two dims, or None when neither layout fits
    (check_valid_strides_and_return_transposed)."""
    r, c = m.shape[-2], m.shape[-1]
    sr, sc = m.stride()[-2], m.stride()[-1]
    if sr == 1 and sc >= max(1, r):
        return False, sc
    if sc == 1 and sr >= max(1, c):
        return True, sr
    return None


def check_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: Optional[torch.Tensor] = None,
                     bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None,
                     offs_values: Optional[List[int]] = None) -> List[str]:
    """The rules of ``GROUPED_MM_RULES`` that ``torch._grouped_mm(a, b, offs, bias, out_dtype)``
    breaks on CUDA (sm90 / sm100). ``offs_values``: the offsets as host ints (read from ``offs``
    when not given; only tests call this)."""
    bad: List[str] = []
    bf16 = torch.bfloat16
    if a.dtype != bf16 or b.dtype != bf16 or (out_dtype or a.dtype) != bf16:
        bad.append("dtype_bf16")
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        return bad + ["dims"]
    a2, b2 = a.dim() == 2, b.dim() == 2
    if not (a2 and b2) and a.shape[-1] != b.shape[-2]:
        bad.append("dims")
    lay = [_layout(m) for m in (a, b)]
    if None in lay:
        bad.append("layout")
    elif any(lead * m.element_size() % 16 for (_, lead), m in zip(lay, (a, b))):
        bad.append("stride_16B")
    if any(m.numel() and m.data_ptr() % 16 for m in (a, b)):
        bad.append("data_ptr_16B")
    if (offs is not None) != (a2 or b2) or (offs is not None and (offs.dim() != 1 or offs.dtype != torch.int32)):
        bad.append("offs")
    if bias is not None or (out_dtype is not None and out_dtype != a.dtype):
        bad.append("no_bias")
    groups = offs.shape[0] if a2 and b2 else b.shape[0] if a2 else a.shape[0]
    if offs is not None and groups != offs.shape[0]:
        bad.append("offs")
    if groups > GROUPED_MM_MAX_GROUPS:
        bad.append("groups_lt_1024")
    if offs is None or None in lay or "offs" in bad:
        return bad
    vals = offs_values if offs_values is not None else [int(x) for x in offs.tolist()]
    a_row, b_row = lay[0][0], lay[1][0]
    if a2 and b2:
        ragged, n = "K", a.shape[1]
    elif a2:
        ragged, n = "M", a.shape[0]
    else:
        ragged, n = "N", b.shape[1]
    sizes = [e - s for s, e in zip([0] + vals[:-1], vals)]
    if any(d < 0 for d in sizes) or (vals and vals[-1] > n):
        bad.append("offs_monotone")
    if ragged == "K" and not (not a_row and b_row) and any(d == 0 for d in sizes):
        bad.append("empty_groups")
    strided = ((ragged == "K" and (a_row or not b_row)) or (ragged == "M" and not a_row)
               or (ragged == "N"))   # 3-D/2-D: the output's ragged dim is its columns
    if strided:
        align = 16 // a.element_size()
        if any(d % align for d in sizes[:-1]):
            bad.append("ragged_16B")
    return bad


@dataclass
class GroupedMMCall:
    """One recorded ``aten._grouped_mm`` call: operand metadata, the offsets' values and the rules
    it breaks (``check_grouped_mm``)."""

    shapes: Tuple[tuple, ...]
    strides: Tuple[tuple, ...]
    dtypes: Tuple[torch.dtype, ...]
    offs: Optional[List[int]]
    broken: List[str] = field(default_factory=list)

    @property
    def groups(self) -> int:
        a2, b2 = len(self.shapes[0]) == 2, len(self.shapes[1]) == 2
        return len(self.offs) if a2 and b2 else self.shapes[1][0] if a2 else self.shapes[0][0]


class record_grouped_mm(TorchDispatchMode):
    """``with record_grouped_mm() as rec:`` keeps every ``aten._grouped_mm`` call in ``rec.calls``
    (reads the offsets on the host: for tests and tools/gpu_check.py, not for training)."""

    def __init__(self):
        super().__init__()
        self.calls: List[GroupedMMCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            names = ("offs", "bias", "out_dtype")
            extra = dict(zip(names, args[2:]))
            extra.update({k: v for k, v in kwargs.items() if k in names})
            a, b, offs = args[0], args[1], extra.get("offs")
            vals = None if offs is None else [int(x) for x in offs.tolist()]
            self.calls.append(GroupedMMCall(
                (tuple(a.shape), tuple(b.shape)), (a.stride(), b.stride()), (a.dtype, b.dtype), vals,
                check_grouped_mm(a, b, offs, extra.get("bias"), extra.get("out_dtype"), vals)))
        return func(*args, **kwargs)
