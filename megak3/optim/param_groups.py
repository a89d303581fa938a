"""Split model parameters between Muon and AdamW and build the combined optimizer (K3_SPEC.md §9.2).

Rules, by the parameter-name contract of docs/INTERFACES.md (first match wins):

=========================================================  =========  ============
parameter                                                  optimizer  weight decay
=========================================================  =========  ============
``embed_tokens.*``, ``lm_head.*``                          AdamW      yes
every param of an RMSNorm (class name contains 'RMSNorm'   AdamW      no
or name ends in ``norm.weight``: layernorms, o_norm, ...)
AttnRes pseudo-queries ``*_res.proj.weight`` [1, D]        AdamW      no
depthwise short convs ``*conv1d.weight`` [P, 1, W]         AdamW      no
``A_log``, ``dt_bias``, any other param with ndim < 2      AdamW      no
every other param with ndim >= 2 (router ``gate.weight``,  Muon       yes
experts [E, A, B] per expert, latent projections, vision
matrices; 4-D patch-embedding convs flattened to 2-D)
=========================================================  =========  ============

Per-head Muon: params listed by a module's ``per_head_params()`` get ``heads = H`` when
``cfg.per_head_muon``. Frozen params (``requires_grad=False``) are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import OptimConfig
from .muon import Muon
from .offload import host_adamw

ADAMW_DECAY_MODULES = ("embed_tokens", "lm_head")
"""name components whose params go to AdamW with weight decay (Moonlight keeps them off Muon)"""
NO_DECAY_LOCAL_NAMES = ("A_log", "dt_bias")
"""KDA decay parameters: AdamW without weight decay (FLA ``_no_weight_decay``)"""


@dataclass
class ParamSpec:
    """How one parameter is optimised."""

    name: str
    """full dotted name from ``model.named_parameters()``"""
    param: nn.Parameter
    """the parameter itself"""
    optimizer: str
    """'muon' or 'adamw'"""
    weight_decay: bool
    """whether decoupled weight decay λ applies"""
    heads: int | None
    """Muon only: number of heads for Per-Head Muon, None for whole-matrix / per-expert"""

    @property
    def rule(self) -> str:
        """Logging label: muon_per_head | muon_experts | muon_matrix | adamw_decay | adamw_no_decay."""
        if self.optimizer == "adamw":
            return "adamw_decay" if self.weight_decay else "adamw_no_decay"
        if self.heads is not None:
            return "muon_per_head"
        return "muon_experts" if self.param.ndim == 3 else "muon_matrix"


def _is_rmsnorm(module: nn.Module, name: str) -> bool:
    return "RMSNorm" in type(module).__name__ or name.endswith("norm.weight")


def _classify_one(name: str, local: str, module: nn.Module, p: torch.Tensor) -> tuple[str, bool]:
    """(optimizer, weight_decay) for one parameter; see the module docstring table."""
    parts = name.split(".")
    if any(part in ADAMW_DECAY_MODULES for part in parts):
        return "adamw", True
    if _is_rmsnorm(module, name):
        return "adamw", False
    if name.endswith("_res.proj.weight"):  # AttnRes pseudo-query [1, D]: a vector, not a matrix
        return "adamw", False
    if local == "weight" and len(parts) >= 2 and parts[-2].endswith("conv1d"):
        return "adamw", False  # depthwise [P, 1, W]: one tiny filter per channel, vector-like
    if local in NO_DECAY_LOCAL_NAMES or p.ndim < 2:
        return "adamw", False
    return "muon", True


def classify_parameters(model: nn.Module, per_head_muon: bool = True) -> list[ParamSpec]:
    """One :class:`ParamSpec` per trainable parameter, in ``named_parameters()`` order."""
    owner: dict[int, tuple[str, nn.Module]] = {}
    heads_of: dict[int, int] = {}
    for mod_name, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            owner.setdefault(id(p), (local, module))
        if not hasattr(module, "per_head_params"):
            continue
        # per_head_params() names params relative to the module ("q_proj.weight"), recursively.
        below = dict(module.named_parameters())
        for rel, h in module.per_head_params().items():
            if rel not in below:
                raise ValueError(f"{mod_name or type(module).__name__}.per_head_params() names "
                                 f"{rel!r}, which is not one of its parameters")
            heads_of[id(below[rel])] = int(h)
    specs = []
    for name, p in model.named_parameters():  # deduplicates tied parameters
        if not p.requires_grad:
            continue
        local, module = owner[id(p)]
        opt, wd = _classify_one(name, local, module, p)
        heads = heads_of.get(id(p)) if (opt == "muon" and per_head_muon) else None
        specs.append(ParamSpec(name, p, opt, wd, heads))
    return specs


class MuonWithAdamW:
    """One optimizer object over a :class:`Muon` and a ``torch.optim.AdamW`` (either may be None;
    under ``optim.offload=cpu`` the AdamW is its host-memory twin, megak3/optim/offload.py).

    ``param_groups`` concatenates both optimizers' group dicts (the same objects), so setting
    ``group['lr']`` (e.g. :func:`megak3.optim.set_lr`) drives both.
    """

    def __init__(self, muon: Muon | None, adamw: torch.optim.Optimizer | None, specs: list[ParamSpec]):
        self.muon, self.adamw = muon, adamw
        self.specs = specs

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": None if self.muon is None else self.muon.state_dict(),
                "adamw": None if self.adamw is None else self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if (opt is None) != (state.get(key) is None):
                raise ValueError(f"optimizer state and this optimizer disagree on whether a {key} part "
                                 f"exists (the model's parameter split changed since the save)")
            if opt is not None:
                opt.load_state_dict(state[key])

    def summary(self) -> dict[str, int]:
        """``{rule: tensor count, rule + '_numel': element count}`` for each rule in use."""
        out: dict[str, int] = {}
        for s in self.specs:
            out[s.rule] = out.get(s.rule, 0) + 1
            out[s.rule + "_numel"] = out.get(s.rule + "_numel", 0) + s.param.numel()
        return out


_FUSED_DEVICES = ("cpu", "cuda")
"""devices where ``torch.optim.AdamW(fused=True)`` runs (and reads ``found_inf`` without a host sync)"""


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> MuonWithAdamW:
    """Muon + AdamW over ``model``'s trainable params with one lr η and one λ (Moonlight)."""
    cfg.validate()
    specs = classify_parameters(model, cfg.per_head_muon)
    muon_groups, adam_groups = [], []
    for wd in (True, False):
        mu = [s for s in specs if s.optimizer == "muon" and s.weight_decay == wd]
        ad = [s for s in specs if s.optimizer == "adamw" and s.weight_decay == wd]
        decay = cfg.weight_decay if wd else 0.0
        if mu:
            muon_groups.append({"params": [s.param for s in mu], "heads": [s.heads for s in mu],
                                "weight_decay": decay})
        if ad:
            adam_groups.append({"params": [s.param for s in ad], "weight_decay": decay})
    muon = Muon(muon_groups, lr=cfg.lr, momentum=cfg.muon_momentum, nesterov=cfg.nesterov,
                ns_steps=cfg.ns_steps, ns_dtype=cfg.ns_dtype) if muon_groups else None
    # fused: one kernel per step, and it honours ``found_inf`` on the device (the non-finite skip of
    # megak3/train/step.py); equal to the foreach form up to fp32 rounding (tests/test_optim.py)
    fused = bool(adam_groups) and all(p.device.type in _FUSED_DEVICES and p.dtype.is_floating_point
                                      for g in adam_groups for p in g["params"])
    adamw = torch.optim.AdamW(adam_groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                              eps=cfg.adam_eps, fused=fused or None) if adam_groups else None
    if adamw is not None and cfg.offload == "cpu":  # same groups, state and update in host memory
        adamw = host_adamw(adamw, cfg.offload_impl)
    return MuonWithAdamW(muon, adamw, specs)
