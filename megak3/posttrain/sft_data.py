"""SFT data: chat JSON lines -> an indexed dataset plus a loss mask -> packed rows of whole conversations.

On disk an SFT dataset is an ordinary indexed dataset (``prefix.bin/.idx``: one document per
conversation, the ids of :func:`megak3.posttrain.chat.encode_chat`) and a twin ``prefix.mask``
indexed dataset of the same document lengths holding 1 where a token is trained on (assistant
content and its closing eos), 0 elsewhere. The twin is what makes ``data.path=PREFIX`` train as SFT:
the trainer opens it with :func:`open_sft_split` when :func:`is_sft_dataset` finds it.

Preprocess your own chat data with the tokenizer of the model you fine-tune::

    python -m megak3.posttrain.sft_data --input chats.jsonl --output-prefix data/sft/chat \\
        --tokenizer runs/pretrain/tokenizer.json

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

from megak3.data.config import DataError
from megak3.data.indexed import IndexedDataset, IndexedDatasetBuilder, best_dtype
from megak3.data.packing import IGNORE_INDEX, Sample, split_documents
from megak3.posttrain.chat import ChatFormatError, check_messages, encode_chat

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
                    yield check_messages(obj.get("messages") if isinstance(obj, dict) else None, where)
                except ChatFormatError as e:
                    raise DataError(str(e)) from None


def write_sft_dataset(conversations: Iterable[List[dict]], prefix, tokenizer) -> Dict[str, int]:
    """Encode ``conversations`` with the chat template into ``prefix`` (+ its mask twin); return counts."""
    dtype = best_dtype(tokenizer.vocab_size)
    stats = dict(conversations=0, tokens=0, trained_tokens=0)
    with IndexedDatasetBuilder(prefix, dtype) as ids_b, IndexedDatasetBuilder(str(prefix) + MASK_SUFFIX,
                                                                               np.uint16) as mask_b:
        for msgs in conversations:
            ids, mask = encode_chat(tokenizer, msgs)
            ids_b.add_document(np.asarray(ids, dtype=np.int64))
            mask_b.add_document(np.asarray(mask, dtype=np.int64))
            stats["conversations"] += 1
            stats["tokens"] += len(ids)
            stats["trained_tokens"] += int(sum(mask))
    return stats


class SFTPackedDataset:
    """Rows of whole conversations with assistant-only labels (see the module docstring).

    Exposes what :class:`megak3.data.packing.Batcher` reads: ``seed``, ``seq_len``, ``split``,
    ``samples_in_epoch(e)``, ``sample(i, e)`` and ``len()`` (rows of epoch 0)."""

    def __init__(self, prefix, seq_len: int, split: str = "train", valid_fraction: float = 0.02,
                 seed: int = 1234, pad_id: int = 0):
        if seq_len < 1:
            raise DataError(f"data.seq_len={seq_len} must be >= 1")
        self.dataset = IndexedDataset(prefix)
        self.mask = IndexedDataset(str(prefix) + MASK_SUFFIX)
        if not np.array_equal(self.dataset.doc_lengths, self.mask.doc_lengths):
            raise DataError(f"{prefix}{MASK_SUFFIX} does not match {prefix} (different document lengths); "
                            "re-run python -m megak3.posttrain.sft_data for this dataset")
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
        for d in order[starts[index]:starts[index + 1]]:
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
        return Sample(input_ids, labels, np.asarray(doc_starts, dtype=np.int64))

    def __getitem__(self, index: int) -> Sample:
        return self.sample(index, 0)


def open_sft_split(prefix, seq_len: int, split: str, valid_fraction: float, seed: int, tokenizer) -> SFTPackedDataset:
    """The packed ``split`` of the SFT dataset ``prefix`` (what the trainer opens for SFT data)."""
    return SFTPackedDataset(prefix, seq_len, split, valid_fraction, seed, tokenizer.pad_id)


def main(argv=None) -> int:
    from megak3.data.tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(prog="python -m megak3.posttrain.sft_data",
                                 description="chat JSON lines -> SFT indexed dataset (+ loss mask)")
    ap.add_argument("--input", nargs="+", required=True, help="chat .jsonl files")
    ap.add_argument("--output-prefix", required=True, help="dataset prefix to write (prefix.bin/.idx + prefix.mask)")
    ap.add_argument("--tokenizer", required=True, help="tokenizer.json of the model to fine-tune")
    a = ap.parse_args(argv)
    try:
        tok = load_tokenizer(a.tokenizer)
        stats = write_sft_dataset(read_conversations(a.input), a.output_prefix, tok)
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
