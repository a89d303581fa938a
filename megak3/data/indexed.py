"""Megatron-style indexed dataset: a flat token file plus an index of document offsets.

On disk, a dataset ``prefix`` is two files:

``prefix.bin``
    every document's tokens back to back, little-endian ``uint16`` (vocab < 65536) or ``int32``.
``prefix.idx``
    ``MAGIC`` (8 bytes) | version ``u64`` | dtype code ``u8`` | 7 zero bytes (keeps the arrays
    8-byte aligned) | document count N ``u64`` | token offsets ``int64[N + 1]``.
    Document ``i`` is ``bin[offsets[i]:offsets[i + 1]]``; ``offsets[N]`` is the token count, so
    lengths and offsets are one array and cannot disagree.

Unlike Megatron's ``MMIDIDX`` (sequence sizes + byte pointers + document index) there is no
separate sentence level: a document is the unit that packing and the train/valid split work on.
Both files are memory-mapped, so opening a dataset costs O(1) memory regardless of its size.
"""
from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Union

import numpy as np

from megak3.data.errors import PREPROCESS_HINT, DataError

MAGIC = b"MK3IDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sQB7xQ")  # magic, version, dtype code, pad, num_docs -> 32 bytes
DTYPE_CODES = {1: np.dtype("<u2"), 2: np.dtype("<i4")}

PathLike = Union[str, os.PathLike]


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype that holds ids ``< vocab_size``: uint16 halves the file for vocab < 65536."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<i4")


def _code_of(dtype) -> int:
    dtype = np.dtype(dtype).newbyteorder("<")
    for code, dt in DTYPE_CODES.items():
        if dt == dtype:
            return code
    raise ValueError(f"dtype={dtype} is not a token dtype; use numpy.uint16 or numpy.int32 (see best_dtype)")


class IndexedDatasetBuilder:
    """Appends documents to ``prefix.bin`` and writes ``prefix.idx`` on :meth:`finalize`.

    Everything is written under temporary names and renamed into place at the end, index last:
    the dataset "exists" only once ``prefix.idx`` exists, so a crash leaves either the previous
    dataset or none, never a half-written one under the final name. Use as a context manager to
    finalize on success and delete the temporaries on error.
    """

    def __init__(self, prefix: PathLike, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._code = _code_of(self.dtype)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp-{os.getpid()}-{id(self):x}"
        self._tmp_bin, self._tmp_idx = self.prefix + ".bin" + tag, self.prefix + ".idx" + tag
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []
        self._limits = np.iinfo(self.dtype)

    def add_document(self, tokens) -> None:
        """Append one document (a 1-D sequence of token ids; empty is allowed)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D token array, got shape {arr.shape}")
        if arr.size and (arr.min() < self._limits.min or arr.max() > self._limits.max):
            raise ValueError(f"token ids in [{arr.min()}, {arr.max()}] do not fit {self.dtype}; "
                             "build with dtype=best_dtype(tokenizer.vocab_size)")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(arr.size))

    def add_documents(self, tokens, lengths) -> None:
        """Append ``len(lengths)`` documents stored back to back in the flat array ``tokens``."""
        tokens, lengths = np.asarray(tokens), np.asarray(lengths, dtype=np.int64)
        if tokens.ndim != 1 or int(lengths.sum()) != tokens.size or (lengths < 0).any():
            raise ValueError(f"lengths (sum {int(lengths.sum())}) must split the {tokens.size} tokens")
        if tokens.size and (tokens.min() < self._limits.min or tokens.max() > self._limits.max):
            raise ValueError(f"token ids in [{tokens.min()}, {tokens.max()}] do not fit {self.dtype}; "
                             "build with dtype=best_dtype(tokenizer.vocab_size)")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._lengths.extend(lengths.tolist())

    def merge(self, other_prefix: PathLike) -> None:
        """Append every document of the finished dataset ``other_prefix`` (e.g. a worker's shard)."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {other_prefix} ({other.dtype}) into {self.prefix} ({self.dtype})")
        self._bin.flush()
        with open(other.bin_path, "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)  # stream bytes, never load the shard
        self._lengths.extend(other.doc_lengths.tolist())

    def finalize(self) -> None:
        """Write the index and move both files to their final names (index last)."""
        self._bin.close()
        offsets = np.zeros(len(self._lengths) + 1, dtype="<i8")
        np.cumsum(self._lengths, out=offsets[1:])
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(self._lengths)))
            f.write(offsets.tobytes())
            f.flush()
            os.fsync(f.fileno())
        # Remove the old index first: between the two renames the prefix reads as "missing",
        # never as the new .bin paired with a stale .idx.
        if os.path.exists(self.prefix + ".idx"):
            os.remove(self.prefix + ".idx")
        os.replace(self._tmp_bin, self.prefix + ".bin")
        os.replace(self._tmp_idx, self.prefix + ".idx")

    def abort(self) -> None:
        """Drop the temporaries; the final names are left untouched."""
        self._bin.close()
        for p in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin`` + ``prefix.idx``, validated on open."""

    def __init__(self, prefix: PathLike):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = self.prefix + ".bin", self.prefix + ".idx"
        missing = [p for p in (self.bin_path, self.idx_path) if not os.path.isfile(p)]
        if missing:
            raise DataError(f"no dataset at prefix {self.prefix} (missing {', '.join(missing)}); "
                            + PREPROCESS_HINT.format(prefix=self.prefix))
        idx_size = os.path.getsize(self.idx_path)
        with open(self.idx_path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:8] != MAGIC:
            raise DataError(f"{self.idx_path} is not a megak3 index (bad magic); rebuild it: "
                            + PREPROCESS_HINT.format(prefix=self.prefix))
        _, version, code, num_docs = _HEADER.unpack(head)
        if version != VERSION or code not in DTYPE_CODES:
            raise DataError(f"{self.idx_path}: unsupported version {version} / dtype code {code}; rebuild it")
        expected_idx = _HEADER.size + 8 * (num_docs + 1)
        if idx_size != expected_idx:
            raise DataError(f"{self.idx_path} is truncated or corrupt: {idx_size} bytes, expected "
                            f"{expected_idx} for {num_docs} documents; rebuild it")
        self.dtype = DTYPE_CODES[code]
        self.offsets = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=_HEADER.size, shape=(num_docs + 1,))
        n_tokens = int(self.offsets[-1])
        bin_size = os.path.getsize(self.bin_path)
        if bin_size != n_tokens * self.dtype.itemsize or self.offsets[0] != 0:
            raise DataError(f"{self.bin_path} has {bin_size} bytes but {self.idx_path} describes "
                            f"{n_tokens} {self.dtype} tokens ({n_tokens * self.dtype.itemsize} bytes): "
                            "the pair is truncated or mismatched; rebuild it")
        if num_docs and (np.diff(self.offsets) < 0).any():
            raise DataError(f"{self.idx_path}: document offsets are not monotone (corrupt index); rebuild it")
        # numpy refuses to memory-map an empty file; an empty dataset is still a valid dataset.
        self._tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r") if n_tokens
                        else np.zeros(0, dtype=self.dtype))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        """Total tokens over all documents."""
        return int(self.offsets[-1])

    @property
    def doc_lengths(self) -> np.ndarray:
        """int64 [N] tokens per document."""
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` as a read-only zero-copy view into the memory map."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document {i} out of range for {n} documents")
        i %= n
        return self._tokens[self.offsets[i]:self.offsets[i + 1]]

    __getitem__ = doc

    def __repr__(self) -> str:
        return f"IndexedDataset({self.prefix!r}, docs={len(self)}, tokens={self.num_tokens}, dtype={self.dtype})"
