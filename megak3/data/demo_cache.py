"""Cache entries of the built-in corpora (demo, demo_vision, demo_sft): built once, published atomically.

An entry is the directory ``cache_dir/NAME-HASH`` (HASH: the first 16 hex digits of the sha256 of a key
text naming everything the entry depends on) holding ``data.bin``, ``data.idx``, ``tokenizer.json`` and
``meta.json`` (the build's stats, written last: its presence means the entry is complete).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional, Tuple

PREFIX_NAME = "data"  # files inside a cache entry: data.bin, data.idx, tokenizer.json, meta.json


def publish_cache_entry(entry: Path, build: Callable[[Path], dict]) -> Optional[dict]:
    """Build the cache directory ``entry`` once and publish it atomically.

    ``build(tmp)`` writes the entry's files into a temporary sibling directory and returns its
    stats; they are written to ``meta.json`` last and the directory is renamed into place, so
    concurrent callers (several ranks, two terminals) each either find a complete entry or publish
    one. Returns the stats when this call built the entry, None when it was already complete (or
    another process published it first)."""
    if (entry / "meta.json").is_file():  # meta.json is written last: its presence means complete
        return None
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        stats = build(tmp)
        (tmp / "meta.json").write_text(json.dumps(stats, indent=1))
        try:
            os.rename(tmp, entry)
        except OSError:  # another process published the same entry first; theirs is identical
            if not (entry / "meta.json").is_file():
                raise
            return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


def cached_corpus(cache_dir, name: str, key: str, build: Callable[[Path], dict], describe: Callable[[dict], str],
                  progress: bool = True) -> Tuple[str, str]:
    """Build (once) and return ``(prefix, tokenizer_path)`` of the corpus entry ``cache_dir/NAME-HASH`` of ``key``.

    ``build(tmp)`` writes ``tmp/data.{bin,idx}`` and ``tmp/tokenizer.json`` and returns its stats, to which the
    entry's final ``prefix`` and ``tokenizer`` paths are added; when this call built the entry and ``progress``
    is set, ``describe(stats)`` is printed on stderr."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    entry = Path(os.path.expanduser(str(cache_dir))) / f"{name}-{digest}"
    prefix, tok_path = entry / PREFIX_NAME, entry / "tokenizer.json"

    def build_entry(tmp: Path) -> dict:
        stats = build(tmp)
        stats.update(prefix=str(prefix), tokenizer=str(tok_path))
        return stats

    stats = publish_cache_entry(entry, build_entry)
    if stats is not None and progress:
        print(describe(stats), file=sys.stderr)
    return str(prefix), str(tok_path)
