#!/usr/bin/env python
"""Tokenize text files into a megak3 indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Inputs are files or directories (walked recursively, sorted, hidden entries skipped):
``*.jsonl``/``*.json`` hold one JSON object per line and ``--json-key`` (default "text") is one
document; any other file (.txt, .py, .md, ...) is ONE document as a whole (UTF-8, bad bytes
replaced); files with NUL bytes are skipped as binary. An eos token ends every document unless
``--no-append-eos``. The work is ``megak3.data.preprocessing.preprocess``; this file only parses flags.

    python tools/preprocess_data.py --input corpus/ --output-prefix data/corpus --train-tokenizer --vocab-size 8192
    python tools/preprocess_data.py --input more.jsonl --output-prefix data/more --tokenizer data/tokenizer.json
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megak3.data.config import DataError  # noqa: E402
from megak3.data.preprocessing import format_stats, preprocess  # noqa: E402


def _usage_error(ap, msg):
    print(f"{ap.prog}: error: {msg} (see --help)", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help="files and/or directories")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    tok = ap.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="existing tokenizer.json")
    tok.add_argument("--train-tokenizer", action="store_true",
                     help="train a byte-level BPE on the inputs; saved as tokenizer.json beside the output")
    ap.add_argument("--vocab-size", type=int, default=8192, help="with --train-tokenizer (default 8192)")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    ap.add_argument("--json-key", default="text", help="text field of .jsonl/.json lines (default 'text')")
    ap.add_argument("--append-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="end every document with <|eos|> (default on)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.error = lambda msg: _usage_error(ap, msg)
    args = ap.parse_args(argv)
    try:
        stats = preprocess(args.input, args.output_prefix, tokenizer_path=args.tokenizer,
                           train_tokenizer=args.train_tokenizer, vocab_size=args.vocab_size,
                           workers=args.workers, json_key=args.json_key, append_eos=args.append_eos,
                           progress=not args.no_progress)
    except DataError as e:
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        return 2
    print(format_stats(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
