"""Text files -> tokenizer (optional training) -> indexed dataset. ``tools/preprocess_data.py`` is its CLI.

What counts as a document:

- ``*.jsonl`` / ``*.json``: JSON lines; each non-blank line is an object and ``obj[json_key]``
  (default "text") is one document.
- any other file (``.txt``, ``.py``, ``.md``, ...): the whole FILE is one document, read as UTF-8
  with undecodable bytes replaced by U+FFFD. Files with a NUL byte in their first 8 KiB are taken
  for binary and skipped (counted in ``skipped_files``).

Directories are walked recursively; hidden entries (".git", ".cache") are skipped, and files are
taken in sorted relative-path order after the inputs' own order, so the output never depends on
the file system's listing order or on the number of workers: each worker tokenizes whole files
and the parent writes results in input order (``Pool.imap``).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
from tqdm import tqdm

from megak3.data.errors import DataError
from megak3.data.indexed import IndexedDatasetBuilder, best_dtype
from megak3.data.tokenizer import MIN_VOCAB, Tokenizer, load_tokenizer, train_bpe_tokenizer

JSON_SUFFIXES = (".jsonl", ".json")
_BINARY_PROBE = 8192

PathLike = Union[str, os.PathLike]


def collect_input_files(inputs: Sequence[PathLike]) -> List[Path]:
    """Expand files and directories (recursively, sorted, hidden entries skipped) into a file list."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    files: List[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = []
            for root, dirs, names in os.walk(p):
                dirs[:] = [d for d in dirs if not d.startswith(".")]  # prune .git etc. early
                found += [Path(root, n) for n in names if not n.startswith(".")]
            files += sorted(found, key=lambda f: f.relative_to(p).as_posix())
        else:
            raise DataError(f"--input {item}: no such file or directory")
    seen, unique = set(), []
    for f in files:  # the same file named twice (dir + file) is one input
        key = os.path.realpath(f)
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


def read_documents(path: PathLike, json_key: str = "text") -> Optional[List[str]]:
    """The documents of one input file (see the module docstring); None for a binary file."""
    path = Path(path)
    raw = path.read_bytes()
    if path.suffix.lower() not in JSON_SUFFIXES:
        if b"\x00" in raw[:_BINARY_PROBE]:
            return None
        return [raw.decode("utf-8", errors="replace")]
    docs = []
    for lineno, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not a JSON object ({e.msg}); .json/.jsonl inputs must "
                            "hold one JSON object per line") from None
        if not isinstance(obj, dict) or not isinstance(obj.get(json_key), str):
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{path}:{lineno}: no string field {json_key!r} (found {keys}); "
                            "pick the text field with --json-key")
        docs.append(obj[json_key])
    return docs


# ---- per-process tokenization (the same function runs inline for workers=1 and in each worker) ----
_STATE: dict = {}


def _init_worker(tokenizer_path: str, json_key: str, append_eos: bool) -> None:
    _STATE.update(tok=load_tokenizer(tokenizer_path), json_key=json_key, append_eos=append_eos)


def _tokenize_file(path: Path) -> Tuple[Optional[np.ndarray], Optional[np.ndarray], int]:
    """-> (flat int32 tokens, int64 per-document lengths, number of empty documents dropped)."""
    docs = read_documents(path, _STATE["json_key"])
    if docs is None:
        return None, None, 0
    kept = [d for d in docs if d]  # an empty text would be a lone eos: no signal, skip it
    tok: Tokenizer = _STATE["tok"]
    ids = tok.encode_batch(kept)
    if _STATE["append_eos"]:
        ids = [x + [tok.eos_id] for x in ids]
    lengths = np.array([len(x) for x in ids], dtype=np.int64)
    flat = np.concatenate([np.asarray(x, dtype=np.int32) for x in ids]) if ids else np.zeros(0, np.int32)
    return flat, lengths, len(docs) - len(kept)


@contextmanager
def _quiet_tokenizers_fork() -> Iterator[None]:
    """Fork workers with TOKENIZERS_PARALLELISM=false, then restore the parent's setting.

    If the parent already used the library's thread pool (e.g. it just trained the tokenizer),
    forked children print a warning and switch it off anyway; saying so explicitly keeps the
    output clean and makes each worker single-threaded, which is what a process pool wants.
    """
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _iter_texts(files: Iterable[Path], json_key: str) -> Iterator[str]:
    for f in files:
        for d in read_documents(f, json_key) or ():
            if d:
                yield d


def _train_next_to(output_prefix: str, files: List[Path], json_key: str, vocab_size: int) -> str:
    """Train on ``files`` and save ``tokenizer.json`` beside the output; refuse to clobber a different one."""
    final = Path(output_prefix).parent / "tokenizer.json"
    new = final.with_name(f"tokenizer.json.new-{os.getpid()}")
    train_bpe_tokenizer(_iter_texts(files, json_key), vocab_size, new)
    if final.exists() and final.read_bytes() != new.read_bytes():
        new.unlink()
        raise DataError(f"{final} already exists and differs from the tokenizer trained now; reuse it "
                        "with --tokenizer, delete it, or write to another output directory")
    os.replace(new, final)
    return str(final)


def preprocess(inputs: Sequence[PathLike], output_prefix: PathLike, tokenizer_path: Optional[PathLike] = None,
               train_tokenizer: bool = False, vocab_size: int = 8192, workers: int = 1, json_key: str = "text",
               append_eos: bool = True, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into the indexed dataset ``output_prefix`` and return its statistics.

    Exactly one of ``tokenizer_path`` (an existing tokenizer.json) and ``train_tokenizer=True``
    (train a ``vocab_size`` BPE on the inputs first, saved as ``tokenizer.json`` beside the output).
    """
    t0 = time.perf_counter()
    output_prefix = str(Path(output_prefix).expanduser())
    if (tokenizer_path is None) == (not train_tokenizer):
        raise DataError("give exactly one of --tokenizer PATH (existing tokenizer.json) and "
                        "--train-tokenizer --vocab-size N")
    if workers < 1:
        raise DataError(f"--workers={workers} must be >= 1")
    if train_tokenizer and vocab_size < MIN_VOCAB:
        raise DataError(f"--vocab-size={vocab_size} must be >= {MIN_VOCAB} (4 special + 256 byte tokens)")
    if tokenizer_path is not None:
        load_tokenizer(tokenizer_path)  # a missing or malformed file fails before anything is written
    files = collect_input_files(inputs)
    if not files:
        raise DataError(f"--input {list(map(str, inputs))}: no input files found")
    out_dir = Path(output_prefix).parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--output-prefix {output_prefix}: cannot create {out_dir} ({e.strerror})") from None
    if not os.access(out_dir, os.W_OK):
        raise DataError(f"--output-prefix {output_prefix}: {out_dir} is not writable")
    if train_tokenizer:
        tokenizer_path = _train_next_to(output_prefix, files, json_key, vocab_size)
    tokenizer_path = str(tokenizer_path)
    tok = load_tokenizer(tokenizer_path)
    dtype = best_dtype(tok.vocab_size)
    t_tok = time.perf_counter()

    stats = dict(files=len(files), skipped_files=0, docs=0, empty_docs=0, tokens=0)
    bar = tqdm(total=len(files), unit="file", desc="tokenize", disable=not progress, dynamic_ncols=True)
    init_args = (tokenizer_path, json_key, append_eos)
    with IndexedDatasetBuilder(output_prefix, dtype) as builder:
        if workers == 1:
            _init_worker(*init_args)
            results = map(_tokenize_file, files)
            pool = None
        else:
            # fork: workers start in milliseconds (no re-import); spawn where fork does not exist.
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with _quiet_tokenizers_fork():
                pool = ctx.Pool(min(workers, len(files)), initializer=_init_worker, initargs=init_args)
            results = pool.imap(_tokenize_file, files, chunksize=1)  # imap keeps input order
        try:
            for flat, lengths, n_empty in results:
                bar.update(1)
                if flat is None:
                    stats["skipped_files"] += 1
                    continue
                builder.add_documents(flat, lengths)
                stats["docs"] += len(lengths)
                stats["empty_docs"] += n_empty
                stats["tokens"] += flat.size
                bar.set_postfix(tokens=stats["tokens"], refresh=False)
        finally:
            bar.close()
            if pool is not None:
                pool.terminate()
                pool.join()
    seconds = time.perf_counter() - t0
    stats.update(prefix=output_prefix, tokenizer=tokenizer_path, vocab_size=tok.vocab_size, dtype=str(dtype),
                 seconds=seconds, tokenize_seconds=time.perf_counter() - t_tok,
                 tokens_per_s=stats["tokens"] / max(seconds, 1e-9))
    return stats


def format_stats(stats: dict) -> str:
    """One summary line for logs and the CLI."""
    return (f"{stats['prefix']}: {stats['docs']} docs, {stats['tokens']} tokens from {stats['files']} files "
            f"({stats['skipped_files']} binary skipped), {stats['seconds']:.1f} s, "
            f"{stats['tokens_per_s']:,.0f} tokens/s, vocab {stats['vocab_size']} ({stats['dtype']}); "
            f"train with data.path={stats['prefix']} data.tokenizer={stats['tokenizer']}")
