"""Loader of the optional C++ MoonEP planner (csrc/moonep_planner.cpp).

``setup.py`` builds it as ``moonep._planner_cpp`` when a compiler is available (the install succeeds
without it). :func:`get` returns that module, or, only when asked (``MEGAK3_BUILD_EXT=1`` or
``get(build=True)``), JIT-builds the same source with ``torch.utils.cpp_extension.load`` into
``$MEGAK3_EXT_CACHE`` (default ``<repo>/.cache/torch_extensions``). ``None`` means "use the torch
planner"; the reason is kept in :data:`load_error`.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

_SRC = Path(__file__).resolve().parent.parent / "csrc" / "moonep_planner.cpp"
_mod = None
_tried_import = False
load_error: str | None = None


def get(build: bool | None = None):
    """The C++ planner module or None. ``build``: JIT-build if not installed (default: env flag)."""
    global _mod, _tried_import, load_error
    if _mod is not None:
        return _mod
    if not _tried_import:
        _tried_import = True
        try:
            _mod = importlib.import_module(f"{__package__}._planner_cpp")  # the extension module, not the package
            return _mod
        except ImportError as exc:
            load_error = f"moonep._planner_cpp not built ({exc})"
    if build is None:
        build = os.environ.get("MEGAK3_BUILD_EXT", "0") == "1"
    if not build:
        return None
    if not _SRC.exists():
        load_error = f"{_SRC} missing"
        return None
    try:
        from torch.utils.cpp_extension import load
        cache = Path(os.environ.get("MEGAK3_EXT_CACHE", _SRC.parent.parent / ".cache" / "torch_extensions"))
        cache.mkdir(parents=True, exist_ok=True)
        _mod = load(name="moonep_planner_jit", sources=[str(_SRC)], build_directory=str(cache),
                    extra_cflags=["-O3"], verbose=False)
    except Exception as exc:  # compiler missing, headers missing, ...
        load_error = f"JIT build of {_SRC.name} failed: {exc}"
        _mod = None
    return _mod
