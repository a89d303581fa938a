"""The planner's optim.offload=cpu figures (megak3/launch/planner/memory.py offload_figures) against what
megak3/optim/offload.py really holds and moves: host bytes per owned AdamW element (measured from
HostAdamW's state and host buffers after a step on the copy path) and bytes copied between device
and host per step (counted by a dispatch spy over the step's copies); the plan's memory and step
time move by exactly those terms."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megak3.config import load_model_config
from megak3.launch import planner as P
from megak3.launch.hardware import load_hardware
from megak3.model.k3 import build_model
from megak3.optim import OptimConfig
from tests.conftest import SMALL_MODEL


class _CopyBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.bytes += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def test_offload_host_bytes_and_copies_match_hostadamw():
    from parallel.data_parallel import ShardedOptimizer

    cfg = load_model_config("k3_tiny", **SMALL_MODEL)
    model = build_model(cfg)
    opt = ShardedOptimizer(model, OptimConfig(offload="cpu", offload_impl="torch"))
    host = opt.adamw
    host.host_copy = True                      # the copy path a GPU run takes (no GPU here)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.reduce_gradients()
    spy = _CopyBytes()
    with spy:
        host.step()
    numel = sum(p.numel() for g in host.param_groups for p in g["params"])
    planned = P.per_rank_figures(cfg, P.PlanConfig(world_size=1, offload="cpu", precision="fp32"))
    assert planned["owned_adamw_params"] == numel
    state = sum(t.numel() * t.element_size() for st in host.state.values() for t in st.values()
                if torch.is_tensor(t) and t.ndim > 0)
    buffers = sum(t.numel() * t.element_size() for pair in host._buffers.values() for t in pair)
    assert planned["optimizer_state_host"] == state
    assert planned["host_bytes"] == state + buffers == P.OFFLOAD_HOST_BYTES_PER_ELEM * numel
    assert planned["pcie_bytes_per_step"] == spy.bytes == P.OFFLOAD_PCIE_BYTES_PER_ELEM * numel
    assert planned["optimizer_state_device_bytes"] == planned["optimizer_state_bytes"] - state


def test_plan_with_offload_moves_exactly_the_adamw_terms():
    cfg = load_model_config("k3_full")
    hw = load_hardware("h200")
    base = dict(tp=8, pp=4, ep=128, world_size=2048)
    off = P.make_plan(cfg, P.PlanConfig(**base, offload="cpu"), hw)
    on = P.make_plan(cfg, P.PlanConfig(**base), hw)
    assert "host_bytes" not in on["memory"] and "offload_s" not in on["time"]      # default plans unchanged
    for s_off, s_on in zip(off["stages"], on["stages"]):
        n = s_off["adamw_owned_numel"]
        assert n > 0
        assert s_off["optimizer_state"] == pytest.approx(s_on["optimizer_state"] - 8 * n, rel=1e-12)
        assert s_off["total"] == pytest.approx(s_on["total"] - 8 * n, rel=1e-12)
        assert s_off["host_bytes"] == 16 * n
    t_off = off["stages"][off["comm_stage"]]
    dt = t_off["pcie_bytes_per_step"] / hw.pcie_bw + t_off["host_update_bytes_per_step"] / hw.host_mem_bw
    assert off["time"]["offload_s"] == pytest.approx(dt, rel=1e-12)
    assert "optim.offload=cpu" in off["trainer_overrides"] and off["layout"]["offload"] == "cpu"


def test_plan_offload_rejects_unknown_value():
    with pytest.raises(ValueError, match="optim.offload"):
        P.make_plan(load_model_config("k3_tiny"), P.PlanConfig(offload="nvme"), load_hardware("h200"))
