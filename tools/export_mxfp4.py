#!/usr/bin/env python
"""Export the routed experts of a megak3 checkpoint as MXFP4 in the released K3 layout (K3_SPEC §7.1, §10.1).

    python tools/export_mxfp4.py --checkpoint runs/x/checkpoints [--output experts-mxfp4.safetensors]

For every MoE layer i and expert e (0-based, same i as megak3's ``layers.{i}``) it writes

    language_model.model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight_packed   uint8 [out, in/2]
    language_model.model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight_scale    uint8 [out, in/32]

from megak3's stacked ``layers.{i}.mlp.experts.w1`` [E, m, L] (w3 alike, w2 [E, L, m]); w1 = gate,
w3 = up, w2 = down, rows = output features. ``weight_packed``: two E2M1 codes per byte, element 2j
in the low nibble (compressed-tensors order); ``weight_scale``: E8M0 bytes (exponent + 127). The
quantizer is megak3.quant.mx, the one the QAT forward uses, so the dequantized export equals the QAT
forward's weights bit for bit (tests/test_qat.py). The scale rule comes from ``--scale-mode`` or,
by default, the checkpoint's ``quant.scale_mode`` in its manifest config (else "floor"). Only the
routed experts are written; everything else stays high precision and is exported elsewhere.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megak3.quant.mx import dequantize, quantize  # noqa: E402
from megak3.train import checkpoint as ckpt  # noqa: E402

PREFIX = "language_model.model.layers"
_SRC = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(w1|w3|w2)$")
_DST = re.compile(rf"^{re.escape(PREFIX)}\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w3|w2)\.weight_(packed|scale)$")


def expert_tensors(model_state: dict, scale_mode: str = "floor") -> dict:
    """megak3 model state dict -> {released name: uint8 tensor} for every routed expert weight."""
    out = {}
    for key, w_EOI in sorted(model_state.items()):
        m = _SRC.match(key)
        if m is None:
            continue
        layer, which = int(m.group(1)), m.group(2)
        scales_EOS, packed_EOP = quantize(w_EOI.detach().float().cpu(), "fp4_e2m1", 32, scale_mode)
        for e in range(w_EOI.shape[0]):
            base = f"{PREFIX}.{layer}.block_sparse_moe.experts.{e}.{which}"
            out[f"{base}.weight_packed"] = packed_EOP[e].contiguous()
            out[f"{base}.weight_scale"] = scales_EOS[e].contiguous()
    if not out:
        raise ValueError("no routed expert weights (layers.{i}.mlp.experts.w1/w3/w2) in the checkpoint's "
                         "model state; is this a megak3 MoE checkpoint?")
    return out


def _scale_mode_of(manifest: dict) -> str:
    cfg = (manifest.get("meta") or {}).get("config") or {}
    return ((cfg.get("quant") or {}).get("scale_mode")) or "floor"


def export_mxfp4(checkpoint, output, scale_mode: str | None = None) -> tuple[Path, int]:
    """Read a checkpoint directory (or a root holding ``latest``) and write ``output`` (.safetensors).

    Returns (output path, number of tensors written).
    """
    from safetensors.torch import save_file

    path = Path(checkpoint)
    if not (path / ckpt.MANIFEST_NAME).exists():
        found = ckpt.find_latest(path)
        if found is None:
            raise ValueError(f"--checkpoint {path}: neither a checkpoint directory nor a root with a complete one")
        path = found
    state, manifest = ckpt.load_checkpoint(path, weights_only=False)
    mode = scale_mode or _scale_mode_of(manifest)
    tensors = expert_tensors(state["model"], mode)
    meta = {"format": "pt", "quant_method": "mxfp4", "block_size": "32", "scale_mode": mode,
            "nibble_order": "element 2j = low nibble", "source_checkpoint": str(path),
            "step": str(manifest["step"])}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(output), metadata=meta)
    return output, len(tensors)


def load_mxfp4_experts(path, dtype: torch.dtype = torch.float32) -> dict:
    """Read an export back: {layer: (w1 [E, m, L], w3 [E, m, L], w2 [E, L, m])} dequantized to ``dtype``."""
    from safetensors.torch import load_file

    raw = load_file(str(path))
    parts: dict = {}
    for name, t in raw.items():
        m = _DST.match(name)
        if m is None:
            continue
        layer, e, which, kind = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        parts.setdefault(layer, {}).setdefault(which, {}).setdefault(e, {})[kind] = t
    result = {}
    for layer, by_w in sorted(parts.items()):
        ws = []
        for which in ("w1", "w3", "w2"):
            experts = by_w[which]
            ws.append(torch.stack([dequantize(experts[e]["scale"], experts[e]["packed"], "fp4_e2m1", 32, dtype)
                                   for e in range(len(experts))]))
        result[layer] = tuple(ws)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory (step_*) or checkpoint root")
    ap.add_argument("--output", default="experts-mxfp4.safetensors", help="output .safetensors file")
    ap.add_argument("--scale-mode", choices=("floor", "rceil"), default=None,
                    help="E8M0 scale rule (default: the checkpoint's quant.scale_mode, else floor)")
    args = ap.parse_args(argv)
    try:
        out, n = export_mxfp4(args.checkpoint, args.output, args.scale_mode)
    except (ValueError, ckpt.CheckpointError) as e:
        print(f"export_mxfp4: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} tensors to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
