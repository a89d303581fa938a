"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) with the special ids the model expects.

Special tokens sit at fixed ids, matching ``conf/model/*.yaml``::

    0 <|pad|>   1 <|bos|>   2 <|eos|>   3 <|media|>  (image placeholder, replaced by vision tokens)

Byte-level means every string is encodable (no unknown token) and ``decode(encode(s)) == s``.
Text that happens to *contain* the string "<|eos|>" or "<|media|>" is encoded as ordinary bytes,
not as the special id: a stray "<|media|>" in a web page must not become an image slot without an
image. Special ids are added by the pipeline (``append_eos``) or by the multimodal collator.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, List, Sequence, Union

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from megak3.data.errors import DataError

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|media|>")
MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # specials + the 256 byte symbols


class Tokenizer:
    """Thin wrapper over a HF tokenizer: plain-int API and the four special ids looked up by name."""

    def __init__(self, hf: HFTokenizer, path: str = "<memory>"):
        self.hf = hf
        self.path = path
        # Treat special-token strings inside the text as text (see the module docstring).
        hf.encode_special_tokens = True
        ids = {}
        for tok in SPECIAL_TOKENS:
            i = hf.token_to_id(tok)
            if i is None:
                raise DataError(f"tokenizer {path} has no special token {tok!r}; train it with "
                                "megak3.data.tokenizer.train_bpe_tokenizer (or tools/preprocess_data.py "
                                "--train-tokenizer)")
            ids[tok] = i
        self.pad_id, self.bos_id, self.eos_id, self.media_id = (ids[t] for t in SPECIAL_TOKENS)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (ids are ``0 .. vocab_size - 1``)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no bos/eos added)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """``[encode(t) for t in texts]``, using the library's thread pool when it is allowed to."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are shown as their strings unless skipped."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def sha256(self) -> str:
        """SHA-256 of the serialised tokenizer.json: two tokenizers with the same hash split text alike
        (what a MOPD teacher, loaded or served, is checked by against the student)."""
        return hashlib.sha256(self.hf.to_str().encode()).hexdigest()

    def special_ids(self) -> dict:
        return {"pad": self.pad_id, "bos": self.bos_id, "eos": self.eos_id, "media": self.media_id}

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def train_bpe_tokenizer(text_iterator: Iterable[str], vocab_size: int, save_path: Union[str, os.PathLike],
                        min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE on ``text_iterator`` and save it as ``save_path`` (a tokenizer.json).

    Deterministic: the trainer breaks ties between equally frequent pairs by the pair itself, and
    the 256-byte initial alphabet is given explicitly, so the same texts in the same order give a
    byte-identical tokenizer.json (checked in tests). The vocabulary can come out smaller than
    ``vocab_size`` when the corpus runs out of pairs seen ``min_frequency`` times.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} must be >= {MIN_VOCAB} (4 special + 256 byte tokens)")
    hf = HFTokenizer(models.BPE())
    # add_prefix_space=False: code is whitespace-sensitive and decode must give back the exact text.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),  # inserted first, in order -> ids 0..3
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, even unseen ones
        show_progress=False,
    )
    hf.train_from_iterator(text_iterator, trainer=trainer)
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert hf.token_to_id(tok) == i, f"special token {tok} landed at {hf.token_to_id(tok)}"
    save_path = Path(save_path)
    save_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = save_path.with_name(save_path.name + f".tmp-{os.getpid()}")
    hf.save(str(tmp))
    os.replace(tmp, save_path)  # atomic: readers never see a half-written tokenizer.json
    return Tokenizer(hf, str(save_path))


def load_tokenizer(path: Union[str, os.PathLike]) -> Tokenizer:
    """Load a tokenizer.json (or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(f"tokenizer {path}: no such file; give the tokenizer.json written by "
                        "tools/preprocess_data.py --train-tokenizer (data.tokenizer / --tokenizer)")
    try:
        hf = HFTokenizer.from_file(str(p))
    except Exception as e:  # the library raises a bare Exception on malformed JSON
        raise DataError(f"tokenizer {p} is not a valid tokenizer.json: {e}") from None
    return Tokenizer(hf, str(p))
