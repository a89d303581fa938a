"""Image–text data: JSON-lines records -> indexed dataset + image side store -> packed rows with images.

Input format (``tools/preprocess_data.py --images``): JSON lines, one document per line::

    {"text": "<image>Two red circles.", "images": ["img/000.png"]}
    {"text": "Before <image> and after <image>, some text.", "images": ["a.jpg", "b.png"]}

``text`` holds one ``--image-marker`` (default ``<image>``) per entry of ``images``, in order;
relative image paths are resolved against the JSON file's directory. Why JSON lines rather than
WebDataset tar shards: the preprocessor reads the inputs once and writes a memory-mapped store
that training reads by random access, so the streaming-friendly layout of tar shards buys nothing
here; JSON lines interleave any number of images anywhere in a document with explicit placement
(a tar sample is one image + one caption unless a convention is invented on top), can be written
and inspected with any tool, match the LLaVA / OBELICS-style records users already have, and reuse
the text path's JSON reader and error messages. Images are files, so a corpus shares them freely
(each distinct one is stored once).

Each marker becomes exactly ``num_image_tokens(H, W)`` ``<|media|>`` ids (the vision tower's
arithmetic) for the image fitted by :func:`megak3.data.images.fit_to_grid`; an eos ends the
document. A record is skipped, whole, and counted by reason when its JSON is bad, its fields are
missing or of the wrong type, its marker count differs from its image count, or any of its images
is unusable (:data:`megak3.data.images.SKIP_REASONS`). Nothing in the inputs can crash the run;
an input with no usable record at all is one :class:`DataError` line.

Packing (:class:`VisionPackedDataset`) is the text packing of :mod:`megak3.data.packing` (same
epoch order, same labels, same document boundaries, same resumable :class:`Batcher` state) with
three additions: (1) a row never ends inside an image's slots: when it would, the row ends just
before the image, is padded, and the image starts the next row whole; (2) every label whose target
is a ``<|media|>`` slot is -100 (the model never predicts placeholders; the last slot of an image
predicts the text after it, as in LLaVA); (3) each row carries its images' pixels in slot order.
Because of (1), rows per epoch depend on the epoch's document order; the layout of an epoch is one
pass over its images (row starts, cached for two epochs like the document order).
"""
from __future__ import annotations

import json
import os
import time
from bisect import bisect_left, bisect_right
from collections import Counter
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from megak3.data.errors import DataError
from megak3.data.images import SKIP_REASONS as _IMAGE_SKIPS
from megak3.data.images import (DEFAULT_MAX_INPUT_PIXELS, DEFAULT_MAX_PIXELS, ImageSkip, ImageStore,
                                ImageStoreBuilder, fit_image, fit_to_grid, has_images)
from megak3.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from megak3.data.packing import IGNORE_INDEX, PackedDataset, Sample
from megak3.data.preprocessing import JSON_SUFFIXES, collect_input_files
from megak3.data.tokenizer import MIN_VOCAB, Tokenizer, load_tokenizer, train_bpe_tokenizer

DEFAULT_MARKER = "<image>"
RECORD_SKIPS = ("bad_json", "bad_record", "marker_mismatch", "empty_record")


# ---------------------------------------------------------------------------------------- preprocessing
def iter_records(files: Sequence[Path], text_key: str, image_key: str, counts: Counter):
    """Yield (jsonl path, line number, text, [image path]) of every well-formed record; count the others."""
    for f in files:
        if f.suffix.lower() not in JSON_SUFFIXES:
            counts["skipped_files"] += 1
            continue
        raw = f.read_bytes()
        for lineno, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                counts["bad_json"] += 1
                continue
            imgs = obj.get(image_key, []) if isinstance(obj, dict) else None
            if (not isinstance(obj, dict) or not isinstance(obj.get(text_key), str) or not isinstance(imgs, list)
                    or not all(isinstance(p, str) for p in imgs)):
                counts["bad_record"] += 1
                continue
            yield f, lineno, obj[text_key], [str(Path(p) if os.path.isabs(p) else f.parent / p) for p in imgs]


def preprocess_image_text(inputs, output_prefix, tokenizer_path=None, train_tokenizer: bool = False,
                          vocab_size: int = 8192, text_key: str = "text", image_key: str = "images",
                          marker: str = DEFAULT_MARKER, patch_size: int = 14, merge: int = 2,
                          max_pixels: int = DEFAULT_MAX_PIXELS, max_input_pixels: int = DEFAULT_MAX_INPUT_PIXELS,
                          odd_modes: str = "convert", append_eos: bool = True, progress: bool = False) -> dict:
    """Image–text JSON lines -> ``output_prefix.{bin,idx}`` + ``output_prefix.img.{bin,idx}``; returns stats.

    Exactly one of ``tokenizer_path`` and ``train_tokenizer`` (a byte-level BPE trained on the
    record texts with the markers removed, saved as tokenizer.json beside the output).
    """
    t0 = time.perf_counter()
    output_prefix = str(Path(output_prefix).expanduser())
    if (tokenizer_path is None) == (not train_tokenizer):
        raise DataError("give exactly one of --tokenizer PATH and --train-tokenizer --vocab-size N")
    if not marker:
        raise DataError("--image-marker is empty; give the string that marks an image in the text")
    if odd_modes not in ("convert", "skip"):
        raise DataError(f"--odd-modes={odd_modes} must be 'convert' or 'skip'")
    if patch_size < 1 or merge < 1:
        raise DataError(f"--patch-size={patch_size} and --merge={merge} must be >= 1")
    side = patch_size * merge
    fit_to_grid(side, side, side, max_pixels)  # a max_pixels below one merged patch fails here
    files = collect_input_files(inputs)
    if not files:
        raise DataError(f"--input {list(map(str, inputs))}: no input files found")
    if not any(f.suffix.lower() in JSON_SUFFIXES for f in files):
        raise DataError(f"--input {list(map(str, inputs))}: no .jsonl/.json file; image-text records are JSON "
                        f'lines like {{"text": "{marker} a caption", "images": ["a.png"]}}')
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    counts: Counter = Counter()
    if train_tokenizer:
        if vocab_size < MIN_VOCAB:
            raise DataError(f"--vocab-size={vocab_size} must be >= {MIN_VOCAB}")
        texts = (t.replace(marker, " ") for _, _, t, _ in iter_records(files, text_key, image_key, Counter()))
        final = Path(output_prefix).parent / "tokenizer.json"
        new = final.with_name(f"tokenizer.json.new-{os.getpid()}")
        train_bpe_tokenizer(texts, vocab_size, new)
        if final.exists() and final.read_bytes() != new.read_bytes():
            new.unlink()
            raise DataError(f"{final} already exists and differs from the tokenizer trained now; reuse it "
                            "with --tokenizer, delete it, or write to another output directory")
        os.replace(new, final)
        tokenizer_path = final
    tok: Tokenizer = load_tokenizer(tokenizer_path)
    stats = dict(records=0, docs=0, tokens=0, vision_tokens=0, image_refs=0)
    builder = IndexedDatasetBuilder(output_prefix, best_dtype(tok.vocab_size))
    store = ImageStoreBuilder(output_prefix, side)
    try:
        for f, lineno, text, paths in iter_records(files, text_key, image_key, counts):
            stats["records"] += 1
            parts = text.split(marker)
            if len(parts) - 1 != len(paths):
                counts["marker_mismatch"] += 1
                continue
            if not paths and not text.strip():
                counts["empty_record"] += 1
                continue
            try:
                fitted = [fit_image(p, side, max_pixels, max_input_pixels, odd_modes, counts) for p in paths]
            except ImageSkip as e:
                counts[e.reason] += 1
                continue
            ids: List[int] = []
            refs = []
            for i, part in enumerate(parts):
                if part:
                    ids += tok.encode(part)
                if i < len(fitted):
                    arr, key = fitted[i]
                    n = (arr.shape[0] // side) * (arr.shape[1] // side)
                    refs.append((store.add_image(arr, key), len(ids)))
                    ids += [tok.media_id] * n
                    stats["vision_tokens"] += n
            if append_eos:
                ids.append(tok.eos_id)
            builder.add_document(np.asarray(ids, dtype=np.int64))
            store.add_document(refs)
            stats["docs"] += 1
            stats["tokens"] += len(ids)
            stats["image_refs"] += len(refs)
        if stats["docs"] == 0:
            raise DataError(f"--input {list(map(str, inputs))}: no usable image-text record ("
                            + (", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "no records") + ")")
        builder.finalize()
        store.finalize()
    except BaseException:
        builder.abort()
        store.abort()
        raise
    stats.update(counts)
    stats.update(prefix=output_prefix, tokenizer=str(tokenizer_path), vocab_size=tok.vocab_size, side=side,
                 images=store.num_images, skipped_records=sum(counts[k] for k in RECORD_SKIPS + _IMAGE_SKIPS),
                 seconds=time.perf_counter() - t0)
    return stats


def format_image_stats(stats: dict) -> str:
    """One summary line: what was written and every skip reason with its count."""
    skips = {k: stats[k] for k in RECORD_SKIPS + _IMAGE_SKIPS if stats.get(k)}
    conv = {k[len("converted_"):]: v for k, v in stats.items() if k.startswith("converted_")}
    return (f"{stats['prefix']}: {stats['docs']} docs of {stats['records']} records, {stats['tokens']} tokens "
            f"({stats['vision_tokens']} vision), {stats['images']} images stored for {stats['image_refs']} "
            f"references, skipped {stats['skipped_records']} records"
            + (f" ({', '.join(f'{k} {v}' for k, v in skips.items())})" if skips else "")
            + (f", converted modes {conv}" if conv else "") + f", {stats['seconds']:.1f} s, vocab {stats['vocab_size']}")


# ---------------------------------------------------------------------------------------------- packing
class VisionPackedDataset(PackedDataset):
    """Packed rows of an image–text dataset (see the module docstring); ``sample`` adds ``images``.

    ``image_control`` (the control arms of tools/vision_ablation.py; slots and text unchanged):
    "real" (default); "noise": every image's pixels replaced by uniform noise of the same size,
    seeded by the image id; "shuffle": every image replaced by another stored image of the same
    size (a fixed derangement within each size), so pixel statistics stay real and only the
    pairing with the text is broken.
    """

    def __init__(self, dataset: IndexedDataset, store: ImageStore, seq_len: int, split: str = "train",
                 valid_fraction: float = 0.02, seed: int = 1234, pad_id: int = 0, media_id: int = 3,
                 image_control: str = "real"):
        super().__init__(dataset, seq_len, split, valid_fraction, seed, pad_id)
        if store.num_docs != len(dataset):
            raise DataError(f"{store.idx_path} describes {store.num_docs} documents but {dataset.idx_path} has "
                            f"{len(dataset)}: the image store belongs to another dataset; rebuild both")
        if image_control not in ("real", "noise", "shuffle"):
            raise ValueError(f"image_control={image_control!r} must be 'real', 'noise' or 'shuffle'")
        self.store, self.media_id, self.image_control = store, media_id, image_control
        self._swap = None
        if image_control == "shuffle":  # image id -> another image of the same size
            self._swap = np.arange(len(store))
            hw = np.asarray(store.images[:, 1:]) if len(store) else np.zeros((0, 2), np.int64)
            for size in np.unique(hw, axis=0):
                same = np.flatnonzero((hw == size).all(1))
                perm = np.random.default_rng([seed, 11, int(size[0]), int(size[1])]).permutation(same)
                self._swap[perm] = np.roll(perm, 1)
        ids = np.asarray(store.refs[:, 0]) if len(store.refs) else np.zeros(0, np.int64)
        self._ref_tokens = store.tokens_of(ids) if len(ids) else np.zeros(0, np.int64)
        if len(ids) and int(self._ref_tokens.max()) > seq_len:
            raise DataError(f"an image of {store.prefix} needs {int(self._ref_tokens.max())} vision tokens but "
                            f"data.seq_len={seq_len}: an image must fit one row; raise data.seq_len or "
                            "re-preprocess with a smaller --max-pixels")
        self._layouts: Dict[int, tuple] = {}

    def _layout(self, epoch: int):
        """(row starts, row ends, image-run stream starts, image ids) of ``epoch`` (cached for 2 epochs)."""
        if epoch in self._layouts:
            return self._layouts[epoch]
        order, cum = self._epoch(epoch)
        st = self.store
        lo, hi = np.asarray(st.doc_refs[order]), np.asarray(st.doc_refs[order + 1])
        cnt = hi - lo
        first = np.repeat(lo - (np.cumsum(cnt) - cnt), cnt)  # ref index = first + running position
        ref = first + np.arange(int(cnt.sum()), dtype=np.int64)
        run_start = cum[np.repeat(np.arange(len(order)), cnt)] + np.asarray(st.refs[ref, 1])
        run_end = run_start + self._ref_tokens[ref]
        rs, re_ = run_start.tolist(), run_end.tolist()
        T, S = self.seq_len, self.num_tokens
        starts, ends, s = [], [], 0
        while s < S:
            e = min(s + T, S)
            j = bisect_right(rs, e - 1) - 1  # last image starting inside the row
            if j >= 0 and re_[j] > e:  # it would straddle the row end: move it whole to the next row
                e = rs[j]
            starts.append(s)
            ends.append(e)
            s = e
        out = (starts, ends, rs, np.asarray(st.refs[ref, 0]))
        if len(self._layouts) >= 2:
            self._layouts.pop(min(self._layouts))
        self._layouts[epoch] = out
        return out

    def samples_in_epoch(self, epoch: int) -> int:
        return len(self._layout(epoch)[0])

    def __len__(self) -> int:
        """Rows of epoch 0 (other epochs differ by the padding before moved images)."""
        return self.samples_in_epoch(0)

    def image_pixels(self, image_id: int) -> np.ndarray:
        if self._swap is not None:
            image_id = self._swap[int(image_id)]
        img = self.store.image(int(image_id))
        if self.image_control == "noise":
            return np.random.default_rng([self.seed, 7, int(image_id)]).integers(0, 256, img.shape, dtype=np.uint8)
        return img

    def sample(self, index: int, epoch: int = 0) -> Sample:
        starts, ends, rs, image_ids = self._layout(epoch)
        if not 0 <= index < len(starts):
            raise IndexError(f"sample {index} out of range for {len(starts)} samples in epoch {epoch}")
        s, e = starts[index], ends[index]
        row = self.fill_row(epoch, s, e)
        row.labels[row.labels == self.media_id] = IGNORE_INDEX
        a, b = bisect_left(rs, s), bisect_left(rs, e)
        row.images = [self.image_pixels(i) for i in image_ids[a:b]]
        row.vision_tokens = int((row.input_ids == self.media_id).sum())
        return row


def check_model_fits_images(what: str, side: int, tokenizer: Tokenizer, model_cfg, no_images: str,
                            rebuild: str) -> None:
    """Raise :class:`DataError` unless the model can read the images of dataset ``what`` (fitted to
    ``side`` = patch*merge pixels): its vision tower is on with the same patch*merge and its media
    placeholder is the tokenizer's ``<|media|>`` id. ``no_images`` / ``rebuild`` name the fixes on the
    data side (the alternative to enabling the tower; the command that re-fits the images)."""
    v = model_cfg.vision
    if not v.enabled:
        raise DataError(f"{what} holds images but model.vision.enabled=false; enable the vision tower or "
                        f"{no_images}")
    if v.patch_size * v.merge != side:
        raise DataError(f"{what} was fitted to patch*merge={side} pixels but the model has "
                        f"model.vision.patch_size*merge={v.patch_size * v.merge}; {rebuild} with "
                        f"--patch-size {v.patch_size} --merge {v.merge}")
    if model_cfg.media_placeholder_token_id != tokenizer.media_id:
        raise DataError(f"tokenizer {tokenizer.path} puts <|media|> at id {tokenizer.media_id} but "
                        f"model.media_placeholder_token_id={model_cfg.media_placeholder_token_id}")


def open_split(prefix, seq_len: int, split: str, valid_fraction: float, seed: int, tokenizer: Tokenizer,
               model_cfg=None, image_control: str = "real") -> PackedDataset:
    """The packed ``split`` of dataset ``prefix``: :class:`VisionPackedDataset` when it has an image
    store (checked against the model's vision settings), else the text :class:`PackedDataset`."""
    dataset = IndexedDataset(prefix)
    if not has_images(prefix):
        return PackedDataset(dataset, seq_len, split, valid_fraction, seed, tokenizer.pad_id)
    store = ImageStore(prefix)
    if model_cfg is not None:
        check_model_fits_images(f"dataset {prefix}", store.side, tokenizer, model_cfg, "use a text dataset",
                                "re-preprocess")
    return VisionPackedDataset(dataset, store, seq_len, split, valid_fraction, seed, tokenizer.pad_id,
                               tokenizer.media_id, image_control)
