"""Data configuration: where the tokens come from and how they are cut into samples.

``DataConfig`` is the schema (one docstring per field, like ``megak3/config.py``);
:func:`resolve_dataset` turns it into an on-disk ``(prefix, tokenizer.json)`` pair, building the
built-in demo corpus on first use. User mistakes raise :class:`DataError` (a ``ValueError``) that
names the ``data.<field>`` and the fix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple

from megak3.data.errors import DataError

DEMO = "demo"
DEMO_VISION = "demo_vision"
DEMO_SFT = "demo_sft"
DEMOS = (DEMO, DEMO_VISION, DEMO_SFT)


def default_cache_dir() -> str:
    """``$MEGAK3_CACHE`` when set, else ``~/.cache/megak3`` (kept unexpanded; expanded on use)."""
    return os.environ.get("MEGAK3_CACHE") or "~/.cache/megak3"


@dataclass
class DataConfig:
    """Training data: an indexed dataset (``prefix.bin`` + ``prefix.idx``) and its tokenizer."""

    path: str = DEMO
    """dataset prefix (``/x/y`` for ``/x/y.bin`` + ``/x/y.idx``), "demo" for the built-in stdlib corpus, or
    "demo_vision" for the built-in rendered-shapes image-text corpus, or "demo_sft" for the built-in chat corpus
    (megak3/data/demo_sft.py; trains on assistant tokens only)"""
    tokenizer: Optional[str] = None
    """path to tokenizer.json; None = ``tokenizer.json`` beside the dataset (automatic for "demo")"""
    cache_dir: str = field(default_factory=default_cache_dir)
    """where the demo dataset is built once and reused ($MEGAK3_CACHE, else ~/.cache/megak3)"""
    vocab_size: int = 8192
    """vocabulary size of the demo BPE tokenizer (must not exceed model.vocab_size)"""
    seq_len: int = 256
    """tokens per packed sample row (T)"""
    valid_fraction: float = 0.02
    """fraction of documents held out for validation (chosen by index, independent of the seed)"""
    seed: int = 1234
    """seed of the per-epoch document shuffle"""
    workers: int = 2
    """tokenizer worker processes used when the demo dataset has to be built"""

    def validate(self) -> "DataConfig":
        """Raise :class:`DataError` naming the field for values that cannot work; return self."""
        if not self.path:
            raise DataError('data.path is empty: give a dataset prefix or "demo"')
        if self.seq_len < 1:
            raise DataError(f"data.seq_len={self.seq_len} must be >= 1")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise DataError(f"data.valid_fraction={self.valid_fraction} must lie in [0, 1)")
        if self.workers < 1:
            raise DataError(f"data.workers={self.workers} must be >= 1")
        if self.path in DEMOS and self.tokenizer:
            raise DataError(f'data.tokenizer={self.tokenizer}: the demo corpus brings its own tokenizer; '
                            f'leave data.tokenizer unset (null) with data.path={self.path}')
        # 4 special tokens + 256 byte-level symbols are always in the vocabulary.
        if self.path in DEMOS and self.vocab_size < 260:
            raise DataError(f"data.vocab_size={self.vocab_size} must be >= 260 (4 special + 256 byte tokens)")
        return self


def resolve_dataset(cfg: DataConfig) -> Tuple[str, str]:
    """Return ``(prefix, tokenizer_path)`` for ``cfg``, building the demo corpus if needed.

    Checks that the dataset opens (header, sizes) and that the tokenizer file exists, so a wrong
    path fails here with the field name instead of deep inside the training loop.
    """
    from megak3.data.indexed import IndexedDataset  # local: keeps `import config` free of numpy

    cfg.validate()
    if cfg.path == DEMO_SFT:
        from megak3.data.demo_sft import build_demo_sft_dataset

        return build_demo_sft_dataset(os.path.expanduser(cfg.cache_dir), vocab_size=cfg.vocab_size)
    if cfg.path == DEMO_VISION:
        from megak3.data.demo_vision import build_demo_vision_dataset

        return build_demo_vision_dataset(os.path.expanduser(cfg.cache_dir), vocab_size=cfg.vocab_size)
    if cfg.path == DEMO:
        if cfg.tokenizer:
            raise DataError(f'data.tokenizer={cfg.tokenizer}: the demo corpus brings its own tokenizer; '
                            'leave data.tokenizer unset (null) with data.path=demo')
        from megak3.data.demo import build_demo_dataset

        return build_demo_dataset(os.path.expanduser(cfg.cache_dir), vocab_size=cfg.vocab_size,
                                  workers=cfg.workers)

    prefix = os.path.expanduser(cfg.path)
    for suffix in (".bin", ".idx"):
        if prefix.endswith(suffix):
            raise DataError(f"data.path={cfg.path}: give the prefix without '{suffix}' "
                            f"(data.path={prefix[: -len(suffix)]})")
    try:
        IndexedDataset(prefix)
    except DataError as e:
        raise DataError(f"data.path={cfg.path}: {e}") from None
    tok = os.path.expanduser(cfg.tokenizer) if cfg.tokenizer else str(Path(prefix).parent / "tokenizer.json")
    if not os.path.isfile(tok):
        which = f"data.tokenizer={cfg.tokenizer}" if cfg.tokenizer else f"data.tokenizer (default {tok})"
        raise DataError(f"{which}: no such file; point data.tokenizer at the tokenizer.json the dataset "
                        "was preprocessed with")
    return prefix, tok
