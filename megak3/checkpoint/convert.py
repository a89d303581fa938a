"""Convert a megak3 checkpoint to torch.distributed.checkpoint (DCP) and back, losslessly (:mod:`.dcp`).

    python -m megak3.checkpoint.convert --to-dcp runs/x/checkpoints runs/x/dcp_step_00000100
    python -m megak3.checkpoint.convert --from-dcp runs/x/dcp_step_00000100 runs/y/checkpoints

``--to-dcp SRC DST``: SRC is a checkpoint directory (``step_XXXXXXXX``) or a root whose newest complete
checkpoint is taken; DST a new directory, then readable by DCP's tools
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save DST out.pt``). ``--from-dcp SRC DST``: SRC
a DCP directory written by ``--to-dcp``; DST a checkpoint root: the checkpoint becomes
``DST/step_XXXXXXXX`` (same step) and ``DST/latest`` points at it, so ``train.resume=auto`` with
``train.run_dir`` above it (or ``train.resume=DST/step_XXXXXXXX``) resumes from it at any layout. Prints the
directory written; a bad argument is one line on stderr, exit 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..cli import Parser, error_exit


def _source_checkpoint(src) -> Path:
    from .atomic import MANIFEST_NAME, find_latest

    path = Path(src)
    if (path / MANIFEST_NAME).is_file():
        return path
    found = find_latest(path) if path.is_dir() else None
    if found is None:
        raise ValueError(f"{path} is neither a checkpoint directory nor a root holding a complete one")
    return found


def main(argv=None) -> int:
    p = Parser(prog="python -m megak3.checkpoint.convert",
                description="Convert a megak3 checkpoint to torch.distributed.checkpoint (DCP) or back.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-dcp", action="store_true", help="megak3 checkpoint SRC -> new DCP directory DST")
    mode.add_argument("--from-dcp", action="store_true", help="DCP directory SRC -> megak3 checkpoint root DST")
    p.add_argument("src")
    p.add_argument("dst")
    args = p.parse_args(argv)
    try:
        from . import dcp

        if args.to_dcp:
            out = dcp.to_dcp(_source_checkpoint(args.src), args.dst)
        else:
            if not (Path(args.src) / dcp.METADATA_FILE).is_file():
                raise ValueError(f"{args.src} is not a DCP checkpoint directory (no {dcp.METADATA_FILE})")
            out = dcp.from_dcp(args.src, args.dst)
    except Exception as e:  # noqa: BLE001 - any failure is reported as one line
        return error_exit(p.prog, e)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
