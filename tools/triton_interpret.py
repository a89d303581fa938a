"""Shims that let fla's Triton KDA kernels run under Triton's interpreter on CPU tensors.

Used only by the interpreter check (tools/ci_triton.sh -> tests/fla_interpret_check.py), never
by training. Call `install()` with ``TRITON_INTERPRET=1`` set and BEFORE fla is imported, then
`import_fla()`; both are idempotent. Written for triton 3.7.1 (torch 2.13's pin) and fla-core
0.4.2 / 0.5.x. What each shim patches, and why:

1. ``torch.cpu.device`` (a no-op context manager, only when torch lacks it). fla 0.4.2's
   ``input_guard`` enters ``device_torch_lib.device(index)``, and with no GPU driver fla's
   ``device_torch_lib`` is ``torch.cpu``, which has no ``device`` in torch 2.13.
2. ``triton.runtime.autotuner.Autotuner._bench`` returns equal timings without running anything.
   The autotuner benchmarks every config through ``driver.active.get_benchmarker()``, which needs an
   active GPU driver; with equal timings it keeps the first config (the choice only affects speed,
   and the interpreter would otherwise run every kernel once per config).
3. Loop counters become interpreter tensors. The interpreter rewrites every assignment
   ``x = v`` into ``x = to_tensor(v)`` but leaves ``for i in range(...)`` counters as Python ints,
   so kernel code such as ``(i_t * BT).to(tl.int64)`` raises AttributeError. The shim adds the
   same conversion for a ``for`` loop's name target at the top of the loop body (compiled code
   keeps int counters anyway).
4. ``gather`` in fla's modules is rebound (by `import_fla`) to a function that looks ``tl.gather``
   up when called. fla does ``gather = tl.gather`` at import time, which keeps the unpatched
   builtin; the interpreter swaps the builtins on ``triton.language`` only while a kernel runs.
5. ``triton.runtime.interpreter.GridExecutor.__call__`` runs under one process-wide lock. The
   interpreter patches module attributes of ``triton.language`` for the duration of a launch and
   restores them afterwards, so two threads launching at once (CP ranks on torch's threaded
   process group) would undo each other's patches.

Not shimmed: the interpreter stores bf16 as uint16 and its ``tl.dot`` on such blocks is wrong, so
exactness checks under the interpreter use fp32 operands only.
"""
from __future__ import annotations

import ast
import contextlib
import os
import sys
import threading

_INSTALLED = False


def _cpu_device_shim() -> None:
    import torch
    if not hasattr(torch.cpu, "device"):
        torch.cpu.device = lambda index=None: contextlib.nullcontext()


def _autotune_shim() -> None:
    from triton.runtime import autotuner

    def _bench(self, *args, config, **meta):  # equal timings: min() keeps the first config
        return [0.0, 0.0, 0.0]

    autotuner.Autotuner._bench = _bench


def _loop_counter_shim() -> None:
    from triton.runtime import interpreter

    base = interpreter.ASTTransformer

    class _LoopCounterToTensor(base):
        def visit_For(self, node):
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                name = node.target.id
                convert = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())],
                    value=ast.Call(func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                                                      attr="to_tensor", ctx=ast.Load()),
                                   args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)],
                                   keywords=[]))
                node.body.insert(0, convert)
            return node

    interpreter.FunctionRewriter.ast_transformer = _LoopCounterToTensor()
    interpreter.InterpretedFunction.rewritten_fn.clear()


def _serial_launch_shim() -> None:
    from triton.runtime import interpreter

    lock = threading.RLock()
    launch = interpreter.GridExecutor.__call__

    def locked_launch(self, *args, **kwargs):
        with lock:
            return launch(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = locked_launch


def install() -> None:
    """Apply shims 1-3 and 5 (before fla is imported). Requires ``TRITON_INTERPRET=1``."""
    global _INSTALLED
    if _INSTALLED:
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("tools/triton_interpret.install: set TRITON_INTERPRET=1 before starting Python")
    if any(name == "fla" or name.startswith("fla.") for name in sys.modules):
        raise RuntimeError("tools/triton_interpret.install: call it before fla is imported")
    _cpu_device_shim()
    _autotune_shim()
    _loop_counter_shim()
    _serial_launch_shim()
    _INSTALLED = True


def _late_gather(src, index, axis):
    import triton.language as tl
    return tl.gather(src, index, axis)


def import_fla():
    """Import ``fla.ops.kda`` under the shims and apply shim 4; returns fla's ``chunk_kda``."""
    install()
    import triton.language as tl
    from fla.ops.kda import chunk_kda
    original = tl.gather
    for name, module in list(sys.modules.items()):
        if (name == "fla" or name.startswith("fla.")) and getattr(module, "gather", None) is original:
            module.gather = _late_gather
    return chunk_kda
