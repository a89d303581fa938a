"""The built-in demo corpus: the running interpreter's own standard-library ``.py`` sources.

It is on every machine, needs no download, is real code of moderate size (CPython 3.11: ~730
files, ~12 MB, ~3.2 M tokens at vocab 8192) and is the same for everyone with the same Python.
Excluded, to keep the size moderate and the list stable across installs: ``site-packages`` /
``dist-packages`` (whatever the user installed) and every directory named ``test``, ``tests``
or ``idle_test`` (CPython's regression suite ``test/``, ``idlelib/idle_test``, ``lib2to3/tests``,
and the same-named suites under ``ctypes``, ``unittest``, ``distutils``, ``tkinter``).

The tokenizer is trained on the whole corpus (a few seconds with ``tokenizers``), so no subset
rule is needed. The built dataset is cached under a key of (format version, vocab size, absolute
paths and sizes of the files): another Python or another vocab size builds its own copy.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional, Tuple

from megak3.data.demo_cache import PREFIX_NAME, cached_corpus

FORMAT_VERSION = 1
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


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


def build_demo_dataset(cache_dir, vocab_size: int = 8192, workers: int = 2, progress: bool = True) -> Tuple[str, str]:
    """Build (once) and return ``(prefix, tokenizer_path)`` of the demo corpus under ``cache_dir``.

    A cache entry is built in a temporary directory and renamed into place, so concurrent callers
    (several ranks, two terminals) each either find a complete entry or publish one atomically.
    """
    from megak3.data.preprocessing import format_stats, preprocess  # heavy imports only when building

    files = demo_files()
    if not files:
        raise RuntimeError(f"no .py files found under {demo_root()}; set data.path to a preprocessed dataset")
    # absolute paths: they name the interpreter's stdlib, so another Python differs
    key = f"megak3-demo v{FORMAT_VERSION} vocab={vocab_size}\n" + "".join(f"{f}\t{f.stat().st_size}\n" for f in files)

    def build(tmp: Path) -> dict:
        stats = preprocess(files, tmp / PREFIX_NAME, train_tokenizer=True, vocab_size=vocab_size,
                           workers=workers, progress=progress)
        stats.update(python=sys.version.split()[0], mb_text=sum(f.stat().st_size for f in files) / 1e6,
                     root=str(demo_root()))
        return stats

    return cached_corpus(cache_dir, f"demo-py{sys.version_info[0]}{sys.version_info[1]}-v{vocab_size}", key, build,
                         lambda stats: f"demo corpus: {len(files)} files, {stats['mb_text']:.1f} MB; "
                                       + format_stats(stats), progress)
