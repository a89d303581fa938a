"""Command-line pieces shared by ``python -m megak3.generate`` (cli.py), its ``serve`` command (server.py)
and the lm-eval adapter: the model options, their checks, and loading the engine."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True,
                   help="run dir, checkpoint dir (any layout) or Hugging Face export dir")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", help="compute dtype (default float32)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def check_checkpoint_path(path: str) -> None:
    if not Path(path).expanduser().exists():
        raise ValueError(f"--checkpoint {path}: no such file or directory; give a megak3 run dir, checkpoint dir "
                         "or Hugging Face export dir")


def check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA device; use --device cpu")


def load_engine(a):
    """The :class:`megak3.inference.Engine` of the parsed model options ``a`` (checked first)."""
    from megak3.inference import Engine

    import torch

    check_checkpoint_path(a.checkpoint)
    check_device(a.device)
    if a.threads < 1:
        raise ValueError(f"--threads {a.threads} must be >= 1")
    torch.set_num_threads(a.threads)
    cache = {}
    if getattr(a, "checkpoint_interval", None) is not None:   # serve's option
        cache["checkpoint_interval"] = a.checkpoint_interval
    return Engine.from_pretrained(a.checkpoint, device=a.device, dtype=a.dtype, **cache)
