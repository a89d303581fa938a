#!/usr/bin/env python
"""Tokenize text files into a megak3 indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Inputs are files or directories (walked recursively, sorted, hidden entries skipped):
``*.jsonl``/``*.json`` hold one JSON object per line and ``--json-key`` (default "text") is one
document; any other file (.txt, .py, .md, ...) is ONE document as a whole (UTF-8, bad bytes
replaced); files with NUL bytes are skipped as binary. An eos token ends every document unless
``--no-append-eos``. The work is ``megak3.data.preprocessing.preprocess``; this file only parses flags.

    python tools/preprocess_data.py --input corpus/ --output-prefix data/corpus --train-tokenizer --vocab-size 8192
    python tools/preprocess_data.py --input more.jsonl --output-prefix data/more --tokenizer data/tokenizer.json

Image-text (``--images``): JSON lines ``{"text": "<image> a caption", "images": ["a.png"]}``, one
``--image-marker`` per image, paths relative to the JSON file; writes PREFIX.bin/.idx plus the
image store PREFIX.img.bin/.img.idx (megak3/data/vision_dataset.py). Bad records and images are
skipped and counted in the summary line; an input with no usable record exits 2 with one line.

    python tools/preprocess_data.py --images --input pairs.jsonl --output-prefix data/pairs --train-tokenizer
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megak3.data.errors import DataError  # noqa: E402
from megak3.data.images import DEFAULT_MAX_INPUT_PIXELS, DEFAULT_MAX_PIXELS  # noqa: E402
from megak3.data.preprocessing import format_stats, preprocess  # noqa: E402
from megak3.data.vision_dataset import format_image_stats, preprocess_image_text  # noqa: E402


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
    im = ap.add_argument_group("image-text records (--images)")
    im.add_argument("--images", action="store_true", help="inputs are image-text JSON lines (see above)")
    im.add_argument("--image-key", default="images", help="list-of-paths field (default 'images')")
    im.add_argument("--image-marker", default="<image>", help="marks an image in the text (default '<image>')")
    im.add_argument("--patch-size", type=int, default=14, help="model.vision.patch_size (default 14)")
    im.add_argument("--merge", type=int, default=2, help="model.vision.merge (default 2)")
    im.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                    help=f"stored pixels per image; larger ones are downscaled (default {DEFAULT_MAX_PIXELS})")
    im.add_argument("--max-input-pixels", type=int, default=DEFAULT_MAX_INPUT_PIXELS,
                    help=f"larger files are skipped before decoding (default {DEFAULT_MAX_INPUT_PIXELS})")
    im.add_argument("--odd-modes", choices=("convert", "skip"), default="convert",
                    help="CMYK / palette / 16-bit / alpha images: convert to RGB exactly (default) or skip")
    ap.error = lambda msg: _usage_error(ap, msg)
    args = ap.parse_args(argv)
    try:
        if args.images:
            stats = preprocess_image_text(
                args.input, args.output_prefix, tokenizer_path=args.tokenizer, train_tokenizer=args.train_tokenizer,
                vocab_size=args.vocab_size, text_key=args.json_key, image_key=args.image_key,
                marker=args.image_marker, patch_size=args.patch_size, merge=args.merge, max_pixels=args.max_pixels,
                max_input_pixels=args.max_input_pixels, odd_modes=args.odd_modes, append_eos=args.append_eos)
            print(format_image_stats(stats))
            return 0
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
