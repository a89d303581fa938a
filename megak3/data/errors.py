"""The data package's error type and shared fix hint (a leaf: imports nothing of megak3)."""

PREPROCESS_HINT = "run: python tools/preprocess_data.py --input <files or dirs> --output-prefix {prefix} --train-tokenizer"


class DataError(ValueError):
    """A dataset, tokenizer or input file is missing, corrupt or inconsistent; the message says how to fix it."""
