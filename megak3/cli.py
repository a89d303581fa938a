"""One-line command-line errors for entry points that use argparse (the generate CLI and server, the
checkpoint converters, tools/convert_hf.py, tools/bench_sandbox.py): a user mistake is one line
``PROG: error: ...`` on stderr and exit status 2, never a traceback. Imports nothing of megak3 (any
layer may use it)."""
from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def error_exit(prog: str, e: BaseException) -> int:
    """Print ``e`` as one line ``PROG: error: MESSAGE`` on stderr (its whitespace collapsed; the
    exception's type when it has no message) and return the exit status 2."""
    msg = " ".join(str(e).split()) or type(e).__name__
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2
