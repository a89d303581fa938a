#!/usr/bin/env python
"""Export a megak3 trainer checkpoint to the Kimi-K3 Hugging Face format, and list the keys an export writes.

    python tools/convert_hf.py export runs/x/checkpoints hf/my-k3                 # experts MXFP4, rest bf16
    python tools/convert_hf.py export runs/x/checkpoints/step_00000200 hf/my-k3 --experts bf16 --shard-size-mb 2048
    python tools/convert_hf.py export CKPT OUT model=k3_tiny model.hidden_size=64  # when the run's config is unknown
    python tools/convert_hf.py --inventory model=k3_full                          # every key, shape, dtype + totals
    python -m megak3.train train.init_from_hf=hf/my-k3 ...                         # the import (any layout)

``export`` reads a per-shard trainer checkpoint (a ``step_XXXXXXXX`` directory or a root holding
``latest``) of ANY layout through :class:`megak3.checkpoint.reader.CheckpointReader` and writes
OUT_DIR with ``config.json`` (megak3/interop/hf_config.py), ``model-0000k-of-0000N.safetensors``
shards, ``model.safetensors.index.json`` and the run's ``tokenizer.json`` when one is found beside
the checkpoint or through its data config (``python -m megak3.generate --checkpoint OUT_DIR``
then works on the export). Names, padding and the per-expert split come from
megak3/interop/hf_names.py; routed experts are packed to MXFP4 (``weight_packed`` / ``weight_scale``)
with megak3.quant.mx, the quantizer of the QAT forward, so the export dequantizes to exactly the
weights a ``quant.qat=mxfp4_experts`` run computed with (scale rule: --scale-mode, default the
run's ``quant.scale_mode`` recorded in the checkpoint, else floor); ``quantization_config`` is
written only then. A checkpoint whose recorded ``quant.qat`` is not ``mxfp4_experts`` had its
experts trained unquantised: the export then prints one note with the measured relative change
of the packed experts (``||W_q - W|| / ||W||``, summed over every expert matrix) and points to
``--experts bf16``. Other tensors are bf16 (``--dtype fp32`` keeps the masters bit for bit); A_log,
dt_bias, the short-conv weights, the KDA o_norm and the router bias are always fp32.

Streaming: the shard layout is planned from shapes alone, then each shard file is written tensor
by tensor in slabs of at most 64 MiB of source data (one expert at a time for the packed experts),
with its safetensors header first; nothing holds a whole shard, let alone the model. The measured
peak resident-set growth is printed next to the shard size. Atomic: everything goes to
OUT_DIR.tmp, renamed to OUT_DIR at the end; on failure OUT_DIR.tmp is removed and OUT_DIR is never
created. The model config comes from the checkpoint's manifest (the trainer records it), or from
``model=NAME`` (+ ``model.FIELD=VALUE`` overrides), checked against every tensor's shape.

``--inventory`` builds the model on the meta device (no weights) and lists what an export of that
config would write. For ``model=k3_full`` with MXFP4 experts it prints 497,220 tensors and 247,296
packed/scale pairs (92 MoE layers x 896 experts x 3 projections), 1.561 TB: the same totals as the
released checkpoint (497,220 / 247,296, ~1.56 TB). 497,052 of them are text tensors (69 KDA layers
x 14 attention tensors, 24 MLA x 8, 93 x 6 norm/AttnRes, the dense FFN's 3, 92 MoE layers x
(8 + 896 x 6), 5 model-level) and 168 vision (27 blocks x 6 + patch embed, pos-emb, final norm,
3 projector tensors). One name differs from the release: megak3's projector norm sits on the
projector's input and is written ``mm_projector.pre_norm.weight`` where the release has an
output-side ``mm_projector.post_norm.weight`` (see megak3/interop/hf_names.py); its shape
differs too ([m*m*D] vs the text width), so it is a real architectural difference, not a naming one.

Bad input (missing directory, not a checkpoint, a model config that does not match the
checkpoint, an existing OUT_DIR, unknown --experts): one line on stderr, exit status 2, nothing written.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megak3.cli import Parser, error_exit  # noqa: E402
from megak3.config import load_model_config, model_config_from_dict  # noqa: E402
from megak3.interop.hf_config import to_hf_config  # noqa: E402
from megak3.interop.hf_names import (  # noqa: E402
    EXPERTS_FORMATS, HFTensor, canonical_shapes, hf_tensors, inventory_totals)
from megak3.interop.mxfp4_pack import pack_mxfp4, unpack_mxfp4  # noqa: E402
from megak3.metrics.telemetry import peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402
from megak3.checkpoint import atomic as ckpt  # noqa: E402

PUBLIC_TOTALS = {"tensors": 497_220, "mxfp4_pairs": 247_296}
"""the released Kimi-K3 checkpoint's key count and MXFP4 packed/scale pairs (92 x 896 x 3)"""
SLAB_BYTES = 64 << 20
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.uint8: "U8"}


def model_from_overrides(overrides) -> "ModelConfig":  # noqa: F821
    """``model=NAME model.a.b=V ...`` -> ModelConfig (ValueError for anything else)."""
    name, kw = None, {}
    for o in overrides:
        key, sep, val = o.partition("=")
        if not sep:
            raise ValueError(f"argument {o!r}: expected model=NAME or model.FIELD=VALUE")
        if key == "model":
            name = val
        elif key.startswith("model."):
            kw[key[len("model."):]] = val
        else:
            raise ValueError(f"argument {o!r}: only model=NAME and model.FIELD=VALUE overrides are accepted")
    if name is None:
        raise ValueError("give the model: model=NAME (conf/model/NAME.yaml), e.g. model=k3_full")
    return load_model_config(name, **kw)


# ---- inventory --------------------------------------------------------------------------------------
def inventory(cfg, experts: str = "mxfp4", dtype: str = "bf16") -> tuple:
    """(listing of HFTensor, totals) of an export of ``cfg`` (meta device, no weights)."""
    listing = hf_tensors(cfg, experts, DTYPES[dtype])
    return listing, inventory_totals(listing)


def print_inventory(listing, totals, cfg, out=None) -> None:
    out = out or sys.stdout
    for t in listing:
        print(f"{t.name}\t{list(t.shape)}\t{str(t.dtype).removeprefix('torch.')}", file=out)
    print(f"# model {cfg.name}: {totals['tensors']:,} tensors ({totals['text_tensors']:,} text, "
          f"{totals['vision_tensors']:,} vision), {totals['mxfp4_pairs']:,} MXFP4 packed/scale pairs, "
          f"{totals['bytes'] / 1e12:.4f} TB", file=out)
    if cfg.name == "k3_full":
        same = all(totals[k] == v for k, v in PUBLIC_TOTALS.items())
        print(f"# released Kimi-K3: {PUBLIC_TOTALS['tensors']:,} tensors, {PUBLIC_TOTALS['mxfp4_pairs']:,} pairs: "
              + ("identical counts (names: see the tool docstring for the one projector-norm difference)" if same
                 else "counts DIFFER (see the tool docstring)"), file=out)


# ---- export ----------------------------------------------------------------------------------------
def _resolve_checkpoint(path) -> Path:
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{path}: no such checkpoint directory")
    if not (p / ckpt.MANIFEST_NAME).exists():
        found = ckpt.find_latest(p)
        if found is None:
            raise ValueError(f"{path} is neither a checkpoint directory (step_XXXXXXXX) nor a root holding a "
                             "complete one")
        p = found
    return p


def _model_config(reader, overrides):
    if overrides:
        return model_from_overrides(overrides)
    saved = ((reader.meta or {}).get("config") or {}).get("model")
    if not saved:
        raise ValueError(f"checkpoint {reader.path} records no model config; pass model=NAME (and the "
                         "model.FIELD=VALUE overrides the run used)")
    return model_config_from_dict(saved)


def _check_model(reader, shapes: dict, cfg) -> None:
    have = {k[len("model/"):]: tuple(reader.global_shape(k)) for k in reader.keys() if k.startswith("model/")}
    if not have:
        raise ValueError(f"checkpoint {reader.path} holds no model tensors (model/*)")
    for n, s in shapes.items():
        if n not in have:
            raise ValueError(f"checkpoint {reader.path} lacks model tensor {n!r} of model '{cfg.name}'; pass the "
                             "model config the run used (model=NAME model.FIELD=VALUE ...)")
        if have[n] != s:
            raise ValueError(f"checkpoint tensor {n} has shape {list(have[n])}, model '{cfg.name}' needs {list(s)}; "
                             "pass the model config the run used")
    extra = sorted(set(have) - set(shapes))
    if extra:
        raise ValueError(f"checkpoint {reader.path} has model tensor {extra[0]!r} that model '{cfg.name}' lacks; "
                         "pass the model config the run used")


def _run_tokenizer(reader):
    """The tokenizer.json the run trained with (beside the checkpoint or through its data config, as
    generation finds it), or None."""
    from megak3.inference.loading import _tokenizer_for

    try:
        return Path(_tokenizer_for("megak3", Path(reader.path), (reader.meta or {}).get("config"), None).path)
    except ValueError:
        return None


def plan_shards(listing, shard_bytes: int) -> list:
    """Greedy, in listing order: a new shard starts when the next tensor would overflow (a tensor
    larger than the limit gets its own shard); an MXFP4 scale stays with its packed half."""
    shards, cur, size = [], [], 0
    for t in listing:
        if cur and size + t.nbytes > shard_bytes and t.kind != "scale":
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    if cur:
        shards.append(cur)
    return shards


class _Source:
    """Yields each HF tensor's bytes in slabs, read box by box from the trainer checkpoint."""

    def __init__(self, reader, scale_mode: str):
        self.reader, self.scale_mode = reader, scale_mode
        self._pair = None  # (canonical, expert) -> (packed, scale): the pair is packed once
        self.err_sq = self.ref_sq = 0.0  # sum |unpack(pack(W)) - W|^2 and |W|^2 over the packed experts
        self.packed_matrices = 0

    def rel_change(self) -> float:
        """||W_q - W|| / ||W|| (Frobenius, over every packed expert matrix together)."""
        return (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq > 0 else 0.0

    def _rows(self, key, prefix, rows, tail, out_dtype):
        """Slabs of rows of the box ``prefix + [r0, r0+n) + tail`` (fp32 <= SLAB_BYTES each)."""
        row_elems = 1
        for s in tail:
            row_elems *= s
        step = max(1, SLAB_BYTES // max(1, 4 * row_elems))
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            off = tuple(p for p, _ in prefix) + (r0,) + (0,) * len(tail)
            shp = tuple(s for _, s in prefix) + (n,) + tuple(tail)
            yield self.reader.read(key, off, shp).to(out_dtype)

    def chunks(self, t: HFTensor):
        key = f"model/{t.canonical}"
        gshape = self.reader.global_shape(key)
        if t.kind in ("plain", "conv2d"):       # conv2d: [D, C*p*p] rows are [D, C, p, p] rows, same bytes
            if len(gshape) == 0:
                yield self.reader.read(key, (), ()).to(t.dtype)
            else:
                yield from self._rows(key, (), gshape[0], gshape[1:], t.dtype)
        elif t.kind == "padded":
            v = self.reader.read(key, (0,), gshape).to(t.dtype)
            yield v
            yield torch.zeros(t.shape[0] - gshape[0], dtype=t.dtype)
        elif t.kind == "expert":
            yield from self._rows(key, ((t.expert, 1),), gshape[1], gshape[2:], t.dtype)
        else:  # packed / scale
            tag = (t.canonical, t.expert)
            if self._pair is None or self._pair[0] != tag:
                w = self.reader.read(key, (t.expert, 0, 0), (1,) + tuple(gshape[1:]))[0].float()
                self._pair = (tag, pack_mxfp4(w, self.scale_mode, name=t.name.rsplit(".", 1)[0]))
                self.err_sq += float((unpack_mxfp4(*self._pair[1]) - w).double().square().sum())
                self.ref_sq += float(w.double().square().sum())
                self.packed_matrices += 1
            packed, scale = self._pair[1]
            yield packed if t.kind == "packed" else scale
            if t.kind == "scale":
                self._pair = None


def write_shard(path: Path, tensors: list, source: _Source) -> int:
    """Write one safetensors file, streaming; returns its payload bytes."""
    header, off = {}, 0
    for t in tensors:
        header[t.name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for t in tensors:
            written = 0
            for c in source.chunks(t):
                if c.dtype != t.dtype:
                    raise AssertionError(f"{t.name}: produced {c.dtype}, planned {t.dtype}")
                a = c.contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(a.data)
                written += a.nbytes
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, planned {t.nbytes}")
        f.flush()
        os.fsync(f.fileno())
    return off


def export(checkpoint, out_dir, overrides=(), experts: str = "mxfp4", dtype: str = "bf16",
           shard_size_mb: float = 4096, scale_mode=None, log=print) -> dict:
    """Write the HF directory ``out_dir`` from the trainer checkpoint ``checkpoint`` (module docstring).
    Returns statistics: tensors, shards, bytes, peak_rss_growth, shard_bytes, seconds."""
    from megak3.checkpoint.reader import CheckpointReader

    if experts not in EXPERTS_FORMATS:
        raise ValueError(f"--experts {experts!r}: choose one of {', '.join(EXPERTS_FORMATS)}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if shard_size_mb <= 0:
        raise ValueError(f"--shard-size-mb {shard_size_mb} must be > 0")
    out = Path(out_dir)
    if out.exists():
        raise ValueError(f"{out} already exists; choose a new OUT_DIR (an export never overwrites)")
    try:
        reader = CheckpointReader(_resolve_checkpoint(checkpoint))
    except ckpt.CheckpointError as e:
        raise ValueError(str(e)) from None
    cfg = _model_config(reader, list(overrides))
    shapes = canonical_shapes(cfg)
    _check_model(reader, shapes, cfg)
    run_quant = ((reader.meta or {}).get("config") or {}).get("quant") or {}
    mode = scale_mode or run_quant.get("scale_mode") or "floor"
    listing = hf_tensors(cfg, experts, DTYPES[dtype], shapes=shapes)
    shard_bytes = int(shard_size_mb * 2 ** 20)
    shards = plan_shards(listing, shard_bytes)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # the leftover of an export that died
    t0 = time.perf_counter()
    rss0 = rss_bytes()
    can_reset = reset_peak_rss()
    try:
        tmp.mkdir(parents=True)
        source = _Source(reader, mode)
        weight_map, total = {}, 0
        for k, group in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            total += write_shard(tmp / fname, group, source)
            weight_map.update({t.name: fname for t in group})
        index = {"metadata": {"total_size": total, "source_checkpoint": str(reader.path), "step": reader.step,
                              "experts": experts, "scale_mode": mode}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        hf_cfg = to_hf_config(cfg, experts == "mxfp4", "bfloat16" if dtype == "bf16" else "float32")
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        tokenizer = _run_tokenizer(reader)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        peak = peak_rss_bytes()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    growth = max(0, peak - rss0) if can_reset else None
    largest = max(sum(t.nbytes for t in g) for g in shards)
    stats = {"tensors": len(listing), "shards": len(shards), "bytes": total, "shard_bytes": shard_bytes,
             "largest_shard_bytes": largest, "peak_rss_growth": growth, "seconds": time.perf_counter() - t0,
             "out": str(out), "scale_mode": mode,
             "experts_rel_change": source.rel_change() if source.packed_matrices else None}
    mib = 2 ** 20
    log(f"wrote {len(listing):,} tensors ({total / mib:,.1f} MiB) in {len(shards)} shard(s) to {out} "
        f"in {stats['seconds']:.1f} s")
    if tokenizer is None:
        log(f"note: no tokenizer.json found beside {reader.path} or through its data config; copy the run's "
            f"tokenizer into {out} to generate from the export")
    if growth is not None:
        log(f"peak RSS growth {growth / mib:,.1f} MiB = {growth / shard_bytes:.2f}x the shard size "
            f"({shard_bytes / mib:,.0f} MiB; largest shard written {largest / mib:,.1f} MiB)")
    qat = run_quant.get("qat")
    if source.packed_matrices and qat != "mxfp4_experts":
        log(f"note: the checkpoint was not trained with MXFP4 QAT (quant.qat={qat or 'not recorded'}), so its "
            f"routed experts were quantised to MXFP4 only now: they changed by {100 * source.rel_change():.2f}% "
            f"(||W_q - W|| / ||W|| over {source.packed_matrices:,} expert matrices); export with --experts bf16 "
            "to keep the trained weights")
    return stats


def main(argv=None) -> int:
    p = Parser(prog="convert_hf.py", description=__doc__.split("\n\n")[0],
               epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="*", metavar="ARG",
                   help="export CHECKPOINT_DIR OUT_DIR [model=NAME model.FIELD=VALUE ...] | with --inventory: "
                        "model=NAME [model.FIELD=VALUE ...]")
    p.add_argument("--inventory", action="store_true",
                   help="list every key, shape and dtype an export of the model would write, then the totals")
    p.add_argument("--experts", choices=EXPERTS_FORMATS, default="mxfp4",
                   help="routed experts as MXFP4 weight_packed/weight_scale (default) or plain --dtype weights")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                   help="dtype of the non-expert tensors (default bf16; fp32 keeps the masters exactly)")
    p.add_argument("--shard-size-mb", type=float, default=4096, help="target shard size in MiB (default 4096)")
    p.add_argument("--scale-mode", choices=("floor", "rceil"), default=None,
                   help="E8M0 scale rule of the MXFP4 packing (default: the run's quant.scale_mode, else floor)")
    a = p.parse_args(argv)
    try:
        if a.inventory:
            cfg = model_from_overrides(a.args)
            listing, totals = inventory(cfg, a.experts, a.dtype)
            print_inventory(listing, totals, cfg)
            return 0
        if not a.args or a.args[0] != "export" or len(a.args) < 3:
            p.error("expected: export CHECKPOINT_DIR OUT_DIR [model=NAME ...], or --inventory model=NAME")
        export(a.args[1], a.args[2], a.args[3:], a.experts, a.dtype, a.shard_size_mb, a.scale_mode)
    except Exception as e:  # noqa: BLE001 - any failure is reported as one line
        return error_exit(p.prog, e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
