"""Import a Kimi-K3 Hugging Face checkpoint into a (parallelized) megak3 model: ``train.init_from_hf``.

:func:`load_hf_into` runs on every rank right after ``materialize`` (megak3/train/step.py), before
the optimizer copies the masters. For every tensor this rank holds it takes the box the plan gives
(``plan.tensors[name]``: global shape, offsets, local shape; any tp/ep/pp layout) and reads only
that box from the safetensors shards, through ``safe_open(file).get_slice(name)[box]`` (memory
mapped: the bytes outside the box are never touched). Shards are visited in the index's order,
each opened once. MXFP4 experts (``weight_packed`` / ``weight_scale``) are read for the
32-aligned input range that covers the box and dequantized to the master dtype (fp32).

Before reading anything every key of the index is resolved through :mod:`hf_names` (legacy
spellings accepted) and the config.json, when present, is compared with the model config
(:func:`hf_config.compare_configs`). Errors are one-line ``ValueError``s naming the field and the
key: a directory without an index or ``model.safetensors``, a shard file the index names but that
is missing, an unknown key, a missing key, a shape mismatch, an unsupported dtype, a non-zero
padding. ``vision_tower.*`` / ``mm_projector.*`` keys are skipped (and counted) when the model has
no vision tower, so a release imports into a text-only model.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .hf_config import compare_configs, from_hf_config
from .hf_names import MXFP4_BLOCK, HFTensor, canonical_shapes, from_hf_name, hf_tensors, is_vision_name
from .mxfp4_pack import unpack_mxfp4

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FIELD = "train.init_from_hf"
_FLOAT_DTYPES = {"F64", "F32", "BF16", "F16"}


def check_hf_dir(path, field: str = FIELD) -> Path:
    """The directory ``path`` if it holds an HF checkpoint (an index or a single
    ``model.safetensors``); a one-line ValueError naming ``field`` otherwise."""
    p = Path(str(path)).expanduser()
    if not p.is_dir():
        raise ValueError(f"{field}={path}: no such directory; give a Hugging Face checkpoint directory "
                         f"(with {INDEX_NAME} or {SINGLE_NAME})")
    if not (p / INDEX_NAME).is_file() and not (p / SINGLE_NAME).is_file():
        raise ValueError(f"{field}={path}: neither {INDEX_NAME} nor {SINGLE_NAME} is there; not a Hugging Face "
                         "checkpoint directory")
    return p


def read_weight_map(d: Path, field: str = FIELD) -> dict:
    """{HF tensor name: shard file name} of the checkpoint directory ``d`` (checked by check_hf_dir);
    every shard the index names must exist."""
    if (d / INDEX_NAME).is_file():
        try:
            wm = json.loads((d / INDEX_NAME).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{field}: {d / INDEX_NAME} is not a safetensors index ({type(e).__name__}: {e})") from None
    else:
        from safetensors import safe_open

        with safe_open(str(d / SINGLE_NAME), framework="pt") as f:
            wm = {k: SINGLE_NAME for k in f.keys()}
    for name, file in wm.items():
        if not (d / file).is_file():
            raise ValueError(f"{field}: shard {file} (holding {name!r}) is missing from {d}")
    return wm


def _read_config(d: Path, field: str):
    p = d / "config.json"
    if not p.is_file():
        return None
    try:
        return from_hf_config(json.loads(p.read_text()))
    except ValueError as e:
        raise ValueError(f"{field}: {p}: {e}") from None


def _resolve(wm: dict, cfg, listing: list, field: str) -> tuple:
    """(target -> HF name, skipped vision keys); target = (canonical, expert, part). Checks for unknown,
    duplicate and missing keys."""
    by_target, skipped = {}, []
    for name in wm:
        r = from_hf_name(name, cfg)
        if r is None:
            if is_vision_name(name) and not cfg.vision.enabled:
                skipped.append(name)
                continue
            raise ValueError(f"{field}: unknown key {name!r} (in {wm[name]}): no megak3 tensor of model "
                             f"'{cfg.name}' has that name")
        target = (r.canonical, r.expert, r.part)
        if target in by_target:
            raise ValueError(f"{field}: keys {by_target[target]!r} and {name!r} name the same tensor")
        by_target[target] = name
    for t in listing:
        if t.kind == "expert":
            plain = (t.canonical, t.expert, "weight") in by_target
            packed = [(t.canonical, t.expert, p) in by_target for p in ("weight_packed", "weight_scale")]
            if not plain and not all(packed):
                base = t.name.rsplit(".", 1)[0]
                what = f"{base}.weight_scale" if packed[0] else (f"{base}.weight_packed" if packed[1] else t.name)
                raise ValueError(f"{field}: missing key {what!r} (model '{cfg.name}' needs it)")
            if plain and any(packed):
                raise ValueError(f"{field}: {t.name!r} is stored both plain and MXFP4-packed")
        elif (t.canonical, None, None) not in by_target:
            raise ValueError(f"{field}: missing key {t.name!r} (model '{cfg.name}' needs it)")
    return by_target, skipped


class _Reader:
    """Open shard files on demand (one safe_open per file, kept until close) and read boxes."""

    def __init__(self, d: Path, wm: dict, field: str):
        self.d, self.wm, self.field = d, wm, field
        self.files: dict = {}
        self.opened = 0
        self.bytes_read = 0

    def slice(self, name: str, want_shape: tuple, want_dtypes=None):
        from safetensors import safe_open

        file = self.wm[name]
        if file not in self.files:
            self.files[file] = safe_open(str(self.d / file), framework="pt")
            self.opened += 1
        sl = self.files[file].get_slice(name)
        shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
        if shape != tuple(want_shape):
            raise ValueError(f"{self.field}: {name!r} has shape {list(shape)} in {file}; model needs "
                             f"{list(want_shape)}")
        ok = want_dtypes or _FLOAT_DTYPES
        if dtype not in ok:
            raise ValueError(f"{self.field}: {name!r} is {dtype} in {file}; expected one of {sorted(ok)}")
        return sl

    def read(self, sl, box) -> torch.Tensor:
        t = sl[box]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self):
        self.files.clear()


def _box(offsets, shape):
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape))


def _load_tensor(rd: _Reader, t: HFTensor, by_target: dict, dst: torch.Tensor, offsets, shape, pads) -> None:
    """Fill ``dst`` (this rank's box ``offsets``/``shape`` of canonical tensor ``t.canonical``)."""
    if t.kind == "expert":  # t is expert t.expert of the bf16 listing; the file may hold it packed
        e0 = offsets[0]
        e = t.expert
        if not e0 <= e < e0 + shape[0]:
            return
        O, I = t.shape
        rows, (i0, ni) = slice(offsets[1], offsets[1] + shape[1]), (offsets[2], shape[2])
        plain = by_target.get((t.canonical, e, "weight"))
        if plain is not None:
            val = rd.read(rd.slice(plain, (O, I)), (rows, slice(i0, i0 + ni)))
        else:
            a = i0 // MXFP4_BLOCK * MXFP4_BLOCK                       # 32-aligned cover of [i0, i0 + ni)
            b = -(-(i0 + ni) // MXFP4_BLOCK) * MXFP4_BLOCK
            pk_name, sc_name = by_target[(t.canonical, e, "weight_packed")], by_target[(t.canonical, e, "weight_scale")]
            pk = rd.read(rd.slice(pk_name, (O, I // 2), {"U8"}), (rows, slice(a // 2, b // 2)))
            sc = rd.read(rd.slice(sc_name, (O, I // MXFP4_BLOCK), {"U8"}),
                         (rows, slice(a // MXFP4_BLOCK, b // MXFP4_BLOCK)))
            try:
                val = unpack_mxfp4(pk, sc, torch.float32, name=pk_name.rsplit(".", 1)[0])[:, i0 - a:i0 - a + ni]
            except ValueError as err:
                raise ValueError(f"{rd.field}: {err}") from None
        dst[e - e0].copy_(val)
        return
    name = by_target[(t.canonical, None, None)]
    sl = rd.slice(name, t.shape)
    if t.kind == "conv2d":  # [D, C, p, p] on disk, [D, C*p*p] in megak3
        val = rd.read(sl, (slice(offsets[0], offsets[0] + shape[0]),)).reshape(shape[0], -1)
        val = val[:, offsets[1]:offsets[1] + shape[1]]
    else:
        val = rd.read(sl, _box(offsets, shape))
        if t.kind == "padded" and offsets[0] == 0:  # the rank holding the first box checks the padding
            live = pads
            tail = rd.read(sl, (slice(live, t.shape[0]),))
            if bool((tail != 0).any()):
                raise ValueError(f"{rd.field}: {name!r} is stored padded to {t.shape[0]} but entries {live}.."
                                 f"{t.shape[0] - 1} are not zero (model has {live} heads)")
    dst.copy_(val)


@torch.no_grad()
def load_hf_into(model: nn.Module, plan, path, cfg=None, field: str = FIELD) -> dict:
    """Overwrite every tensor ``model`` holds with its box of the HF checkpoint at ``path``.

    ``plan``: the rank's :class:`parallel.plan.ParallelPlan` (None: a single-process model, whole
    tensors). ``cfg``: the model's ModelConfig (default ``model.config``). Returns statistics:
    ``tensors`` (local tensors filled), ``bytes_read`` (payload bytes read by this rank),
    ``files`` (shards opened), ``skipped`` (vision keys ignored), ``notes`` (config differences
    that do not change tensors). Raises a one-line ValueError for malformed input (module docstring).
    """
    from parallel.plan import canonical_name

    cfg = cfg or model.config
    d = check_hf_dir(path, field)
    wm = read_weight_map(d, field)
    notes = []
    hf_cfg = _read_config(d, field)
    if hf_cfg is not None:
        notes = compare_configs(hf_cfg, cfg)
    shapes = canonical_shapes(cfg)
    listing = hf_tensors(cfg, "bf16", shapes=shapes)
    by_target, skipped = _resolve(wm, cfg, listing, field)
    per_canonical = defaultdict(list)
    for t in listing:
        per_canonical[t.canonical].append(t)
    live = cfg.kda.num_heads
    own = {canonical_name(k): v for k, v in model.state_dict().items()}
    # visit shards in index order: a shard's mapping is opened once and read while it is warm
    order = {f: i for i, f in enumerate(dict.fromkeys(wm.values()))}
    first = {}
    for (c, _, _), name in by_target.items():
        first[c] = min(first.get(c, len(order)), order[wm[name]])
    rd = _Reader(d, wm, field)
    try:
        for n in sorted(own, key=lambda n: first.get(n, 0)):
            dst = own[n]
            if plan is not None:
                sh = plan.tensors[n]
                offsets, shape = sh.offsets, sh.local_shape
                if tuple(shapes[n]) != tuple(sh.global_shape):
                    raise AssertionError(f"{n}: plan global shape {sh.global_shape} != model {shapes[n]}")
            else:
                offsets, shape = (0,) * dst.dim(), tuple(dst.shape)
            for t in per_canonical[n]:
                _load_tensor(rd, t, by_target, dst, offsets, shape, live)
    finally:
        rd.close()
    return {"tensors": len(own), "bytes_read": rd.bytes_read, "files": rd.opened,
            "skipped": skipped, "notes": notes}
