"""AdamW with its state in host memory (``optim.offload=cpu``): ZeRO-Offload for the AdamW groups.

Each step copies the gradients and weights of the AdamW params to host buffers, runs the AdamW
update there and copies the weights back. ``exp_avg``, ``exp_avg_sq`` and ``step`` live only in
host memory, pinned when the params are on CUDA. Muon stays on the device (megak3/optim/param_groups.py).

Two kernels, one state format:

- :class:`HostAdamW`: torch's own fused AdamW (``torch.optim.adam.adam(fused=True)`` with
  decoupled weight decay, torch's CPU kernel) on the host tensors. This is the reference twin: it is
  bitwise ``torch.optim.AdamW(fused=True)`` on CPU params.
- :class:`DeepSpeedHostAdamW`: DeepSpeed's vectorised CPU Adam kernel (``deepspeed.ops.adam``,
  adamw_mode, OpenMP over ``torch.get_num_threads()`` threads), JIT-built on first use into
  ``~/.cache/torch_extensions``. It differs from the twin by fp32 rounding (its bias corrections are
  computed in fp32), measured by tests/test_offload.py.

The state of a param is ``{"step": 0-dim float32 tensor, "exp_avg", "exp_avg_sq": fp32 tensors of
its shape}``: torch AdamW's keys, so a ``state_dict`` or checkpoint moves between the two kernels and
to or from the non-offloaded AdamW.

The params this optimizer holds are fp32 (the model's params in fp32 runs, the ZeRO-1 main copies
of parallel/data_parallel/ otherwise), so the device tensor stays the weight of record. Its host
copy is refreshed every step, which costs one device-to-host copy of the weights more than keeping
a host-resident master, but a write to the param from outside (a checkpoint load, the ZeRO-1
all-gather) can never be overwritten by a stale host copy. CPU params are updated in place, with
no copy.

Non-finite steps: when ``found_inf`` (a 0-dim tensor, torch's GradScaler protocol, set by
megak3/train/step.py) is nonzero, :meth:`HostAdamW.step` changes nothing: no param, state or step count.
"""
from __future__ import annotations

import functools
import warnings
from collections import defaultdict

import torch
from torch.optim.adam import adam as torch_adam

from .config import DEEPSPEED_INSTALL, OFFLOAD_IMPLS


def _host_value(key: str, v, pin: bool):
    """One state entry in host memory: ``step`` as a fresh 0-dim float32 CPU tensor (it may arrive
    as a device tensor from a fused AdamW, or as an int), the moments as fp32 CPU tensors."""
    if key == "step":
        return torch.tensor(float(v), dtype=torch.float32)
    if not torch.is_tensor(v):
        return v
    if v.device.type == "cpu" and v.dtype == torch.float32 and (v.is_pinned() or not pin):
        return v
    out = torch.empty(v.shape, dtype=torch.float32, pin_memory=pin)
    out.copy_(v)
    return out


class _HostState(defaultdict):
    """``Optimizer.state`` that moves an entry to host memory when it is set, so a loader that
    writes ``opt.state[p] = {...}`` with device tensors (TrainCheckpoint's optimizer load) leaves at
    most one param's state on the device at a time."""

    def __init__(self, pin: bool, items=()):
        super().__init__(dict)
        self.pin = pin
        for p, st in items:
            self[p] = st

    def __setitem__(self, p, st):
        for k in list(st):  # in place: defaultdict.__missing__ returns the dict it stored
            st[k] = _host_value(k, st[k], self.pin)
        super().__setitem__(p, st)


class HostAdamW(torch.optim.Optimizer):
    """AdamW whose state lives in host memory; the pure-torch kernel (see the module docstring).

    Args:
        params: params or param groups; those stepped must be fp32 (groups may carry every hyperparameter, so
            ``type(opt)(groups)`` rebuilds it, as ZeRO-1 does).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        host_copy: step on host copies of the weights and gradients; default: only for params that
            are not on the CPU (tests set True to run the copy path on CPU).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, host_copy: bool | None = None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.host_copy = host_copy
        self._pin = any(p.is_cuda for g in self.param_groups for p in g["params"])
        self._buffers: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        """param -> (host weights, host gradient) of the params stepped on copies"""
        self.state = _HostState(self._pin)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.state = _HostState(getattr(self, "_pin", False), self.state.items())

    def load_state_dict(self, state_dict: dict) -> None:
        """``torch.optim.Optimizer.load_state_dict`` semantics (the saved group hyperparameters
        win), but the state is copied straight to host memory instead of onto the params' device."""
        super().load_state_dict({**state_dict, "state": {}})
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        mine = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved, mine):
            st = state_dict["state"].get(i)
            if st:  # fresh tensors: stepping must never write into the caller's state_dict
                self.state[p] = {k: v.detach().clone() if torch.is_tensor(v) and v.ndim > 0 else v
                                 for k, v in st.items()}

    def _copies(self, p: torch.Tensor) -> bool:
        if self.host_copy is not None:
            return self.host_copy
        return p.device.type != "cpu" or not (p.is_contiguous() and p.grad.is_contiguous())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):  # non-finite gradients: change nothing
            return loss
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            copied = [p for p in params if self._copies(p)]
            on_copy = {id(p) for p in copied}
            for p in copied:  # device -> host: weights (the device param is the weight of record), grads
                if p not in self._buffers:
                    self._buffers[p] = (torch.empty(p.shape, dtype=torch.float32, pin_memory=self._pin),
                                        torch.empty(p.shape, dtype=torch.float32, pin_memory=self._pin))
                w, g = self._buffers[p]
                w.copy_(p, non_blocking=self._pin)
                g.copy_(p.grad, non_blocking=self._pin)
            self._wait(copied)
            weights, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in params:
                st = self.state[p]
                if not st:
                    if p.dtype != torch.float32:  # a host copy would round the update to p's dtype
                        raise ValueError(f"optim.offload=cpu steps fp32 params (the fp32 model or its ZeRO-1 "
                                         f"main copies), got {p.dtype} of shape {tuple(p.shape)}")
                    self.state[p] = st = {"step": 0, "exp_avg": torch.zeros(p.shape, pin_memory=self._pin),
                                          "exp_avg_sq": torch.zeros(p.shape, pin_memory=self._pin)}
                w, g = self._buffers[p] if id(p) in on_copy else (p, p.grad)
                weights.append(w)
                grads.append(g)
                exp_avgs.append(st["exp_avg"])
                exp_avg_sqs.append(st["exp_avg_sq"])
                steps.append(st["step"])
            self._update(group, weights, grads, exp_avgs, exp_avg_sqs, steps)
            for p in copied:  # host -> device (ordered before any later use of p on its stream)
                p.copy_(self._buffers[p][0], non_blocking=self._pin)
        return loss

    @staticmethod
    def _wait(copied: list[torch.Tensor]) -> None:
        """Block until the non-blocking device-to-host copies of ``copied`` have landed."""
        for dev in {p.device for p in copied if p.is_cuda}:
            torch.cuda.current_stream(dev).synchronize()

    def _update(self, group: dict, weights, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        """One AdamW step over host tensors (``steps``: 0-dim float32 tensors, incremented here)."""
        beta1, beta2 = group["betas"]
        torch_adam(weights, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, decoupled_weight_decay=True,
                   amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                   eps=group["eps"], maximize=False)


STALE_BUILD_LOCK_S = 1800.0
"""a JIT-build lock older than this with no build running is a leftover of a killed build"""


def _clear_stale_build_lock(name: str) -> None:
    """torch's JIT build holds ``<extension dir>/lock`` while it compiles and never expires it: a
    build killed half-way (Ctrl-C, a timeout) leaves every later load waiting forever. A lock older
    than STALE_BUILD_LOCK_S (the CPU Adam build takes minutes, not half an hour) is removed, with a
    warning."""
    import os
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_BUILD_LOCK_S:
        warnings.warn(f"removing {lock}: a JIT build lock {age / 60:.0f} min old (a build was killed half-way); "
                      "building again")
        try:
            os.remove(lock)
        except OSError:
            pass


@functools.cache
def deepspeed_cpu_adam():
    """DeepSpeed's ``cpu_adam`` op (JIT-built the first time, then loaded from the torch extension
    cache); raises ImportError / RuntimeError when DeepSpeed is absent or the build fails. A stale
    build lock left by a killed build is cleared first (:func:`_clear_stale_build_lock`)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    _clear_stale_build_lock(builder.name)
    return builder.load()


class DeepSpeedHostAdamW(HostAdamW):
    """:class:`HostAdamW` with DeepSpeed's CPU Adam kernel (adamw_mode) as the update."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, host_copy: bool | None = None):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        super().__init__(params, lr, betas, eps, weight_decay, host_copy=host_copy)
        self._kernel = deepspeed_cpu_adam()
        # ids come from DeepSpeedCPUAdam's counter: the op keeps one C++ optimizer per id per process
        self._opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
        self._kernel.create_adam(self._opt_id, lr, betas[0], betas[1], eps, weight_decay, True, False)

    def __del__(self):
        if hasattr(self, "_opt_id"):
            self._kernel.destroy_adam(self._opt_id)

    def _update(self, group: dict, weights, grads, exp_avgs, exp_avg_sqs, steps) -> None:
        beta1, beta2 = group["betas"]
        for w, g, m, v, s in zip(weights, grads, exp_avgs, exp_avg_sqs, steps):
            s += 1
            self._kernel.adam_update(self._opt_id, int(s), float(group["lr"]), beta1, beta2, group["eps"],
                                     group["weight_decay"], True, w, g, m, v)


def host_adamw(adamw: torch.optim.Optimizer, impl: str = "auto") -> HostAdamW:
    """The offloaded twin of a freshly built ``adamw`` (same params and group hyperparameters).

    ``impl`` (``optim.offload_impl``): 'deepspeed' (a load failure is a ValueError naming the field),
    'torch', or 'auto' (deepspeed when it loads, else torch with one warning).
    """
    if impl not in OFFLOAD_IMPLS:
        raise ValueError(f"optim.offload_impl={impl!r} must be one of {OFFLOAD_IMPLS}")
    keys = ("params", "lr", "betas", "eps", "weight_decay")
    groups = [{k: g[k] for k in keys} for g in adamw.param_groups]
    if impl == "torch":
        return HostAdamW(groups)
    try:
        return DeepSpeedHostAdamW(groups)
    except Exception as e:  # noqa: BLE001 -- ImportError, or the JIT build failing (no compiler, ...)
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if impl == "deepspeed":
            raise ValueError(f"optim.offload_impl='deepspeed': DeepSpeed's CPU Adam did not load ({why}); "
                             f"install it with {DEEPSPEED_INSTALL}, or set optim.offload_impl=torch") from e
        warnings.warn(f"optim.offload_impl=auto: DeepSpeed's CPU Adam did not load ({why}); "
                      "using torch's fused AdamW on the host", stacklevel=2)
        return HostAdamW(groups)
