"""Which device does every tensor handed to a collective live on? A CPU-testable NCCL check.

NCCL only accepts CUDA tensors, but the tests run gloo on CPU, where a CPU tensor handed to a
collective is exactly right. The bug class that breaks GPU runs is a tensor created WITHOUT an
explicit device (``torch.tensor([x])``, ``torch.zeros(n)``): on CPU it silently matches the training
device, on GPU it is a CPU tensor next to CUDA ones. :func:`check_collective_devices` makes that
class visible on CPU:

* it sets the default device to "meta" for its duration (what ``torch.set_default_device("meta")``
  does; the training device stays what it is), so every tensor made without an explicit device
  becomes a meta tensor instead of a CPU one. Exception, to match the real default: ``as_tensor`` /
  ``asarray`` / ``tensor`` of a tensor keep that tensor's device (they do not use the default);
* it wraps the ``torch.distributed`` collectives and point-to-point functions and records, for
  every tensor handed to them, (function, argument, device, dtype, shape, caller ``file:line``).

    with check_collective_devices(trainer.device) as chk:
        trainer.train_step()
    chk.assert_clean()      # AssertionError listing every tensor not on trainer.device

A meta tensor cannot be communicated (it has no data), so a collective that receives one raises
:class:`CollectiveDeviceError` (an AssertionError) at once, naming the call site; any other
wrong-device tensor is recorded and the real collective still runs. Model or optimizer code that
mixes a default-device tensor with tensors on the training device fails under the meta default with
a device-mismatch error: either it mixes CPU and CUDA tensors on GPU too, or it is host-side code
that relies on the default device being the CPU (index maps built on the host, then ``.to(device)``):
correct on GPU, but it must say ``device="cpu"`` to run under the check. A 0-dim CPU scalar mixed
with CUDA tensors (legal on GPU) fails here too: give such scalars an explicit device.

The check changes process-wide state (module attributes, the default device): use it in a test or
a rank of run_distributed, around code that creates no threads that outlive it.

Checked (tensors, tensor lists and ``P2POp.tensor``): all_reduce, all_gather, all_gather_into_tensor
(all_gather_single), reduce_scatter_tensor (reduce_scatter_single), reduce_scatter, broadcast,
all_to_all_single, all_to_all, send, recv, isend, irecv, batch_isend_irecv, gather, scatter, reduce,
and the coalesced / underscore variants (:data:`CHECKED`).

Not checked: the object collectives broadcast_object_list, gather_object, all_gather_object,
scatter_object_list, send_object_list, recv_object_list (they pickle on the CPU by design); they
are wrapped only so that the tensor collectives they call internally are not recorded. barrier and
monitored_barrier carry no user tensor.

Patching: the functions are replaced on the ``torch.distributed`` module, on
``torch.distributed.distributed_c10d`` (where ``P2POp`` validates its ``op`` and
``batch_isend_irecv`` dispatches), and on every loaded non-torch module that bound one of them by
name (``from torch.distributed import all_reduce``); everything is restored on exit, also on error.
Calls nested inside a wrapped function (an object collective's internal all_gather, the isend
calls of batch_isend_irecv) are not recorded a second time. Not reentrant (one check at a time).
"""
from __future__ import annotations

import inspect
import os
import sys
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._device import DeviceContext

__all__ = ["CHECKED", "UNCHECKED", "CollectiveDeviceError", "Record", "check_collective_devices"]

CHECKED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
           "reduce_scatter_single", "reduce_scatter", "broadcast", "all_to_all_single", "all_to_all", "send",
           "recv", "isend", "irecv", "batch_isend_irecv", "gather", "scatter", "reduce", "all_reduce_coalesced",
           "all_gather_coalesced", "_all_gather_base", "_reduce_scatter_base")
"""torch.distributed functions whose tensor arguments are recorded (those this torch lacks are skipped;
all_gather_single / reduce_scatter_single are torch 2.13's names of all_gather_into_tensor /
reduce_scatter_tensor)"""
UNCHECKED = ("broadcast_object_list", "gather_object", "all_gather_object", "scatter_object_list",
             "send_object_list", "recv_object_list")
"""object collectives: wrapped only to silence the tensor collectives they call inside"""

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)
_ROOT = os.path.dirname(os.path.dirname(_THIS)) + os.sep


class CollectiveDeviceError(AssertionError):
    """A collective received a tensor that cannot live on the training device (meta: created
    without an explicit device), or ``assert_clean`` found wrong-device tensors."""


@dataclass(frozen=True)
class Record:
    """One tensor handed to one collective."""

    fn: str
    """torch.distributed function name"""
    arg: str
    """argument, e.g. 'tensor', 'tensor_list[1]', 'p2p_op_list[0].tensor'"""
    device: str
    dtype: str
    shape: tuple
    where: str
    """the first caller frame outside torch and this file: 'path/file.py:123 (function)'"""

    def __str__(self) -> str:
        return (f"{self.where}: {self.fn}({self.arg}) got a {self.dtype} tensor {list(self.shape)} "
                f"on {self.device}")


def _caller() -> str:
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path != _THIS and not path.startswith(_TORCH_DIR):
            short = path[len(_ROOT):] if path.startswith(_ROOT) else os.path.basename(path)
            return f"{short}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _tensors(name: str, value):
    """(label, tensor) for a tensor, a list/tuple of tensors, a P2POp or a list of P2POps."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, c10d.P2POp):
        yield f"{name}.tensor", value.tensor
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(f"{name}[{i}]", v)


def _same_device(got: torch.device, want: torch.device) -> bool:
    return got.type == want.type and (want.index is None or got.index is None or got.index == want.index)


_INFER_FROM_DATA = {torch.as_tensor, torch.asarray, torch.tensor}


class _MetaDefault(DeviceContext):
    """``torch.set_default_device("meta")``, except where the real default device is not used:
    ``torch.as_tensor(t)`` / ``torch.asarray(t)`` / ``torch.tensor(t)`` of a TENSOR keep ``t``'s
    device under the default CPU default (DeviceContext would move them to meta)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INFER_FROM_DATA and kwargs.get("device") is None and args and isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


class _Wrapper:
    """Callable stand-in for one torch.distributed function; compares equal to the real one, so
    ``P2POp``'s ``op in [isend, irecv]`` check still accepts it."""

    def __init__(self, check: "check_collective_devices", name: str, real, record: bool):
        self._check, self._real, self._record = check, real, record
        self.__name__ = self.__qualname__ = name
        self.__doc__ = getattr(real, "__doc__", None)
        self.__wrapped__ = real
        try:
            self._params = list(inspect.signature(real).parameters)
        except (TypeError, ValueError):
            self._params = []

    def __eq__(self, other):
        return other is self or other is self._real

    def __hash__(self):
        return hash(self._real)

    def __call__(self, *args, **kwargs):
        local = self._check._local
        depth = getattr(local, "depth", 0)
        if depth == 0 and self._record:
            self._check._observe(self.__name__, self._params, args, kwargs)
        if self.__name__ == "batch_isend_irecv":
            # batch_isend_irecv tells sends from receives by `op.op is isend` (c10d's current global):
            # make each op that identity, whether it was built from the real function or the wrapper
            for op in (args[0] if args else kwargs.get("p2p_op_list", ())):
                for cur in (c10d.isend, c10d.irecv):
                    if getattr(op, "op", None) is not cur and cur == op.op:
                        op.op = cur
        local.depth = depth + 1
        try:
            return self._real(*args, **kwargs)
        finally:
            local.depth = depth


class check_collective_devices:
    """Context manager: record the device of every tensor handed to a torch.distributed collective
    and make tensors created without an explicit device meta tensors (see the module docstring).

    device: the training device every communicated tensor must live on (``trainer.device``); a
        device without an index ('cuda') matches any index.
    default_meta: set ``torch.set_default_device("meta")`` inside (default True).
    strict: raise on a clean exit when there are violations (default False: call ``assert_clean``).
    """

    def __init__(self, device, default_meta: bool = True, strict: bool = False):
        self.device = torch.device(device)
        self.default_meta, self.strict = default_meta, strict
        self.records: list[Record] = []
        self._local = threading.local()
        self._patched: list = []          # (module, attribute, original)
        self._prev_default: Optional[DeviceContext] = None
        self._meta_ctx: Optional[DeviceContext] = None
        self._meta_set = False
        self._active = False

    # ---- recording -------------------------------------------------------------------------------
    def _observe(self, fn: str, params: list, args: tuple, kwargs: dict) -> None:
        named = list(zip(params, args)) + [(f"arg{i}", a) for i, a in enumerate(args[len(params):], len(params))]
        named += list(kwargs.items())
        where = None
        for name, value in named:
            for label, t in _tensors(name, value):
                if where is None:
                    where = _caller()
                rec = Record(fn, label, str(t.device), str(t.dtype).replace("torch.", ""), tuple(t.shape), where)
                self.records.append(rec)
                if t.device.type == "meta" and self.device.type != "meta":
                    raise CollectiveDeviceError(
                        f"{rec}: a tensor created without an explicit device (meta under "
                        f"check_collective_devices) cannot be communicated; create it on {self.device} "
                        f"(device=...) or derive it from a tensor on that device"
                        + self._listing(self.violations()[:-1], "earlier violations"))

    def violations(self) -> list[Record]:
        """Every recorded tensor whose device is not ``device``."""
        return [r for r in self.records if not _same_device(torch.device(r.device), self.device)]

    @staticmethod
    def _listing(records, title) -> str:
        if not records:
            return ""
        return f"\n{title} ({len(records)}):\n" + "\n".join(f"  {r}" for r in records)

    def report(self) -> str:
        """Distinct violations (same call site, function, argument, device, dtype), one per line."""
        seen, lines = set(), []
        for r in self.violations():
            key = (r.where, r.fn, r.arg, r.device, r.dtype)
            if key not in seen:
                seen.add(key)
                lines.append(str(r))
        return "\n".join(lines)

    def assert_clean(self) -> None:
        """Raise CollectiveDeviceError listing each violation (file:line) if there is any."""
        bad = self.violations()
        if bad:
            raise CollectiveDeviceError(
                f"{len(bad)} tensor(s) handed to collectives are not on {self.device} "
                f"(distinct call sites below):\n{self.report()}")

    # ---- patching --------------------------------------------------------------------------------
    def _patch(self, module, attr: str, value) -> None:
        self._patched.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)

    def __enter__(self) -> "check_collective_devices":
        if self._active or isinstance(c10d.all_reduce, _Wrapper):
            raise RuntimeError("check_collective_devices is not reentrant: another check is active")
        reals = {}
        for name in CHECKED + UNCHECKED:
            real = getattr(c10d, name, None)
            if real is None or isinstance(real, _Wrapper):
                continue
            reals[name] = real
        wrappers = {name: _Wrapper(self, name, real, name in CHECKED) for name, real in reals.items()}
        by_id = {id(real): wrappers[name] for name, real in reals.items()}
        try:
            for name, w in wrappers.items():
                for mod in (dist, c10d):
                    if getattr(mod, name, None) is reals[name]:
                        self._patch(mod, name, w)
            # modules that bound a function by name (from torch.distributed import all_reduce)
            for mod in list(sys.modules.values()):
                mname = getattr(mod, "__name__", "") or ""
                if mod is None or mname == "torch" or mname.startswith("torch."):
                    continue
                try:
                    items = list(vars(mod).items())
                except TypeError:
                    continue
                for attr, value in items:
                    if callable(value) and id(value) in by_id and value is by_id[id(value)]._real:
                        self._patch(mod, attr, by_id[id(value)])
            if self.default_meta:  # what torch.set_default_device("meta") does, with _MetaDefault's rule
                glob = torch._GLOBAL_DEVICE_CONTEXT
                self._prev_default = getattr(glob, "device_context", None)
                if self._prev_default is not None:
                    self._prev_default.__exit__(None, None, None)
                self._meta_set = True
                ctx = _MetaDefault("meta")
                ctx.__enter__()
                self._meta_ctx = glob.device_context = ctx
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def _restore(self) -> None:
        if self._meta_set:
            if self._meta_ctx is not None:
                self._meta_ctx.__exit__(None, None, None)
                self._meta_ctx = None
            if self._prev_default is not None:
                self._prev_default.__enter__()
            torch._GLOBAL_DEVICE_CONTEXT.device_context = self._prev_default
            self._meta_set = False
        for module, attr, original in reversed(self._patched):
            setattr(module, attr, original)
        self._patched.clear()
        self._active = False

    def __exit__(self, exc_type, exc, tb) -> None:
        self._restore()
        if exc_type is None and self.strict:
            self.assert_clean()
