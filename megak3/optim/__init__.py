"""K3 optimizer: Muon (Moonlight update, Per-Head Muon) + AdamW (optionally offloaded to host
memory), and LR schedules (K3_SPEC.md §9)."""
from .config import OptimConfig
from .muon import Muon, muon_blocks, muon_scale, zeropower_via_newtonschulz5
from .offload import DeepSpeedHostAdamW, HostAdamW, host_adamw
from .param_groups import MuonWithAdamW, ParamSpec, build_optimizer, classify_parameters
from .schedule import lr_at, set_lr

__all__ = [
    "OptimConfig", "Muon", "muon_blocks", "muon_scale", "zeropower_via_newtonschulz5",
    "MuonWithAdamW", "ParamSpec", "build_optimizer", "classify_parameters", "lr_at", "set_lr",
    "HostAdamW", "DeepSpeedHostAdamW", "host_adamw",
]
