"""Pack documents into fixed-length rows with document boundaries, and batch them resumably.

Per epoch ``e`` the documents of a split are concatenated in a shuffled order (a permutation
seeded by ``(seed, e)``) into one token stream of ``S`` tokens; sample ``k`` holds stream tokens
``[k*T, (k+1)*T)``. So every token is an input exactly once per epoch; the last sample of an epoch
is topped up with ``pad_id`` (labels -100) instead of dropping the tail.

Labels: ``labels[j]`` is the next token of the same document. At the last token of a document
(usually eos) the "next token" would be the first token of an unrelated, randomly chosen document
that the model cannot see (state is reset at the boundary), so that prediction is noise: it is set
to -100 and ignored by the loss. Nothing ever crosses a document boundary, so no sample needs a
T+1-th token.

Boundaries: each sample lists the row offsets where a document starts; 0 is always one (a document
continuing from the previous row simply restarts there, the model's state does not carry across
rows). ``Batcher`` turns them into ``cu_seqlens`` over the flattened ``B*T`` stream.

Nothing is materialised beyond one int64 per document of the split: sample -> (document, offset)
is a ``searchsorted`` into the epoch's cumulative lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch

from megak3.data.errors import DataError
from megak3.data.indexed import IndexedDataset

IGNORE_INDEX = -100
SPLITS = ("train", "valid")


def split_documents(num_docs: int, split: str, valid_fraction: float) -> np.ndarray:
    """Document ids of ``split``: document ``i`` is valid iff ``floor((i+1)f) > floor(i f)``.

    That spreads ``floor(N f)`` valid documents evenly over the corpus (a sorted corpus does not
    put one whole topic in validation) and does not depend on the shuffle seed, so changing the
    seed never moves documents between train and valid.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    i = np.arange(num_docs, dtype=np.int64)
    is_valid = np.floor((i + 1) * valid_fraction) > np.floor(i * valid_fraction)
    return np.flatnonzero(is_valid if split == "valid" else ~is_valid)


@dataclass
class Sample:
    """One packed row: ``input_ids``/``labels`` int64 [T]; ``doc_starts`` int64 row offsets, starting with 0;
    ``images``: uint8 [H, W, 3] arrays whose slots are in this row, in order (None for text-only data)."""

    input_ids: np.ndarray
    labels: np.ndarray
    doc_starts: np.ndarray
    images: Optional[List[np.ndarray]] = None
    vision_tokens: int = 0
    """``<|media|>`` slots in the row (the images' LM tokens)"""


class PackedDataset:
    """Fixed-length packed samples of one split of an :class:`IndexedDataset`, epoch by epoch."""

    def __init__(self, dataset: IndexedDataset, seq_len: int, split: str = "train", valid_fraction: float = 0.02,
                 seed: int = 1234, pad_id: int = 0):
        if seq_len < 1:
            raise DataError(f"data.seq_len={seq_len} must be >= 1")
        self.dataset, self.seq_len, self.split, self.seed, self.pad_id = dataset, seq_len, split, seed, pad_id
        self.docs = split_documents(len(dataset), split, valid_fraction)
        self._lengths = dataset.doc_lengths[self.docs]
        self.num_tokens = int(self._lengths.sum())
        if self.num_tokens == 0:
            raise DataError(f"the {split} split of {dataset.prefix} has no tokens ({len(self.docs)} of "
                            f"{len(dataset)} documents at data.valid_fraction={valid_fraction}); "
                            + ("raise data.valid_fraction" if split == "valid" else "lower data.valid_fraction"))
        self._epoch_cache: Dict[int, tuple] = {}

    def __len__(self) -> int:
        """Samples per epoch: ``ceil(S / T)``."""
        return -(-self.num_tokens // self.seq_len)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset document ids in the order they are concatenated in ``epoch``."""
        return self._epoch(epoch)[0]

    def _epoch(self, epoch: int):
        if epoch not in self._epoch_cache:
            # SeedSequence((seed, epoch)): independent, reproducible permutations per epoch.
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
            cum = np.zeros(len(perm) + 1, dtype=np.int64)
            np.cumsum(self._lengths[perm], out=cum[1:])
            if len(self._epoch_cache) >= 2:  # a Batcher only ever straddles two epochs
                self._epoch_cache.pop(min(self._epoch_cache))
            self._epoch_cache[epoch] = (self.docs[perm], cum)
        return self._epoch_cache[epoch]

    def samples_in_epoch(self, epoch: int) -> int:
        """Samples of ``epoch``; the same for every epoch here (image rows vary: vision_dataset.py)."""
        return len(self)

    def sample(self, index: int, epoch: int = 0) -> Sample:
        """Sample ``index`` (``0 <= index < len(self)``) of ``epoch``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples per epoch")
        start = index * self.seq_len
        return self.fill_row(epoch, start, min(start + self.seq_len, self.num_tokens))

    def fill_row(self, epoch: int, start: int, end: int) -> Sample:
        """One row holding epoch-stream tokens ``[start, end)`` (``end - start <= T``), padded to T."""
        order, cum = self._epoch(epoch)
        T = self.seq_len
        input_ids = np.full(T, self.pad_id, dtype=np.int64)
        labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
        d = int(np.searchsorted(cum, start, side="right")) - 1  # document holding stream token `start`
        pos = start
        while pos < end:
            doc_lo, doc_hi = int(cum[d]), int(cum[d + 1])
            if doc_hi > pos:  # zero-length documents are stepped over
                tokens = self.dataset.doc(int(order[d]))
                a, b = pos - doc_lo, min(doc_hi, end) - doc_lo  # slice of this document in the row
                input_ids[pos - start:pos - start + b - a] = tokens[a:b]
                # next-token labels inside the document; the document's last token keeps -100
                nb = min(b, len(tokens) - 1)
                if nb > a:
                    labels[pos - start:pos - start + nb - a] = tokens[a + 1:nb + 1]
                pos = doc_lo + b
            d += 1
        inner = cum[(cum > start) & (cum < end)] - start  # documents starting inside the row
        starts = [np.zeros(1, dtype=np.int64), np.unique(inner)]
        if end - start < T:
            starts.append(np.array([end - start], dtype=np.int64))  # the padding is its own segment
        return Sample(input_ids, labels, np.concatenate(starts))

    def __getitem__(self, index: int) -> Sample:
        return self.sample(index, 0)


class Batcher:
    """Endless (or one-epoch) iterator of dict batches over a :class:`PackedDataset`.

    Each step consumes ``dp_size * micro_batch_size`` consecutive samples of the global order;
    data-parallel rank ``r`` gets rows ``[r*B, (r+1)*B)`` of them, so ranks never share a sample
    and the resumable state ``(epoch, position)`` is the same on every rank. Batches straddle
    epoch ends (the tail of epoch e, then the head of e+1) so no sample is skipped.

    ``loop=False`` (validation): one pass from the current position to the end of the epoch; the
    last batch may be short, and with ``dp_size > 1`` ranks may get different numbers of batches,
    so distributed evaluation should run a fixed number of steps instead.
    """

    def __init__(self, packed: PackedDataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 loop: bool = True):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must lie in [0, dp_size={dp_size})")
        self.packed, self.B, self.dp_rank, self.dp_size, self.loop = packed, micro_batch_size, dp_rank, dp_size, loop
        self.epoch, self.position = 0, 0
        self._stop_epoch: Optional[int] = None

    def state_dict(self) -> dict:
        """Where the next batch starts, plus what must match on resume."""
        return dict(epoch=self.epoch, position=self.position, seed=self.packed.seed, seq_len=self.packed.seq_len,
                    split=self.packed.split, samples_per_epoch=len(self.packed),
                    micro_batch_size=self.B, dp_size=self.dp_size)

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken; refuse a state from a different data setup.

        ``micro_batch_size`` and ``dp_size`` may change (the position is a global sample index, so
        a resized run still sees every sample once); seed, seq_len, split and corpus size may not.
        """
        mine = self.state_dict()
        for key in ("seed", "seq_len", "split", "samples_per_epoch"):
            if key in state and state[key] != mine[key]:
                raise DataError(f"data loader state was saved with {key}={state[key]} but this run has "
                                f"{key}={mine[key]}; resume with the same data settings or start fresh")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def __iter__(self) -> Iterator[dict]:
        if not self.loop:
            self._stop_epoch = self.epoch + 1
        return self

    def __next__(self) -> dict:
        # walk the step's dp_size * B global samples; this rank keeps rows [r*B, (r+1)*B)
        epoch, pos, rows = self.epoch, self.position, []
        mine = range(self.dp_rank * self.B, (self.dp_rank + 1) * self.B)
        for j in range(self.dp_size * self.B):
            if self._stop_epoch is not None and epoch >= self._stop_epoch:
                break
            if j in mine:
                rows.append(self.packed.sample(pos, epoch))
            pos += 1
            if pos >= self.packed.samples_in_epoch(epoch):
                epoch, pos = epoch + 1, 0
        if not rows:
            raise StopIteration
        self.epoch, self.position = epoch, pos
        return collate(rows)


def collate(rows) -> dict:
    """Stack samples into ``input_ids``/``labels`` LongTensor [B, T] and int32 ``cu_seqlens`` over B*T.

    ``num_tokens`` counts labels that enter the loss (!= -100), for token-weighted averaging
    across micro-batches and ranks. Rows with images add ``images``: float32 [3, H, W] tensors in
    [-1, 1], in row-major slot order (the order ``K3Model.embed`` splices them), and
    ``num_images`` / ``vision_tokens``.
    """
    T = len(rows[0].input_ids)
    input_ids_BT = torch.from_numpy(np.stack([r.input_ids for r in rows]))
    labels_BT = torch.from_numpy(np.stack([r.labels for r in rows]))
    offsets = [r.doc_starts + b * T for b, r in enumerate(rows)] + [np.array([len(rows) * T])]
    cu_seqlens = torch.from_numpy(np.concatenate(offsets).astype(np.int32))
    out = dict(input_ids=input_ids_BT, labels=labels_BT, cu_seqlens=cu_seqlens,
               num_tokens=int((labels_BT != IGNORE_INDEX).sum()))
    if any(r.images is not None for r in rows):
        from megak3.data.images import pixels_to_tensor

        out["images"] = [pixels_to_tensor(a) for r in rows for a in (r.images or ())]
        out["num_images"] = len(out["images"])
        out["vision_tokens"] = sum(r.vision_tokens for r in rows)
    return out
