#!/usr/bin/env python
"""Convert an old per-rank-part megak3 checkpoint to the per-shard format (megak3.checkpoint.writer).

    python tools/convert_checkpoint.py runs/x/checkpoints/step_00000100 runs/x/checkpoints_v2

The old checkpoint (``rank_XXXXX.pt`` parts + ``state.pt``; or a root whose newest complete checkpoint
is taken) is loaded and merged into full tensors with megak3.checkpoint.legacy.merge_parts, then
written as a one-rank checkpoint of the same step under OUT_ROOT with

    model/<name>           every model tensor, whole (offsets 0)
    optim/<name>/<key>     every optimizer state tensor with ndim > 0, whole
    objects                {"optim_meta": {name: {"optimizer": kind, "hyperparameters": {...},
                                                  "scalars": {key: value}}}}   (non-tensor / 0-dim state)
    common                 the old state.pt dict unchanged (step, train_data, rng, world_size, layout)
    meta                   the old manifest's meta

It refuses to write over an existing OUT_ROOT/step_XXXXXXXX and prints the new checkpoint's path.
Errors: one line on stderr, exit status 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megak3.cli import Parser, error_exit  # noqa: E402
from megak3.checkpoint import atomic as ckpt  # noqa: E402
from megak3.checkpoint import legacy  # noqa: E402
from megak3.checkpoint.shard_format import SHARDS_FORMAT  # noqa: E402
from megak3.checkpoint.writer import ShardedCheckpointer, ShardEntry  # noqa: E402


def convert(src, out_root) -> Path:
    """Convert the old-format checkpoint ``src`` (a step dir, or a root holding one) into ``out_root``;
    returns the new checkpoint's directory."""
    path = Path(src)
    if not (path / ckpt.MANIFEST_NAME).exists():
        found = ckpt.find_latest(path)
        if found is None:
            raise ValueError(f"{path} is neither a checkpoint directory nor a root holding a complete one")
        path = found
    manifest = ckpt.read_manifest(path)
    if manifest.get("format") == SHARDS_FORMAT:
        raise ValueError(f"{path} is already in the {SHARDS_FORMAT} format")
    common, manifest = legacy.load_checkpoint(path)
    names = sorted(n for n in manifest["files"] if n.startswith("rank_") and n.endswith(".pt"))
    if not names:
        raise ValueError(f"{path} holds no rank_XXXXX.pt parts; it is not a per-rank part checkpoint")
    parts = [legacy.load_part(path, n) for n in names]
    full_model, full_optim = legacy.merge_parts(parts)

    entries: dict = {}
    for name, t in full_model.items():
        entries[f"model/{name}"] = ShardEntry(t, tuple(t.shape), (0,) * t.ndim)
    optim_meta: dict = {}
    for name, st in full_optim["state"].items():
        scalars = {}
        for key, v in st.items():
            if torch.is_tensor(v) and v.ndim > 0:
                entries[f"optim/{name}/{key}"] = ShardEntry(v, tuple(v.shape), (0,) * v.ndim)
            else:
                scalars[key] = v
        optim_meta[name] = {"optimizer": full_optim["optimizer"][name],
                            "hyperparameters": full_optim["hyperparameters"][name], "scalars": scalars}
    step = int(manifest["step"])
    out_root = Path(out_root)
    if (out_root / ckpt.step_dirname(step)).exists():  # never replace a checkpoint (e.g. the source)
        raise ValueError(f"{out_root / ckpt.step_dirname(step)} already exists; choose another out_root")
    ShardedCheckpointer(out_root, rank=0, world_size=1).save(
        step, entries, objects={"optim_meta": optim_meta}, common=common, meta=manifest.get("meta") or {})
    return out_root / ckpt.step_dirname(step)


def main(argv=None) -> int:
    p = Parser(description="Convert an old per-rank-part megak3 checkpoint (rank_XXXXX.pt files) into a "
                            "one-rank per-shard checkpoint (megak3.shards.v1) readable by any layout.")
    p.add_argument("checkpoint", help="old-format checkpoint directory (step_XXXXXXXX), or a checkpoint root: "
                                      "its newest complete checkpoint is converted")
    p.add_argument("out_root", help="checkpoint root to write into; the converted checkpoint becomes "
                                    "OUT_ROOT/step_XXXXXXXX (same step) and OUT_ROOT/latest points at it")
    args = p.parse_args(argv)
    try:
        out = convert(args.checkpoint, args.out_root)
    except Exception as e:  # noqa: BLE001 - any failure is reported as one line
        return error_exit(p.prog, e)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
