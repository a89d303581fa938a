"""Host syncs on the device path: zero per MoE layer (forward + backward) and per non-logging step.

On a GPU a host sync is any operation that needs a device value on the host (``.item()``,
``bool(t)``, ``.tolist()``, ``.cpu()``) or whose output shape depends on device data (``nonzero``,
boolean-mask indexing, ``bincount``, ``unique``, ``repeat_interleave`` without ``output_size``).
This machine has no GPU, so :class:`HostSyncSpy` finds them on CPU: a TorchDispatchMode flags those
aten ops, and Python-level patches flag ``tolist`` / ``cpu`` / ``numpy`` / ``.to('cpu')``.

Tensors that are on the host by design (the data loader's batches) are *marked host*: ops whose tensor inputs are host tensors or constants (factory outputs such as
``arange``) produce host tensors and are never flagged (reading the label count of a host batch
is not a device sync). Everything else is treated as living on the device; an op on constants
only is flagged (conservative). A tensor is host only if it was made on the host and never moved:
``.to(<torch.device>)`` of a host tensor or constant (the training device; on this machine it would
return the same tensor) returns a fresh tensor that counts as device data, so the production
move (``megak3.ops.h2d.host_to_device``, called by ``RankStep.to_device`` and the step's
``batches_to_device``) is spied on as it is (issue 24: the earlier "clone = move" emulation kept
moved labels host and missed ``token_loss_sum``'s ``int(count)`` on every micro-batch).

Blocking host-to-device copies are counted too (``H2D ...`` events): on CUDA ``.to(device)`` of a
pageable host tensor, ``torch.tensor(data, device=)`` / ``torch.as_tensor(host, device=)`` and
``device_tensor.copy_(host_tensor)`` wait for the stream (torch synchronizes after a blocking copy;
the driver may, to stage pageable memory, under ``non_blocking``), so the host stops running ahead
of the GPU. A copy of a host tensor or constant to the training device (a
``torch.device``, or a device string other than 'cpu') is flagged unless it is made by the one
helper :mod:`megak3.ops.h2d` (pinned staging, one ``non_blocking`` copy per call; on this machine it
returns ``t.to(device)``, which the spy turns into device data as above). ``torch.tensor(data)``
without a device makes a host constant; a factory (``torch.zeros``, ``arange``, ``full``, ...) with a
training-device ``device=`` fills on the device (device data, never a copy source), one without
makes a host constant.

Counted on the code before issue 19 (commit ce1127a, k3 parity model, fp32, this spy): one MoE
layer fwd+bwd 4 (1 ``bincount`` in permute, 3 ``.tolist()`` in the per-expert loop); a MoonEP layer
at ep=2 6 (plan ``.tolist()``, 2 ``bincount``, 3 loop ``.tolist()``); a non-logging step 34 outside
the sites in ``ELSEWHERE`` and the NaN-skip flag (8 ``bincount``, 24 loop ``.tolist()``, the
optimizer's ``bool(any)`` and boolean-mask norm), plus the NaN-skip flag read by ``bool()``. After:
0, 1 (the split sizes), 0 (the skip is decided on the device: fused AdamW and Muon read
``found_inf``; the trainer reads the flags with the other metrics at log steps).
"""
from __future__ import annotations

import sys
import threading
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from megak3.config import load_model_config
from megak3.model.moe import LatentMoE
from parallel.testing import PARITY_MODEL

aten = torch.ops.aten

# ops that read a device value on the host or size their output from device data
_SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
             aten.nonzero.default, aten.argwhere.default, aten.masked_select.default,
             aten.bincount.default, aten._unique.default, aten._unique2.default, aten.unique_dim.default,
             aten.unique_consecutive.default, aten.histc.default}


def _where() -> str:
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in fr.filename and "test_host_syncs" not in fr.filename:
            return f"{fr.filename.rsplit('/', 2)[-2]}/{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} {fr.line}"
    return "?"


H2D_HELPER = "/megak3/ops/h2d.py"
"""the one module allowed to copy host tensors to the device (pinned staging, non_blocking)"""


def _helper_frame():
    """The H2D helper's frame when it is the first caller outside torch and this file, else None."""
    f = sys._getframe(1)
    while f is not None and ("/torch/" in f.f_code.co_filename or "test_host_syncs" in f.f_code.co_filename):
        f = f.f_back
    return f if f is not None and f.f_code.co_filename.endswith(H2D_HELPER) else None


def _from_helper() -> bool:
    return _helper_frame() is not None


def _is_device(dev) -> bool:
    """``dev`` names the training device: a torch.device (on this machine that is the CPU, so a
    literal 'cpu' string is how code asks for the host) or any other device string ('cuda')."""
    return isinstance(dev, torch.device) or (isinstance(dev, str) and not dev.startswith("cpu"))


_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "eye", "linspace", "rand", "randn", "randint",
              "randperm", "empty_strided", "scalar_tensor")


_PATCH_LOCK = threading.Lock()
_SPIES: dict = {}      # thread id -> its active HostSyncSpy stack (TorchDispatchMode is per thread too)
_PATCHED: list = []    # (name, original) of the process-wide patches, while any spy is active


class _Keeps(dict):
    """A mapping that keeps nothing (a thread without a spy marks no tensor)."""

    def __setitem__(self, key, value) -> None:
        pass


class _NoSpy:
    """What a patched function sees on a thread without a spy: nothing is host data, nothing is flagged."""

    host = _Keeps()

    @staticmethod
    def _is_host(t) -> bool:
        return False

    def _flag(self, what) -> None:
        pass

    def _helper_move(self, frame) -> None:
        pass


_NO_SPY = _NoSpy()


class _Current:
    """The calling thread's innermost spy (the patched functions are shared by every thread)."""

    def __getattr__(self, name):
        stack = _SPIES.get(threading.get_ident())
        return getattr(stack[-1] if stack else _NO_SPY, name)


def _install_patches():
    spy = _Current()

    def patch(name, pred=lambda self, *a, **k: True):
        orig = getattr(torch.Tensor, name)

        def wrapper(self, *a, **k):
            if not spy._is_host(self) and pred(self, *a, **k):
                spy._flag(f"Tensor.{name}")
            return orig(self, *a, **k)
        setattr(torch.Tensor, name, wrapper)
        _PATCHED.append((name, orig))

    orig_to = torch.Tensor.to

    def to(self, *a, **k):
        dev = k.get("device", a[0] if a else None)
        if isinstance(dev, str) and dev.startswith("cpu"):  # a literal 'cpu' asks for the host
            if not spy._is_host(self):
                spy._flag("Tensor.to('cpu')")
            return orig_to(self, *a, **k)
        if _is_device(dev) and spy.host.get(self) in ("host", "constant"):  # moved to the device
            helper = _helper_frame()
            if helper is None:
                spy._flag("H2D Tensor.to(device)")
            else:
                spy._helper_move(helper)
            out = orig_to(self, *a, **k)
            if out is self:
                out = self.clone()
            spy.host.pop(out, None)
            return out
        return orig_to(self, *a, **k)

    def from_data(name, orig):
        def wrapped(data, *a, **k):  # torch.tensor / torch.as_tensor(data, dtype=None, device=None)
            dev = k.get("device", a[1] if len(a) > 1 else None)
            if not _is_device(dev):
                out = orig(data, *a, **k)
                if not isinstance(data, torch.Tensor):
                    spy.host[out] = "constant"  # made on the host from Python data
                return out
            if (not isinstance(data, torch.Tensor) or spy.host.get(data) in ("host", "constant")) \
                    and not _from_helper():
                spy._flag(f"H2D torch.{name}(device=)")
            out = orig(data, *a, **k)
            if out is data:
                out = data.clone()
            spy.host.pop(out, None)
            return out
        return wrapped

    def filled(orig):
        def made(*a, **k):  # a factory's device kwarg says where it fills (the dispatcher sees 'cpu')
            out = orig(*a, **k)
            if _is_device(k.get("device")) and isinstance(out, torch.Tensor):
                spy.host.pop(out, None)  # filled on the device: device data, not a host constant
            return out
        return made

    patch("tolist")
    patch("numpy")
    patch("cpu")
    for name in _FACTORIES:
        orig = getattr(torch, name)
        setattr(torch, name, filled(orig))
        _PATCHED.append((f"torch.{name}", orig))
    orig_cuda = torch.Tensor.cuda

    def cuda(self, *a, **k):
        if spy.host.get(self) in ("host", "constant") and not _from_helper():
            spy._flag("H2D Tensor.cuda()")
        return orig_cuda(self, *a, **k)
    torch.Tensor.cuda = cuda
    _PATCHED.append(("cuda", orig_cuda))
    torch.Tensor.to = to
    _PATCHED.append(("to", orig_to))
    for name in ("tensor", "as_tensor"):
        orig = getattr(torch, name)
        setattr(torch, name, from_data(name, orig))
        _PATCHED.append((f"torch.{name}", orig))


class HostSyncSpy(TorchDispatchMode):
    """Counts would-be host syncs; ``events`` lists (what, where) for the failure message."""

    def __init__(self):
        super().__init__()
        self.host = WeakTensorKeyDictionary()
        self.events: list[tuple[str, str]] = []
        self.copies: list[list] = []    # [tensors, caller] per call of the H2D helper (one copy each)
        self._helper_call = None        # the helper frame of the last copy (a call = one frame)

    def _helper_move(self, frame) -> None:
        if frame is not self._helper_call:
            f = frame
            while f is not None and f.f_code.co_filename.endswith((H2D_HELPER, "/megak3/model/seqinfo.py")):
                f = f.f_back
            self.copies.append([0, "?" if f is None else f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}"])
            self._helper_call = frame
        self.copies[-1][0] += 1

    def mark_host(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.host[t] = "host"

    def _is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self.host.get(t) == "host"

    def _flag(self, what: str) -> None:
        self.events.append((what, _where()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        kinds = [self.host.get(t, "device") for t in tensors]
        host = "host" in kinds and "device" not in kinds     # host data (+ constants made here)
        if not host:
            if func in _SYNC_OPS:
                self._flag(str(func))
            elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
                self._flag("repeat_interleave without output_size")
            elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flat[1:]):
                self._flag(f"{func} with a boolean mask")
            elif (func is aten.copy_.default and kinds[0] == "device" and kinds[1] in ("host", "constant")
                  and not _from_helper()):
                self._flag("H2D copy_ from a host tensor")
        out = func(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if host:
            self.mark_host(*outs)
        elif not tensors or all(k == "constant" for k in kinds):  # factories: neither host nor device
            for o in outs:
                self.host.setdefault(o, "constant")
        else:                                                     # device data (also in-place results)
            for o in outs:
                self.host.pop(o, None)
        return out

    def __enter__(self):
        with _PATCH_LOCK:   # the patches are process-wide: installed by the first spy, removed by the last
            _SPIES.setdefault(threading.get_ident(), []).append(self)
            if not _PATCHED:
                _install_patches()
        return super().__enter__()

    def __exit__(self, *exc):
        with _PATCH_LOCK:
            stack = _SPIES.get(threading.get_ident(), [])
            if self in stack:
                stack.remove(self)
            if not stack:
                _SPIES.pop(threading.get_ident(), None)
            if not _SPIES:
                for name, orig in reversed(_PATCHED):
                    if name.startswith("torch."):
                        setattr(torch, name[len("torch."):], orig)
                    else:
                        setattr(torch.Tensor, name, orig)
                _PATCHED.clear()
        return super().__exit__(*exc)

    def report(self) -> str:
        return "\n".join(f"  {w}: {loc}" for w, loc in self.events)


# ---- the spy itself can fail -------------------------------------------------------------------

def test_spy_flags_known_syncs_and_spares_host_tensors():
    x = torch.randn(6)
    with HostSyncSpy() as spy:
        x.sum().item()
        bool(x.sum() > 0)
        x.tolist()
        torch.nonzero(x > 0)
        x[x > 0]
        torch.bincount(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 0]))
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 0]), output_size=3)  # not a sync
        h = torch.ones(3)
        spy.mark_host(h)
        int((h != 0).sum())                                   # host data: not a sync
    kinds = [w for w, _ in spy.events]
    assert len(kinds) == 7, spy.report()


def test_spy_flags_blocking_host_to_device_copies_outside_the_helper():
    """The H2D rule: every way of copying a host tensor or Python data to the training device is
    flagged, except through megak3.ops.h2d (whose results are device data); fills on the device,
    dtype casts and host math are not copies."""
    from megak3.ops.h2d import host_to_device

    dev = torch.device("cpu")      # the training device on this machine
    h = torch.arange(6)
    with HostSyncSpy() as spy:
        spy.mark_host(h)
        d = h.to(dev)                                            # 1
        h.to(device=dev, dtype=torch.float32)                    # 2
        torch.tensor([1, 2], device=dev)                         # 3
        torch.as_tensor(h, device=dev)                           # 4
        torch.zeros(6, dtype=torch.long).to(dev)                 # 5: a host-made constant, moved
        torch.tensor([3.0]).to(dev)                              # 6
        (d * 1).copy_(h)                                         # 7: device tensor <- host tensor
        n = len(spy.events)
        moved, none = host_to_device([h, None], dev)             # the helper: not flagged
        z = torch.zeros(3, device=dev)                           # a fill on the device, no copy
        z.to(dev), d.to(dev), h.to(torch.int32), h.to("cpu")     # no-ops, a cast, the host itself
        (h + 1).sum()
        assert len(spy.events) == n and none is None
        moved.sum().item()                                       # helper output is device data: a sync
    assert torch.equal(moved, h)
    kinds = [w for w, _ in spy.events]
    assert kinds == ["H2D Tensor.to(device)"] * 2 + ["H2D torch.tensor(device=)", "H2D torch.as_tensor(device=)"] \
        + ["H2D Tensor.to(device)"] * 2 + ["H2D copy_ from a host tensor", "aten._local_scalar_dense.default"], \
        spy.report()
    assert spy.copies == [[1, spy.copies[0][1]]], spy.copies   # one helper call, one tensor moved


# ---- one MoE layer ------------------------------------------------------------------------------

def _moe():
    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    torch.manual_seed(0)
    moe = LatentMoE(cfg)
    moe.gate.e_score_correction_bias.copy_(torch.linspace(0.1, 0, cfg.moe.num_experts))
    return moe, cfg


def test_moe_layer_forward_backward_has_no_host_sync():
    moe, cfg = _moe()
    x = torch.randn(64, cfg.hidden_size, requires_grad=True)
    with HostSyncSpy() as spy:
        y, stats = moe(x)
        y.square().sum().backward()
    assert len(spy.events) == 0, spy.report()
    assert moe.experts.w1.grad.abs().sum() > 0


def test_moe_layer_bf16_autocast_has_no_host_sync():
    moe, cfg = _moe()
    x = torch.randn(64, cfg.hidden_size, requires_grad=True)
    with HostSyncSpy() as spy, torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = moe(x)
        y.float().square().sum().backward()
    assert len(spy.events) == 0, spy.report()
    assert moe.experts.w1.grad.dtype == torch.float32


def _moonep_layer(rank, world):
    from moonep.buffers import BufferPool
    from moonep.config import MoonEPConfig
    from parallel.expert_parallel import parallelize_ep

    moe, cfg = _moe()
    parallelize_ep(moe, dist.group.WORLD, MoonEPConfig(planner_backend="torch"), pool=BufferPool())
    x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    with HostSyncSpy() as spy:
        y, _ = moe(x)
        y.square().sum().backward()
    return [w for w, _ in spy.events], spy.report()


def test_moonep_layer_has_one_host_read_on_gloo():
    """MoonEP at ep=2 (gloo): the one remaining host read is the split sizes of the all-to-alls
    (``.tolist()`` of the plan); removing it needs device-side splits (symmetric memory, CUDA)."""
    from parallel.testing import run_distributed

    for kinds, rep in run_distributed(_moonep_layer, 2, timeout_s=300):
        assert kinds == ["Tensor.tolist"], rep


# ---- one training step ------------------------------------------------------------------------

# Sites that are not on the GPU path or not this module's to fix, each with its reason. Everything
# else in a non-logging step must be sync-free.
ELSEWHERE = {
    "kda/": "pure-torch chunked KDA, the CPU twin (CUDA runs fla chunk_kda): offsets .tolist(), "
                  "pad.any(), the gate-range check float(aminmax)",
    "ops/attention.py": "chunk-pair skipping of the CPU MLA twin (CUDA with documents or a CP query offset runs "
                        "FlexAttention)",
}

def _old_token_loss_sum(logits_BTV, labels_BT):
    """token_loss_sum as of 8d54860: the label count read on the host (the negative control)."""
    import torch.nn.functional as F

    n = int((labels_BT != -100).sum())
    loss = F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), labels_BT.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, n


def _step_events(rank=0, world=1, layout=None, loss_fn=None, with_copies=False):
    """Events of one non-logging production step (the second; the first warms lazy state up) on
    this rank. layout: parity_job keyword arguments (tp, sp, cp, ep; dp fills the world).
    with_copies: return (events, the H2D helper's copies: [tensors moved, caller] per call)."""
    from megak3.train.step import RankStep
    from parallel.testing import global_batch, local_rows
    from megak3.train.parity import parity_job
    from parallel.state import ParallelState, init_parallel

    lay = {"tp": 1, "sp": False, "cp": 1, "ep": 1, "pp": 1, **(layout or {})}
    dp = world // (lay["tp"] * lay["cp"] * lay["pp"])
    job = parity_job(lay["tp"], dp, lay["sp"], dict(PARITY_MODEL), 2, 32, 5, 1e-3, 3, cp=lay["cp"], ep=lay["ep"],
                     pp=lay["pp"])
    job.moonep.planner_backend = "torch"  # the planner CUDA runs (the C++ one plans CPU tensors on the host)
    ps = init_parallel(job.parallel, model_cfg=job.model) if world > 1 else ParallelState.single()
    rs = RankStep(job, ps, "cpu", grad_accum=1)
    if loss_fn is not None:
        rs.model.set_parallel_hooks(replace(rs.model.parallel_hooks, loss_fn=loss_fn))
    spy = HostSyncSpy()

    def step(i):
        ids, labels, _ = global_batch(i, 2, 32, job.model.vocab_size)
        ids, labels, cu = local_rows(ids, labels, ps.dp_rank, dp)
        spy.mark_host(ids, labels, cu)                       # the loader's batches live on the host
        rs.accumulate([{"input_ids": ids, "labels": labels, "cu_seqlens": cu}])  # production to_device
        return rs.apply(i, 3)

    step(0)  # warm-up outside the spy (lazy optimizer state)
    with spy:
        out = step(1)
    assert not bool(out["skipped"])
    return (spy.events, spy.copies) if with_copies else spy.events


def _at(loc: str, site: str) -> bool:
    """``site`` is a file path prefix, optionally `` :: `` and a snippet of the source line (so a
    site survives edits that move its line)."""
    where, _, snippet = site.partition(" :: ")
    return loc.startswith(where) and snippet in loc


def _not_elsewhere(events, allowed=ELSEWHERE):
    return [(w, loc) for w, loc in events if not any(_at(loc, k) for k in allowed)]


def test_training_step_has_no_host_sync():
    """Includes the non-finite skip: decided on the device (``found_inf``), never read on the host.
    Host-to-device: two copies through megak3.ops.h2d, none outside it: the micro-batch (ids,
    labels) with the step's counts, and the SeqInfo's three index tensors."""
    events, copies = _step_events(with_copies=True)
    mine = _not_elsewhere(events)
    assert mine == [], "\n".join(f"{w}: {loc}" for w, loc in mine)
    assert [(n, loc.split(":")[0]) for n, loc in copies] == [(3, "step.py"), (3, "k3.py")], copies


def test_spy_sees_a_blocking_copy_planted_in_the_step(monkeypatch):
    """Negative control of the H2D rule over a whole step: the step's batch moved by a plain
    ``.to(device, non_blocking=True)`` from pageable memory (what RankStep.to_device did before) is
    flagged at train/step.py, once per tensor (ids, labels, the counts)."""
    import megak3.train.step as step_mod

    monkeypatch.setattr(step_mod, "host_to_device", lambda ts, dev: [t.to(dev, non_blocking=True) for t in ts])
    events, copies = _step_events(with_copies=True)
    mine = _not_elsewhere(events)
    assert [w for w, _ in mine] == ["H2D Tensor.to(device)"] * 3, mine
    assert all(loc.startswith("train/step.py") for _, loc in mine), mine
    assert [loc.split(":")[0] for _, loc in copies] == ["k3.py"], copies


def test_spy_sees_moved_labels_as_device_data():
    """Negative control: a batch moved by the production ``RankStep.to_device`` is device data, so
    8d54860's token_loss_sum (``int(count)`` of the moved labels) is caught at the model's loss
    line, while today's count (a device tensor) and the host batch's own count are not."""
    from types import SimpleNamespace

    from megak3.model.k3 import build_model
    from megak3.train.step import RankStep
    from parallel.testing import global_batch, local_rows

    model = build_model(load_model_config("k3_tiny", **PARITY_MODEL), seed=1)
    ids, labels, _ = global_batch(0, 1, 32, model.config.vocab_size)
    ids, labels, cu = local_rows(ids, labels, 0, 1)
    found = {}
    for name, loss_fn in (("old", _old_token_loss_sum), ("new", model.loss_fn)):
        model.set_parallel_hooks(replace(model.parallel_hooks, loss_fn=loss_fn))
        with HostSyncSpy() as spy:
            spy.mark_host(ids, labels, cu)
            int((labels != -100).sum())                    # the loader's count: a host read, not a sync
            b = RankStep.to_device(SimpleNamespace(device=torch.device("cpu")), {"input_ids": ids, "labels": labels,
                                                                                 "cu_seqlens": cu})
            assert b["labels"] is not labels               # the spy's move made a device tensor
            model(b["input_ids"], labels=b["labels"], cu_seqlens=b["cu_seqlens"])
        found[name] = _not_elsewhere(spy.events)
    assert [w for w, _ in found["old"]] == ["aten._local_scalar_dense.default"], found
    assert found["old"][0][1].startswith("model/k3.py"), found
    assert found["new"] == [], found


def test_token_count_stays_on_device_and_loss_is_unchanged():
    from megak3.model.k3 import build_model

    model = build_model(load_model_config("k3_tiny", **PARITY_MODEL), seed=1)
    ids = torch.randint(0, 64, (2, 16))
    labels = ids.roll(-1, 1)
    labels[0, :5] = -100
    out = model(ids, labels=labels)
    assert torch.is_tensor(out.num_tokens) and int(out.num_tokens) == 27
    ref_sum, _ = _old_token_loss_sum(model(ids, return_logits=True).logits, labels)
    assert torch.equal(out.loss_sum, ref_sum) and torch.equal(out.loss, ref_sum / 27)


# Documented host reads that a layout adds, each with its reason; the count of each is bounded by
# one per MoE layer and step below.
PER_LAYER_READS = {
    "moonep/moonep.py": "MoonEP's all-to-all split sizes, once per MoE layer call (documented there; device-side "
                        "splits need symmetric memory on CUDA)",
    "parallel/moe_stats.py": "the exact Quantile-Balancing merge reads the gathered token counts, once per MoE layer "
                             "and step (documented there; model.moe.qb_method=histogram has none)",
}
# Host syncs and blocking host-to-device copies the spy finds that are NOT fixed yet: site -> (most
# events per step, reason). Empty since issue 37: ZeRO-1 decides which params have a gradient from
# static information (plus a device-side mask for the model's batch-dependent params,
# parallel/data_parallel/grads.py), and the CP conv halo's document starts are index math on the
# loader's host offsets (parallel/context_parallel.py ContextParallel.shard, parallel/kda_cp.py
# conv_halo_seq_info). Every host-to-device copy of the step goes through megak3.ops.h2d (the
# micro-batch with the step's counts in train/step.py, SeqInfo.moved for the model's and CP's index
# tensors; kda_cp finds each row's last document on the device).
OPEN: dict = {}
LAYOUTS = {"tp2+sp": {"tp": 2, "sp": True}, "dp2 ZeRO-1": {}, "ep2 MoonEP": {"ep": 2}, "cp2": {"cp": 2},
           "pp2": {"pp": 2}}


def _planted_item(loss_fn):
    """``loss_fn`` plus a host read of its loss and a blocking host-to-device copy (the negative
    controls of the layout runs; the spy names the model's loss line, the first frame outside this
    file)."""
    def planted(logits, labels):
        out = loss_fn(logits, labels)
        out[0].item()
        torch.tensor([1.0]).to(logits.device)
        return out
    return planted


def _layout_events(rank, world):
    out = {name: _step_events(rank, world, layout, with_copies=True) for name, layout in LAYOUTS.items()}
    from megak3.model.k3 import token_loss_sum
    out["planted"] = _step_events(rank, world, {}, loss_fn=_planted_item(token_loss_sum))
    return out


# Host-to-device copies per step (all through megak3.ops.h2d): (tensors moved, file of the caller).
# The micro-batch with the step's counts; then the SeqInfo (k3.py), or under CP the local SeqInfo,
# the key document ids, the local offsets and the conv halo's offsets and positions in one copy.
COPIES = {"cp2": [(3, "step.py"), (7, "context_parallel.py")]}
COPIES_DEFAULT = [(3, "step.py"), (3, "k3.py")]


def test_parallel_steps_have_no_host_sync():
    """tp2 + sequence parallel, dp2 with ZeRO-1, ep2 with MoonEP, cp2 (balanced MLA, the default),
    pp2 (gloo, 2 ranks): 0 host syncs and 0 blocking host-to-device copies in a non-logging step
    outside the CPU twins' sites (ELSEWHERE) and the per-layer reads above; the step's copies are
    the two of COPIES, through megak3.ops.h2d; a planted ``.item()`` and a planted ``.to(device)``
    in the dp2 step are seen."""
    from parallel.testing import run_distributed

    cfg = load_model_config("k3_tiny", **PARITY_MODEL)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    for rank, by_layout in enumerate(run_distributed(_layout_events, 2, timeout_s=400)):
        # negative control: the same dp2 step with a planted .item() on the loss is seen, where it is
        planted = _not_elsewhere(by_layout.pop("planted"), {**ELSEWHERE, **PER_LAYER_READS})
        assert [w for w, loc in planted] == ["aten._local_scalar_dense.default", "H2D Tensor.to(device)"], planted
        assert all(loc.startswith("model/k3.py") for _, loc in planted), planted
        for name, (events, copies) in by_layout.items():
            assert [(n, loc.split(":")[0]) for n, loc in copies] == COPIES.get(name, COPIES_DEFAULT), \
                (name, rank, copies)
            mine = _not_elsewhere(events, {**ELSEWHERE, **PER_LAYER_READS, **OPEN})
            assert mine == [], f"{name}, rank {rank}:\n" + "\n".join(f"{w}: {loc}" for w, loc in mine)
            for site, most in [(k, n_moe) for k in PER_LAYER_READS] + [(k, v[0]) for k, v in OPEN.items()]:
                n = sum(_at(loc, site) for _, loc in events)
                assert n <= most, (name, rank, site, n, most, [e for e in events if _at(e[1], site)])
            if "ep" in LAYOUTS[name]:
                assert sum(loc.startswith("moonep/moonep.py") for _, loc in events) == n_moe, (name, rank)


def test_spies_on_two_threads_leave_torch_as_it_was():
    """Threaded ranks each enter a spy: the first to enter exits first and the last restored the patches
    it had found (the other spy's wrappers, left installed for the rest of the process: a later test's
    torch.tensor then ran a dead spy's code; fails on the old spy). Now the patches are shared, dispatch
    to the calling thread's spy, and go when the last spy exits."""
    import threading
    import time

    real = (torch.tensor, torch.as_tensor, torch.zeros, torch.Tensor.to, torch.Tensor.tolist)
    entered, second_in = threading.Event(), threading.Event()

    def first():
        with HostSyncSpy():
            entered.set()
            second_in.wait(10)             # exits first

    def second():
        entered.wait(10)
        with HostSyncSpy():
            second_in.set()
            time.sleep(0.2)                # exits last

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert (torch.tensor, torch.as_tensor, torch.zeros, torch.Tensor.to, torch.Tensor.tolist) == real
