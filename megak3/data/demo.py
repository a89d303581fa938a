"""The built-in demo corpus: the running interpreter's own standard-library ``.py`` sources.

It is on every machine, needs no download, is real code of moderate size (CPython 3.11: ~730
files, ~12 MB, ~3.2 M tokens at vocab 8192) and is the same for everyone with the same Python.
Excluded, to keep the size moderate and the list stable across installs: ``site-packages`` /
``dist-packages`` (whatever the user installed) and every directory named ``test``, ``tests``
or ``idle_test`` (CPython's regression suite ``test/``, ``idlelib/idle_test``, ``lib2to3/tests``,
and the same-named suites under ``ctypes``, ``unittest``, ``distutils``, ``tkinter``).

The tokenizer is trained on the whole corpus (a few seconds with ``tokenizers``), so no subset
rule is needed. The built dataset is cached under a key of (format version, vocab size, relative
paths and sizes of the files): another Python or another vocab size builds its own copy.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Callable, List, Optional, Tuple

FORMAT_VERSION = 1
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
PREFIX_NAME = "data"  # files inside a cache entry: data.bin, data.idx, tokenizer.json, meta.json


def demo_root() -> Path:
    """The standard-library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def demo_files(root: Optional[Path] = None) -> List[Path]:
    """All stdlib ``*.py`` files outside the excluded directories, sorted by relative path."""
    root = Path(root) if root is not None else demo_root()
    found = []
    for dirpath, dirs, names in os.walk(root):  # prune excluded trees instead of walking them
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        found += [Path(dirpath, n) for n in names if n.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def cache_key(files: List[Path], vocab_size: int) -> str:
    """Hash of what the built dataset depends on: format, vocab size, and each file's path and size."""
    h = hashlib.sha256(f"megak3-demo v{FORMAT_VERSION} vocab={vocab_size}\n".encode())
    for f in files:  # absolute paths: they name the interpreter's stdlib, so another Python differs
        h.update(f"{f}\t{f.stat().st_size}\n".encode())
    return h.hexdigest()[:16]


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


def build_demo_dataset(cache_dir, vocab_size: int = 8192, workers: int = 2, progress: bool = True) -> Tuple[str, str]:
    """Build (once) and return ``(prefix, tokenizer_path)`` of the demo corpus under ``cache_dir``.

    A cache entry is built in a temporary directory and renamed into place, so concurrent callers
    (several ranks, two terminals) each either find a complete entry or publish one atomically.
    """
    from megak3.data.preprocessing import format_stats, preprocess  # heavy imports only when building

    files = demo_files()
    if not files:
        raise RuntimeError(f"no .py files found under {demo_root()}; set data.path to a preprocessed dataset")
    entry = Path(os.path.expanduser(str(cache_dir))) / f"demo-py{sys.version_info[0]}{sys.version_info[1]}-" \
                                                      f"v{vocab_size}-{cache_key(files, vocab_size)}"
    prefix, tok_path = entry / PREFIX_NAME, entry / "tokenizer.json"
    if (entry / "meta.json").is_file():  # meta.json is written last: its presence means complete
        return str(prefix), str(tok_path)

    def build(tmp: Path) -> dict:
        stats = preprocess(files, tmp / PREFIX_NAME, train_tokenizer=True, vocab_size=vocab_size,
                           workers=workers, progress=progress)
        stats.update(prefix=str(prefix), tokenizer=str(tok_path), python=sys.version.split()[0],
                     mb_text=sum(f.stat().st_size for f in files) / 1e6, root=str(demo_root()))
        return stats

    stats = publish_cache_entry(entry, build)
    if stats is not None and progress:
        print(f"demo corpus: {len(files)} files, {stats['mb_text']:.1f} MB; " + format_stats(stats),
              file=sys.stderr)
    return str(prefix), str(tok_path)
