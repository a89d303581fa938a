"""The hardware table of the planner (conf/hardware/<name>.yaml; sources in each file).

Peak FLOP/s are dense (no sparsity) tensor-core figures; bandwidths are per GPU and per direction.
``mfu`` is the fraction of peak a well-tuned step reaches (used for compute time), not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import CONF_DIR


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float
    """dense BF16 FLOP/s"""
    fp32_flops: float
    """FP32 (TF32 tensor core on GPUs) FLOP/s"""
    memory_bytes: float
    hbm_bw: float
    """device memory bandwidth, bytes/s"""
    nvlink_bw: float
    """intra-node bandwidth per GPU per direction, bytes/s"""
    net_bw: float
    """inter-node network bandwidth per GPU per direction, bytes/s"""
    pcie_bw: float = 50.0e9
    """host<->device copy bandwidth per GPU per direction, bytes/s (optim.offload=cpu's copies)"""
    host_mem_bw: float = 60.0e9
    """host memory bandwidth one GPU's share of the host CPUs gets, bytes/s (the host AdamW update)"""
    gpus_per_node: int = 8
    mfu: float = 0.4
    usable_memory_fraction: float = 0.9
    """of memory_bytes: the rest is CUDA context, NCCL buffers, allocator fragmentation"""

    def peak_flops(self, precision: str) -> float:
        return self.bf16_flops if precision == "bf16" else self.fp32_flops


def hardware_names() -> list:
    return sorted(p.stem for p in (Path(CONF_DIR) / "hardware").glob("*.yaml"))


def load_hardware(name: str) -> Hardware:
    from omegaconf import OmegaConf

    path = Path(CONF_DIR) / "hardware" / f"{name.lower()}.yaml"
    if not path.exists():
        raise ValueError(f"gpu={name!r}: no conf/hardware/{name.lower()}.yaml; choose one of "
                         f"{', '.join(hardware_names())}")
    d = OmegaConf.to_container(OmegaConf.load(path))
    return Hardware(**{k: (float(v) if isinstance(v, (int, float)) and k not in ("gpus_per_node", "name") else v)
                       for k, v in d.items()})
