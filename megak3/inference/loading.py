"""Load a model for generation: a megak3 checkpoint of any training layout, or a Hugging Face directory.

A trainer checkpoint is read through :class:`megak3.checkpoint.reader.CheckpointReader` (the reader
that resumes any layout): every model tensor's whole global box, so tp / pp / ep / cp layouts all
come back as the single-process model. The model config and the quantisation settings are the run's
(recorded in the checkpoint's meta); QAT hooks are re-applied so generation computes with the
quantised experts the run trained with. A Hugging Face directory (``model.safetensors.index.json``
or ``model.safetensors`` + ``config.json``) goes through ``load_hf_into``, the reader behind
``train.init_from_hf``; MXFP4-packed experts are dequantised and the MXFP4 QAT forward is applied.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Tuple

import torch
from torch import nn

from .types import InferenceError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_checkpoint(path) -> Tuple[str, Path]:
    """("hf" | "megak3", directory): an HF export, a checkpoint directory (step_XXXXXXXX), or a run
    directory / checkpoint root whose newest complete checkpoint is taken."""
    from ..checkpoint import atomic as ckpt

    p = Path(os.path.expanduser(str(path)))
    if not p.is_dir():
        raise InferenceError(f"checkpoint={path}: no such directory; give a megak3 run or checkpoint "
                             "directory or a Hugging Face export directory")
    if (p / "model.safetensors.index.json").is_file() or (p / "model.safetensors").is_file():
        return "hf", p
    if (p / ckpt.MANIFEST_NAME).is_file():
        return "megak3", p
    for root in (p / "checkpoints", p):
        if root.is_dir():
            found = ckpt.find_latest(root)
            if found is not None:
                return "megak3", found
    raise InferenceError(f"checkpoint={path}: holds no complete megak3 checkpoint and no Hugging Face "
                         "weights (model.safetensors[.index.json])")


def _tokenizer_for(kind: str, ckpt_dir: Path, config: Optional[dict], explicit):
    from ..data.config import DEMOS
    from ..data.tokenizer import load_tokenizer

    candidates = [explicit] if explicit else []
    candidates += [ckpt_dir / "tokenizer.json", ckpt_dir.parent / "tokenizer.json",
                   ckpt_dir.parent.parent / "tokenizer.json"]
    data = (config or {}).get("data") or {}
    if not explicit and data and data.get("path") not in (None, *DEMOS):
        try:  # a run from before runs kept their tokenizer.json: the dataset's (a demo is never built here)
            from ..data.config import DataConfig, resolve_dataset

            candidates.append(resolve_dataset(DataConfig(**data))[1])
        except Exception:  # noqa: BLE001 - a moved dataset: the other candidates may still hold one
            pass
    for c in candidates:
        if c and Path(os.path.expanduser(str(c))).is_file():
            return load_tokenizer(os.path.expanduser(str(c)))
    if explicit:
        raise InferenceError(f"tokenizer={explicit}: no such file; give the tokenizer.json the model was trained with")
    raise InferenceError(f"checkpoint={ckpt_dir}: no tokenizer.json found beside it or through its data config; "
                         "pass tokenizer=PATH")


def _hf_config(path, d: Path) -> Tuple[object, dict]:
    """(ModelConfig, raw config.json) of a Hugging Face directory; bad input is one InferenceError line."""
    from ..interop.hf_config import from_hf_config

    try:
        hf_cfg = json.loads((d / "config.json").read_text())
        return from_hf_config(hf_cfg), hf_cfg
    except FileNotFoundError:
        raise InferenceError(f"checkpoint={path}: the Hugging Face directory has no config.json") from None
    except (ValueError, KeyError) as e:
        raise InferenceError(f"checkpoint={path}: config.json: {e}") from None


def _megak3_reader(path, d: Path):
    """(open CheckpointReader, its recorded job config with a model section) of a megak3 checkpoint."""
    from ..checkpoint.reader import CheckpointReader

    try:
        reader = CheckpointReader(d)
    except Exception as e:  # noqa: BLE001 - CheckpointError and OS errors: one line
        raise InferenceError(f"checkpoint={path}: {e}") from None
    config = (reader.meta or {}).get("config") or {}
    if not config.get("model"):
        reader.close()
        raise InferenceError(f"checkpoint={d} records no model config; it was not written by the megak3 trainer")
    return reader, config


def load_model(path, device="cpu", dtype="float32", tokenizer=None) -> Tuple[nn.Module, object, dict]:
    """(model in eval mode, Tokenizer, info) from a checkpoint or HF directory (module docstring)."""
    from ..model.k3 import build_model
    from ..quant import apply_quantization
    from ..quant.config import QuantConfig

    if dtype not in DTYPES:
        raise InferenceError(f"dtype={dtype!r} must be one of {', '.join(DTYPES)}")
    kind, d = resolve_checkpoint(path)
    config = None
    if kind == "hf":
        from ..interop.hf_load import load_hf_into

        cfg, hf_cfg = _hf_config(path, d)
        model = build_model(cfg, init=False)
        try:
            load_hf_into(model, None, d, cfg, field="checkpoint")
        except ValueError as e:
            raise InferenceError(str(e)) from None
        packed = bool(hf_cfg.get("quantization_config") or
                      (hf_cfg.get("text_config") or {}).get("quantization_config"))
        qcfg = QuantConfig(qat="mxfp4_experts" if packed else "none")
    else:
        from ..config import model_config_from_dict
        from parallel.plan import canonical_name

        reader, config = _megak3_reader(path, d)
        cfg = model_config_from_dict(config["model"])
        model = build_model(cfg, init=False)
        with torch.no_grad():
            for n, dst in model.state_dict().items():
                key = f"model/{canonical_name(n)}"
                if key not in reader.keys():
                    raise InferenceError(f"checkpoint={d} lacks model tensor {n!r}; its config and weights disagree")
                shape = tuple(reader.global_shape(key))
                if shape != tuple(dst.shape):
                    raise InferenceError(f"checkpoint={d}: tensor {n} has shape {list(shape)}, the model "
                                         f"needs {list(dst.shape)}")
                dst.copy_(reader.read(key, (0,) * dst.dim(), shape))
        reader.close()
        q = dict(config.get("quant") or {})
        qcfg = QuantConfig(**{k: v for k, v in q.items() if k in ("qat", "scale_mode", "fp8")})
        if qcfg.fp8 == "te":   # Transformer Engine is GPU-only; its pure-torch twin computes the same MXFP8
            qcfg.fp8 = "emulate"
    apply_quantization(model, qcfg)
    model = model.to(device=device, dtype=DTYPES[dtype]).eval()
    tok = _tokenizer_for(kind, d, config, tokenizer)
    return model, tok, {"kind": kind, "path": str(d), "quant": qcfg}


def load_config_and_tokenizer(path, tokenizer=None):
    """(ModelConfig, Tokenizer) of a checkpoint or HF directory without reading its weights: what a
    server needs beside engine replicas that load the weights themselves (megak3/inference/replicas.py)."""
    kind, d = resolve_checkpoint(path)
    config = None
    if kind == "hf":
        cfg = _hf_config(path, d)[0]
    else:
        from ..config import model_config_from_dict

        reader, config = _megak3_reader(path, d)
        reader.close()
        cfg = model_config_from_dict(config["model"])
    return cfg, _tokenizer_for(kind, d, config, tokenizer)
