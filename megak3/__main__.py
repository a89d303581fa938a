"""``megak3 COMMAND ...`` (or ``python -m megak3 COMMAND ...``): one front door to every entry point.

Each subcommand replaces this process with the module or tool it names (``os.execv`` of
``python -m MODULE ARGS`` or ``python tools/NAME.py ARGS``), so ``megak3 train parallel=tp2_sp`` is
exactly ``python -m megak3.train parallel=tp2_sp``: same arguments, same output, same exit status.
The ``python -m`` forms keep working. ``megak3 --help`` lists the commands; ``megak3 COMMAND --help``
is the command's own help. ``bench NAME`` runs ``tools/bench_NAME.py``, ``tool NAME`` any other
``tools/NAME.py``; the tools live in the source checkout (they are scripts, not installed modules).
A bad command is one line on stderr and exit status 2.
"""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

PROG = "megak3"
TOOLS_DIR = Path(__file__).resolve().parent.parent / "tools"

COMMANDS: Dict[str, Tuple[str, List[str], str]] = {
    # name: (kind "module" | "tool", target + leading arguments, one line of help)
    "train": ("module", ["megak3.train"], "train a model (Hydra config; one process, or one rank under a launcher)"),
    "launch": ("module", ["megak3.launch.torchrun"], "torchrun for megak3: launch N ranks of a module, e.g. -m megak3.train"),
    "generate": ("module", ["megak3.generate"], "generate text from a checkpoint (CLI, JSONL in/out)"),
    "serve": ("module", ["megak3.generate", "serve"], "serve a checkpoint over an OpenAI-compatible HTTP API"),
    "eval": ("module", ["megak3.inference.lm_eval_adapter"], "evaluate a checkpoint with lm-eval (same arguments as lm_eval)"),
    "posttrain": ("module", ["megak3.posttrain"], "RL post-training (GRPO, partial rollouts, agentic, MOPD)"),
    "sft-data": ("module", ["megak3.data.sft"], "tokenize chat JSONL into an SFT dataset (assistant-only labels)"),
    "convert": ("module", ["megak3.checkpoint.convert"], "convert a megak3 checkpoint to DCP and back, losslessly"),
    "hf": ("tool", ["convert_hf"], "export a checkpoint to the Kimi-K3 Hugging Face format (tools/convert_hf.py)"),
    "plan": ("tool", ["plan"], "memory / FLOPs / communication / step-time planner for a layout (tools/plan.py)"),
    "data": ("tool", ["preprocess_data"], "tokenize text files into an indexed dataset (tools/preprocess_data.py)"),
    "bench": ("bench", [], "run a benchmark: megak3 bench NAME [ARGS] (tools/bench_NAME.py; --help lists them)"),
    "tool": ("tool*", [], "run any other tool: megak3 tool NAME [ARGS] (tools/NAME.py; --help lists them)"),
}


def _first_doc_line(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text()))
    except (OSError, SyntaxError, ValueError):
        return ""
    return (doc or "").strip().splitlines()[0] if doc else ""


def _tools(prefix: str = "") -> Dict[str, Path]:
    if not TOOLS_DIR.is_dir():
        return {}
    return {p.stem[len(prefix):]: p for p in sorted(TOOLS_DIR.glob(f"{prefix}*.py"))
            if not p.stem.startswith("_")}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {PROG} COMMAND [ARGS...]   ({PROG} COMMAND --help: that command's own help)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, _, text) in COMMANDS.items()]
    lines += ["", f"Each command runs the module or tool it names with ARGS unchanged; the 'python -m' forms work too."]
    return "\n".join(lines)


def _list(kind: str) -> str:
    found = _tools("bench_") if kind == "bench" else \
        {k: v for k, v in _tools().items() if not k.startswith("bench_")}
    if not found:
        return f"{PROG} {kind}: no tools directory at {TOOLS_DIR} (the tools ship with the source checkout)"
    width = max(map(len, found))
    title = "benchmarks" if kind == "bench" else "tools"
    head = f"usage: {PROG} {kind} NAME [ARGS...]   ({PROG} {kind} NAME --help: that tool's own help)\n\n{title}:"
    return head + "\n" + "\n".join(f"  {n:<{width}}  {_first_doc_line(p)}" for n, p in found.items())


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def resolve(argv: List[str]) -> Tuple[Optional[List[str]], Optional[str], int]:
    """(argv to exec, text to print, exit status). Exactly one of the first two is set unless it failed."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        return None, usage(), 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = [c for c in COMMANDS if c.startswith(name[:2])] if not name.startswith("-") else []
        hint = f" (did you mean {' / '.join(close)}?)" if close else ""
        return None, f"unknown command {name!r}{hint}; run '{PROG} --help' for the list", 2
    kind, target, _ = COMMANDS[name]
    if kind == "module":
        return [sys.executable, "-m", *target, *rest], None, 0
    if kind in ("bench", "tool*"):
        label = "bench" if kind == "bench" else "tool"
        if not rest or rest[0] in ("-h", "--help"):
            return None, _list(label), 0
        found = _tools("bench_") if kind == "bench" else _tools()
        tool, rest = rest[0], rest[1:]
        if tool not in found:
            names = ", ".join(k for k in found if kind == "bench" or not k.startswith("bench_")) or "none found"
            return None, f"{label}: no {label} {tool!r} (choose from: {names})", 2
        return [sys.executable, str(found[tool]), *rest], None, 0
    path = TOOLS_DIR / f"{target[0]}.py"
    if not path.is_file():
        return None, f"{name}: {path} is missing (the tools ship with the source checkout)", 2
    return [sys.executable, str(path), *rest], None, 0


def main(argv: Optional[List[str]] = None) -> int:
    cmd, text, code = resolve(list(sys.argv[1:] if argv is None else argv))
    if cmd is None:
        if code:
            return _fail(text)
        print(text)
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
