"""SFT data: chat JSON lines -> an indexed dataset plus a loss mask -> packed rows of whole conversations.

On disk an SFT dataset is an ordinary indexed dataset (``prefix.bin/.idx``: one document per
conversation, the ids of :func:`megak3.data.chat.encode_chat`) and a twin ``prefix.mask``
indexed dataset of the same document lengths holding 1 where a token is trained on (assistant
content and its closing eos), 0 elsewhere. The twin is what makes ``data.path=PREFIX`` train as SFT:
the trainer opens it with :func:`open_sft_split` when :func:`is_sft_dataset` finds it.

Preprocess your own chat data with the tokenizer of the model you fine-tune::

    python -m megak3.data.sft --input chats.jsonl --output-prefix data/sft/chat \\
        --tokenizer runs/pretrain/tokenizer.json

Images (``"images": [...]`` on a message, paths relative to the JSON-lines file): each image is fitted to the
vision tower's grid (:func:`megak3.data.images.fit_to_grid`, ``--patch-size``/``--merge``/``--max-pixels``) and
stored in the image side store ``prefix.img.{bin,idx}`` of :mod:`megak3.data.images` (one document per
conversation, each image's first slot offset); the chat template puts its ``num_image_tokens`` ``<|media|>``
ids after the message's role header (mask 0). A packed row carries the pixels of its conversations' images in
slot order (``Sample.images``), which the trainer's image-text path feeds to the vision tower. An unreadable
image is a one-line error naming the file; a conversation with images longer than ``data.seq_len`` is refused
(its slots would be cut from its pixels).

Packing (:class:`SFTPackedDataset`): per epoch the split's conversations are shuffled (seeded by
``(seed, epoch)``) and laid into rows of ``T`` tokens greedily, whole conversations only: a
conversation that does not fit in the rest of a row starts the next row, one longer than ``T`` is
cut to its first ``T`` tokens (counted in ``truncated``). Each conversation is its own segment of
``cu_seqlens``; the unused tail of a row is padding with ignored labels. ``labels[j]`` is
``ids[j+1]`` where ``mask[j+1] == 1`` and -100 otherwise, so the loss covers assistant tokens only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Tuple

import numpy as np

from megak3.data.chat import ChatFormatError, check_messages, conversation_images, encode_chat
from megak3.data.errors import DataError
from megak3.data.images import ImageStore, fit_image, has_images
from megak3.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from megak3.data.packing import IGNORE_INDEX, Sample, split_documents
from megak3.data.vision_dataset import check_model_fits_images

MASK_SUFFIX = ".mask"


def is_sft_dataset(prefix) -> bool:
    """True when ``prefix`` has the SFT loss-mask twin ``prefix.mask.idx``."""
    return os.path.isfile(str(prefix) + MASK_SUFFIX + ".idx")


def read_conversations(paths: Iterable) -> Iterator[List[dict]]:
    """The ``messages`` list of every line of the given JSON-lines files (blank lines skipped)."""
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"--input {path}: no such file; give chat JSON-lines files")
        with open(p) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{p}:{n}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not JSON ({e.msg}); each line must be "
                                    '{"messages": [{"role": ..., "content": ...}, ...]}') from None
                try:
                    msgs = check_messages(obj.get("messages") if isinstance(obj, dict) else None, where)
                except ChatFormatError as e:
                    raise DataError(str(e)) from None
                for m in msgs:  # image paths relative to the JSON-lines file
                    if "images" in m:
                        m["images"] = [q if os.path.isabs(q) else str(p.parent / q) for q in m["images"]]
                yield msgs


def write_sft_dataset(conversations: Iterable[List[dict]], prefix, tokenizer, patch_size: int = 14, merge: int = 2,
                      max_pixels: int = 0) -> Dict[str, int]:
    """Encode ``conversations`` with the chat template into ``prefix`` (+ its mask twin, + the image side
    store when a conversation has images: fitted to multiples of ``patch_size * merge`` pixels, at most
    ``max_pixels``, 0: the data pipeline's default); return counts."""
    from megak3.data.images import DEFAULT_MAX_PIXELS, ImageSkip, ImageStoreBuilder

    side = patch_size * merge
    max_pixels = max_pixels or DEFAULT_MAX_PIXELS
    dtype = best_dtype(tokenizer.vocab_size)
    stats = dict(conversations=0, tokens=0, trained_tokens=0, images=0, vision_tokens=0)
    store = None
    try:
        with IndexedDatasetBuilder(prefix, dtype) as ids_b, IndexedDatasetBuilder(str(prefix) + MASK_SUFFIX,
                                                                                   np.uint16) as mask_b:
            for msgs in conversations:
                fitted = []
                for path in conversation_images(msgs):
                    try:
                        fitted.append(fit_image(path, side, max_pixels))
                    except ImageSkip as e:
                        raise DataError(f"image {path}: {e}; fix or remove it") from None
                ids, mask = encode_chat(tokenizer, msgs, [(a.shape[0] // side) * (a.shape[1] // side)
                                                          for a, _ in fitted])
                if fitted and store is None:  # the side store starts with the first image: earlier docs have none
                    store = ImageStoreBuilder(prefix, side)
                    for _ in range(stats["conversations"]):
                        store.add_document([])
                if store is not None:
                    refs, pos = [], 0
                    for arr, key in fitted:  # each image's first slot: the next unclaimed <|media|> id
                        pos = ids.index(tokenizer.media_id, pos)
                        refs.append((store.add_image(arr, key), pos))
                        pos += (arr.shape[0] // side) * (arr.shape[1] // side)
                    store.add_document(refs)
                ids_b.add_document(np.asarray(ids, dtype=np.int64))
                mask_b.add_document(np.asarray(mask, dtype=np.int64))
                stats["conversations"] += 1
                stats["tokens"] += len(ids)
                stats["trained_tokens"] += int(sum(mask))
                stats["images"] += len(fitted)
                stats["vision_tokens"] += sum(1 for i in ids if i == tokenizer.media_id)
        if store is not None:
            store.finalize()
    except BaseException:
        if store is not None:
            store.abort()
        raise
    return stats


class SFTPackedDataset:
    """Rows of whole conversations with assistant-only labels (see the module docstring).

    Exposes what :class:`megak3.data.packing.Batcher` reads: ``seed``, ``seq_len``, ``split``,
    ``samples_in_epoch(e)``, ``sample(i, e)`` and ``len()`` (rows of epoch 0)."""

    def __init__(self, prefix, seq_len: int, split: str = "train", valid_fraction: float = 0.02,
                 seed: int = 1234, pad_id: int = 0, media_id: int = 3):
        if seq_len < 1:
            raise DataError(f"data.seq_len={seq_len} must be >= 1")
        self.dataset = IndexedDataset(prefix)
        self.mask = IndexedDataset(str(prefix) + MASK_SUFFIX)
        if not np.array_equal(self.dataset.doc_lengths, self.mask.doc_lengths):
            raise DataError(f"{prefix}{MASK_SUFFIX} does not match {prefix} (different document lengths); "
                            "re-run python -m megak3.data.sft for this dataset")
        self.seq_len, self.split, self.seed, self.pad_id = seq_len, split, seed, pad_id
        self.docs = split_documents(len(self.dataset), split, valid_fraction)
        if len(self.docs) == 0:
            raise DataError(f"the {split} split of {prefix} has no conversations at data.valid_fraction="
                            f"{valid_fraction}; " + ("raise" if split == "valid" else "lower")
                            + " data.valid_fraction")
        self._lengths = np.minimum(self.dataset.doc_lengths[self.docs], seq_len)
        self.truncated = int((self.dataset.doc_lengths[self.docs] > seq_len).sum())
        """conversations longer than data.seq_len, cut to their first seq_len tokens"""
        self.num_tokens = int(self._lengths.sum())
        self.store = self.media_id = None
        if has_images(prefix):  # image-text chat data: rows carry their conversations' pixels
            self.store, self.media_id = ImageStore(prefix), media_id
            if self.store.num_docs != len(self.dataset):
                raise DataError(f"{self.store.idx_path} describes {self.store.num_docs} conversations but {prefix} "
                                f"has {len(self.dataset)}; re-run python -m megak3.data.sft")
            long = [int(d) for d in self.docs
                    if self.dataset.doc_lengths[d] > seq_len and len(self.store.doc_images(d))]
            if long:
                raise DataError(f"conversation {long[0]} of {prefix} has images and "
                                f"{self.dataset.doc_lengths[long[0]]} tokens > data.seq_len={seq_len} (its image "
                                "slots would be cut); raise data.seq_len")
        self._cache: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    def _layout(self, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        """(document ids in epoch order, index into that order where each row starts, + the end)."""
        if epoch not in self._cache:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
            starts, used = [0], 0
            for k, n in enumerate(self._lengths[perm].tolist()):
                if used and used + n > self.seq_len:
                    starts.append(k)
                    used = 0
                used += n
            starts.append(len(perm))
            if len(self._cache) >= 2:  # a Batcher only ever straddles two epochs
                self._cache.pop(min(self._cache))
            self._cache[epoch] = (self.docs[perm], np.asarray(starts, dtype=np.int64))
        return self._cache[epoch]

    def samples_in_epoch(self, epoch: int) -> int:
        return len(self._layout(epoch)[1]) - 1

    def __len__(self) -> int:
        """Rows of epoch 0 (other epochs may differ by a few: the packing follows the shuffle)."""
        return self.samples_in_epoch(0)

    def sample(self, index: int, epoch: int = 0) -> Sample:
        order, starts = self._layout(epoch)
        if not 0 <= index < len(starts) - 1:
            raise IndexError(f"sample {index} out of range for {len(starts) - 1} rows in epoch {epoch}")
        T = self.seq_len
        input_ids = np.full(T, self.pad_id, dtype=np.int64)
        labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
        doc_starts, pos = [], 0
        images = None if self.store is None else []
        for d in order[starts[index]:starts[index + 1]]:
            if images is not None:
                images += [self.store.image(int(i)) for i, _ in self.store.doc_images(int(d))]
            ids = np.asarray(self.dataset.doc(int(d))[:T], dtype=np.int64)
            mask = np.asarray(self.mask.doc(int(d))[:T], dtype=bool)
            n = len(ids)
            doc_starts.append(pos)
            input_ids[pos:pos + n] = ids
            lab = labels[pos:pos + n]
            lab[:-1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
            pos += n
        if pos < T:
            doc_starts.append(pos)  # the padding is its own segment
        out = Sample(input_ids, labels, np.asarray(doc_starts, dtype=np.int64))
        if images is not None:
            out.images = images
            out.vision_tokens = int((input_ids == self.media_id).sum())
        return out

    def __getitem__(self, index: int) -> Sample:
        return self.sample(index, 0)


def open_sft_split(prefix, seq_len: int, split: str, valid_fraction: float, seed: int, tokenizer,
                   model_cfg=None) -> SFTPackedDataset:
    """The packed ``split`` of the SFT dataset ``prefix`` (what the trainer opens for SFT data); with
    ``model_cfg``, a dataset with images is checked against the model's vision tower first."""
    if model_cfg is not None and has_images(prefix):
        check_model_fits_images(f"SFT dataset {prefix}", ImageStore(prefix).side, tokenizer, model_cfg,
                                "write the dataset without images", "re-run python -m megak3.data.sft")
    return SFTPackedDataset(prefix, seq_len, split, valid_fraction, seed, tokenizer.pad_id, tokenizer.media_id)


def main(argv=None) -> int:
    from megak3.data.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m megak3.data.sft",
                                 description="chat JSON lines -> SFT indexed dataset (+ loss mask)")
    ap.add_argument("--input", nargs="+", required=True, help="chat .jsonl files")
    ap.add_argument("--output-prefix", required=True, help="dataset prefix to write (prefix.bin/.idx + prefix.mask)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json of the model to fine-tune")
    ap.add_argument("--patch-size", type=int, default=14, help="model.vision.patch_size (images only)")
    ap.add_argument("--merge", type=int, default=2, help="model.vision.merge (images only)")
    ap.add_argument("--max-pixels", type=int, default=0, help="pixels of a fitted image at most (0: default)")
    a = ap.parse_args(argv)
    try:
        tok = load_tokenizer(a.tokenizer)
        if a.patch_size < 1 or a.merge < 1 or a.max_pixels < 0:
            raise DataError(f"--patch-size={a.patch_size} and --merge={a.merge} must be >= 1, --max-pixels >= 0")
        stats = write_sft_dataset(read_conversations(a.input), a.output_prefix, tok, a.patch_size, a.merge,
                                  a.max_pixels)
    except (DataError, ChatFormatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_tok = Path(a.output_prefix).parent / "tokenizer.json"
    if not out_tok.exists():
        tok.hf.save(str(out_tok))  # the trainer looks for tokenizer.json beside the dataset
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
