"""RMSNorm as K3 uses it: y = w * (x_fp32 * rsqrt(mean(x^2) + eps)).to(dtype) (K3_SPEC.md §3).

:func:`rms_norm` is the reference form (every device, every dtype; also the weightless uses). The
learnable-weight :class:`RMSNorm` runs NVIDIA apex's fused affine RMSNorm instead (apex's
``fused_rms_norm_affine``: one CUDA kernel forward, one backward giving both gradients) when
:func:`uses_apex` says so, which needs all of:

* ``RMSNorm.impl`` is 'auto' or 'apex' (``model.norm_impl``; :func:`set_norm_impl` sets it on every
  RMSNorm of a model), not 'torch';
* NVIDIA apex was built with its CUDA extensions (:func:`apex_rms_norm_fn`): PyPI's unrelated
  ``apex`` package and a Python-only apex build both count as absent;
* x is a CUDA tensor (:func:`_on_cuda`);
* x and the weight share one of fp32 / bf16 / fp16. apex's kernel reads the weight in the output's
  dtype and pairs a bf16 or fp16 input only with a weight of the same dtype (csrc/type_shim.h), while
  the twin's bf16 x times an fp32 weight gives an fp32 result; that case (e.g. the MLA latent norms
  under bf16 autocast with fp32 master weights) stays on the twin. fp64 stays on the twin too (the
  twin computes in fp32, apex would in fp64).

Rounding (apex csrc/layer_norm_cuda_kernel.cu, ``cuApplyLayerNorm_`` with ``rms_only``): apex
computes ``invvar = rsqrt(sum(x^2) / n + eps)`` in fp32, rounds ``x * invvar`` to x's dtype and
multiplies by the weight in that dtype -- the twin's order of operations. Only the summation order
of ``sum(x^2)`` differs, so fp32 outputs agree to a few fp32 ulps, and bf16 outputs are equal except
where that changes a rounding (one bf16 ulp). The backward computes both gradients in fp32 from the
saved input and rounds once, where the twin's autograd rounds intermediates in x's dtype: bf16
gradients agree within bf16 rounding, not bitwise. tools/gpu_check.py part ``apex_rms_norm``
measures both against tolerances.

apex's ``memory_efficient`` flag stays off (its default): it saves the output instead of the input,
and the backward recovers x by dividing by the weight, which changes the gradients' rounding; it
saves memory only where the consumer keeps that very output tensor, which under bf16 autocast it
does not (the next linear keeps its own bf16 copy).
"""
from __future__ import annotations

import functools
import importlib

import torch
from torch import nn

from ..config import norm_impl_value_error

APEX_MISSING = ("model.norm_impl=apex: NVIDIA apex with its CUDA extensions is not importable here "
                "(needs apex.normalization and fused_layer_norm_cuda; PyPI's 'apex' is unrelated); build it "
                "from github.com/NVIDIA/apex (APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install --no-build-isolation .) "
                "or set model.norm_impl=auto")

_APEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Functional RMSNorm over the last dim; statistics in fp32, result in x's dtype."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else y * weight


@functools.lru_cache(maxsize=None)
def apex_rms_norm_fn():
    """apex's ``fused_rms_norm_affine(x, weight, normalized_shape, eps)`` when NVIDIA apex imports
    with its compiled ``fused_layer_norm_cuda`` extension, else None. One attempt per process (cached);
    only called for CUDA inputs or ``model.norm_impl=apex``, so CPU runs never import apex."""
    try:
        # PyPI's 'apex' has no apex.normalization; a Python-only NVIDIA build has no fused_layer_norm_cuda
        from apex.normalization import fused_layer_norm
        importlib.import_module("fused_layer_norm_cuda")
        fn = fused_layer_norm.fused_rms_norm_affine
    except Exception:  # noqa: BLE001 - ImportError, or an unrelated/broken package raising anything at import
        return None
    return fn if callable(fn) else None


def norm_impl_error(impl: str) -> str | None:
    """Why ``impl`` cannot be used here (one line naming ``model.norm_impl`` and the fix), or None:
    a value that is not one of megak3.config.NORM_IMPLS (the config's own check), or 'apex' when
    apex is not built (checked where the job runs: megak3/job/compose.py check_local, set_norm_impl)."""
    return norm_impl_value_error(impl) or (APEX_MISSING if impl == "apex" and apex_rms_norm_fn() is None else None)


def _on_cuda(x: torch.Tensor) -> bool:
    """The device condition of the fused path (one function, so a CPU test can stand in for CUDA)."""
    return x.is_cuda


def uses_apex(x: torch.Tensor, weight: torch.Tensor, impl: str) -> bool:
    """Whether :class:`RMSNorm` runs apex's fused kernel for this input (see the module docstring)."""
    # an empty x (no tokens on this rank) stays on the twin: apex would launch a grid of 0 blocks
    return (impl != "torch" and _on_cuda(x) and x.dtype == weight.dtype and x.dtype in _APEX_DTYPES
            and x.numel() > 0 and apex_rms_norm_fn() is not None)


class RMSNorm(nn.Module):
    """Learnable-weight RMSNorm (weight initialised to 1); ``impl`` as ``model.norm_impl``."""

    def __init__(self, dim: int, eps: float = 1e-5, impl: str = "auto"):
        super().__init__()
        self.eps = eps
        self.impl = impl
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_apex(x, self.weight, self.impl):
            # apex's wrapper casts x and w to the autocast dtype when autocast is on; off, they keep
            # their dtypes and the result has the twin's dtype (fp32 residual in, fp32 out)
            with torch.autocast(x.device.type, enabled=False):
                return apex_rms_norm_fn()(x, self.weight, self.weight.shape, self.eps)
        return rms_norm(x, self.weight, self.eps)

    def init_param(self, name, param, gen, std) -> bool:
        param.data.fill_(1.0)
        return True

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + ("" if self.impl == "auto" else f", impl={self.impl}")


def set_norm_impl(model: nn.Module, impl: str) -> int:
    """Set ``impl`` ('auto', 'torch' or 'apex') on every :class:`RMSNorm` inside ``model``; returns
    how many. ValueError (:func:`norm_impl_error`) for an unusable choice."""
    err = norm_impl_error(impl)
    if err:
        raise ValueError(err)
    n = 0
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.impl = impl
            n += 1
    return n
