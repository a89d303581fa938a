"""FP8 GEMMs for the dense linears: Transformer Engine on a GPU, or an MXFP8 emulation anywhere.

Which linears (``dense_linear_names``): every ``nn.Linear`` inside ``model.layers`` (attention
projections, the dense layer-0 FFN, shared experts, latent down/up projections) whose
``in_features`` is a multiple of 32 (one MX block) and ``out_features`` a multiple of 16 (FP8 GEMM
alignment). Never: the router (K3 keeps it fp32), the AttnRes pseudo-queries (a vector, not a GEMM),
the routed experts (MXFP4 QAT, megak3/quant/qat.py), embeddings, lm_head, the vision tower. Small
misaligned projections (KDA ``b_proj`` [H, D]) stay in high precision.

* ``fp8="te"``: each such linear becomes ``transformer_engine.pytorch.Linear`` (weights copied; the
  module keeps its name, so optimizer groups by name still apply; build the optimizer AFTER this).
  Run forward passes inside ``fp8_autocast_context(qcfg)``; its recipe follows the GPU, the CUDA
  version and the TE version (``te_recipe_name``): Float8BlockScaling on Hopper (sm90) with
  CUDA >= 12.9 and TE >= 2.3, MXFP8BlockScaling on sm100/sm110, Float8CurrentScaling otherwise
  (sm89 Ada, sm120, an older Hopper stack). These recipes keep no state between steps, so checkpoints carry no TE
  ``_extra_state``; a TE with only DelayedScaling (amax history) is refused (``_te_recipe``).
* ``fp8="emulate"``: each such linear becomes ``MXFP8Linear`` (same Parameter object, same state
  dict) computing ``F.linear(fq8(x), fq8(W))`` with MXFP8 (E4M3, blocks of 32 along the input dim)
  and a straight-through gradient, so the plumbing and its numerics are testable on CPU.
"""
from __future__ import annotations

import contextlib
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from .config import QuantConfig
from .mx import fake_quant

TE_MISSING = "quant.fp8=te needs Transformer Engine and a CUDA GPU; use quant.fp8=emulate on CPU"
_NOT_GEMMS = ("attn_res.proj", "mlp_res.proj", "mlp.gate")   # read .weight directly / kept fp32


class MXFP8Linear(nn.Linear):
    """nn.Linear whose input and weight are fake-quantized to MXFP8 (E4M3 + E8M0 per 32 along in)."""

    scale_mode: str = "floor"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = fake_quant(self.weight, "fp8_e4m3", 32, self.scale_mode)
        return F.linear(fake_quant(x, "fp8_e4m3", 32, self.scale_mode), w, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mxfp8_emulated, scale_mode={self.scale_mode}"


def dense_linear_names(model: nn.Module) -> List[str]:
    """Qualified names of the linears that ``apply_fp8`` converts (see the module docstring)."""
    names = []
    for name, mod in model.named_modules():
        if not name.startswith("layers.") or not isinstance(mod, nn.Linear) or name.endswith(_NOT_GEMMS):
            continue
        if mod.in_features % 32 == 0 and mod.out_features % 16 == 0:
            names.append(name)
    return names


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def te_available() -> bool:
    """True when transformer_engine.pytorch imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken build raising at import
        return False
    return True


def apply_fp8(model: nn.Module, qcfg: QuantConfig) -> List[str]:
    """Convert the dense linears for ``qcfg.fp8``; returns the converted names.

    ``fp8="none"`` turns emulated linears back into plain ``nn.Linear`` (TE modules are left alone).
    """
    qcfg.validate()
    names = dense_linear_names(model)
    if qcfg.fp8 == "te":
        if not te_available():
            raise ValueError(TE_MISSING)
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ValueError(f"quant.fp8=te needs an FP8 GPU (sm89+), this one is sm{major}{minor}; "
                             "use quant.fp8=emulate or quant.fp8=none")
        _te_recipe()   # refuses a TE whose only recipe is stateful, before any module is swapped
        import transformer_engine.pytorch as te

        for name in names:
            lin = model.get_submodule(name)
            new = te.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                            params_dtype=lin.weight.dtype, device=lin.weight.device)
            with torch.no_grad():
                new.weight.copy_(lin.weight)
                if lin.bias is not None:
                    new.bias.copy_(lin.bias)
            _swap(model, name, new)
        return names
    cls = MXFP8Linear if qcfg.fp8 == "emulate" else nn.Linear
    for name in names:
        lin = model.get_submodule(name)
        # Built on the meta device (no init work), then given the very same Parameters: the state
        # dict, the optimizer's references and the weights are untouched.
        new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        new.weight, new.bias = lin.weight, lin.bias
        if cls is MXFP8Linear:
            new.scale_mode = qcfg.scale_mode
        _swap(model, name, new)
    return names


TE_STATEFUL = ("quant.fp8=te needs a Transformer Engine with current or block scaling recipes "
               "(Float8CurrentScaling and MXFP8BlockScaling, in TE >= 2.2; Float8BlockScaling from 2.3); this one has "
               "only DelayedScaling, whose amax history megak3 checkpoints do not carry: upgrade "
               "transformer_engine or use quant.fp8=emulate")


def _version(v) -> tuple:
    """(major, minor) of a version string such as '2.3.0+abc' or '12.9'; (0, 0) when unknown."""
    try:
        parts = str(v).split("+")[0].split(".")
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except (TypeError, ValueError, IndexError):
        return 0, 0


def _te_version() -> str | None:
    """The installed Transformer Engine's version string, or None."""
    try:
        import transformer_engine

        v = getattr(transformer_engine, "__version__", None)
        if v:
            return v
    except Exception:  # noqa: BLE001 - not installed or broken: the metadata may still say
        pass
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def te_recipe_name(capability: tuple, cuda: str | None, te_version: str | None, available) -> str:
    """The recipe for a GPU of compute ``capability`` (major, minor) with CUDA ``cuda`` (torch's
    ``torch.version.cuda``) and Transformer Engine ``te_version``; ``available``: the recipe class
    names the TE has. Each choice within what TE's ``check_recipe_support`` accepts:

    * sm90 (Hopper): Float8BlockScaling when TE >= 2.3 (it appeared then), CUDA >= 12.9 (TE:
      "FP8 block scaled GEMM requires Hopper and CUDA >= 12.9") and the class is there;
    * sm100 / sm110 (Blackwell datacenter): MXFP8BlockScaling when the class is there;
    * sm120+ (Blackwell consumer): never MXFP8 (TE: "MXFP8 (for all gemm layouts) is not
      supported on 12.0+ architectures yet"), never block scaling;
    * otherwise, and as the fallback of the above: Float8CurrentScaling.

    Raises ValueError(TE_STATEFUL) when the choice and Float8CurrentScaling are both absent."""
    major = capability[0]
    if major == 9 and _version(te_version) >= (2, 3) and _version(cuda) >= (12, 9) \
            and "Float8BlockScaling" in available:
        return "Float8BlockScaling"
    if major in (10, 11) and "MXFP8BlockScaling" in available:
        return "MXFP8BlockScaling"
    if "Float8CurrentScaling" in available:
        return "Float8CurrentScaling"
    raise ValueError(TE_STATEFUL)


def _te_recipe(R=None, major: int | None = None, minor: int | None = None, cuda: str | None = None,
               te_version: str | None = None):
    """The TE recipe for this GPU (:func:`te_recipe_name`). All recipes chosen take each tensor's
    scales from the tensor being cast, so a TE linear carries nothing from one step to the next and
    a checkpoint needs no TE ``_extra_state`` (megak3 checkpoints hold parameters, buffers and
    optimizer state only). DelayedScaling would (an amax history) and is refused:
    ``ValueError(TE_STATEFUL)``. ``R`` (the recipe module), ``major`` / ``minor`` (compute
    capability), ``cuda`` and ``te_version``: injected by tests; each one not given is queried
    (``torch.cuda.get_device_capability()``, ``torch.version.cuda``, the installed TE)."""
    if R is None:
        from transformer_engine.common import recipe as R
    if major is None:
        major, minor = torch.cuda.get_device_capability()
    if cuda is None:
        cuda = torch.version.cuda
    if te_version is None:
        te_version = _te_version()
    names = [n for n in ("Float8BlockScaling", "MXFP8BlockScaling", "Float8CurrentScaling") if hasattr(R, n)]
    return getattr(R, te_recipe_name((major, minor or 0), cuda, te_version, names))()


def fp8_autocast_context(qcfg: QuantConfig):
    """Context manager for forward passes: TE's FP8 autocast when ``qcfg.fp8 == "te"``, else a no-op."""
    qcfg.validate()
    if qcfg.fp8 != "te":
        return contextlib.nullcontext()
    if not te_available():
        raise ValueError(TE_MISSING)
    import transformer_engine.pytorch as te

    recipe = _te_recipe()
    if hasattr(te, "autocast"):          # TE >= 2.8 renamed fp8_autocast(fp8_recipe=) to autocast(recipe=)
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)
