"""Every command in the ```bash blocks (and the ``$ `` lines of ```console blocks) of README.md and
docs/*.md is exercised, one of these ways (``way`` decides; the test fails on a command it cannot
place). ``megak3 COMMAND ...`` is first turned into the command it runs (megak3/__main__.py's
``resolve``), then placed like that command. No documented command may span more than three lines.

  run        run as written, in-process, in an empty directory (dry runs, layouts, the planner and
             parameter counts of k3_full on the meta device, --help)
  dry-run    tools/launch.py without --dry-run: run with --dry-run added (composes and validates)
  validate   a training command: its config composed and validated for its ranks, no training
  help       an expensive tool (benchmarks, reports of a run, the ~1 min million-token planner
             searches that tests/test_plan_cp.py runs): its --help runs
  syntax     a shell script: ``bash -n``
  paths      the test suite or a compile step: the files it names exist
  module     a package entry point that needs a checkpoint or a run (python -m megak3.generate,
             megak3.posttrain, the lm-eval adapter): its --help runs
  endpoint   a curl call to the generation server: the path it asks for is one the server routes
             (tests/test_server.py sends the same requests to a live server)
  assign     a shell variable assignment alone (R=$(...)) or a loop's ``for ...; do`` / ``done`` line:
             nothing to run (the loop's body lines are exercised one by one)
"""
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = 3
RUN = {"tools/layout.py", "tools/plan.py", "tools/param_count.py"}


def _blocks(path: Path) -> list:
    """The text of every ```bash block and the ``$ `` command lines (with their continuations) of
    every ```console block of ``path``."""
    text = path.read_text()
    out = re.findall(r"```bash\n(.*?)```", text, re.S)
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        lines, keep, cont = block.splitlines(), [], False
        for line in lines:
            if line.startswith("$ ") or cont:
                keep.append(line[2:] if line.startswith("$ ") else line)
                cont = line.rstrip().endswith("\\")
        out.append("\n".join(keep) + "\n")
    return out


def commands(path: Path) -> list:
    """The commands of ``path`` (``_blocks``): continuation lines joined, comments dropped,
    ``a && b`` split."""
    out = []
    for block in _blocks(path):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*$", "", line).strip()
            out += [" ".join(part.split()) for part in line.split(" && ") if part.strip()]
    return out


MODULES = {"megak3.generate", "megak3.posttrain", "megak3.data.sft", "megak3.data.demo_sft",
           "megak3.inference.lm_eval_adapter", "megak3.checkpoint.convert"}


def way(cmd: str) -> tuple:
    """(how the command is exercised, its argv without the interpreter and environment)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\$\(.*\)", cmd) or re.fullmatch(r"for \w+ in [^;]*; do", cmd) \
            or cmd == "done":
        return "assign", []
    argv = shlex.split(cmd)
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", argv[0]):
        argv = argv[1:]
    if argv and argv[-1] == "&":          # started in the background
        argv = argv[:-1]
    if argv and argv[0] in ("megak3", ".venv/bin/megak3"):
        from megak3.__main__ import resolve

        target, text, code = resolve(argv[1:])
        assert code == 0, (cmd, text)
        if target is None:                # megak3 --help, megak3 bench --help: prints a listing
            return "front", argv[1:]
        target = target[1:]               # drop the interpreter
        if target[0] != "-m":             # a tool: tools/NAME.py ARGS, relative to the checkout
            target = [str(Path(target[0]).relative_to(ROOT))] + target[1:]
        argv = ["python", *target]
    if argv[0] == "curl":
        return "endpoint", argv[1:]
    if argv[0] == "bash":
        return "syntax", argv[1:]
    if argv[0] == "megak3-train":
        return "validate", argv[1:]
    if argv[0] not in ("python", ".venv/bin/python"):
        raise AssertionError(f"no way to exercise {cmd!r}")
    argv = argv[1:]
    if argv[:2] == ["-m", "pytest"] or argv[:2] == ["setup.py", "build_ext"]:
        return "paths", argv
    if argv[:2] in (["-m", "megak3.train"], ["-m", "megak3.launch.torchrun"]):
        return "validate", argv
    if argv[0] == "-m" and argv[1] in MODULES:
        return "module", argv
    tool = argv[0]
    if tool == "tools/launch.py":
        return ("run" if "--dry-run" in argv else "dry-run"), argv
    if tool == "tools/plan.py" and "--min-gpus" in argv and "data.seq_len=1048576" in argv:
        return "help", argv  # a ~1 min search: tests/test_plan_cp.py runs the same one
    if tool in RUN or "--help" in argv:
        return "run", argv
    if tool.startswith("tools/") and tool.endswith(".py"):
        return "help", argv
    raise AssertionError(f"no way to exercise {cmd!r}")


def _run_tool(argv, cwd):
    """Run tools/X.py ARGS as ``python tools/X.py ARGS`` would, in this process; returns stdout."""
    out = io.StringIO()
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = [str(ROOT / argv[0])] + argv[1:]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    except SystemExit as e:
        assert e.code in (0, None), (argv, e.code, out.getvalue()[-2000:])
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    return out.getvalue()


def _run_module(module: str, args: list) -> str:
    """``python -m module args`` in this process; returns what it printed."""
    out = io.StringIO()
    old_argv = sys.argv
    sys.argv = [module] + args
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            # in this one process a module may already be imported (by its package or an earlier command):
            # runpy then warns that it runs a second copy as __main__, which ``python -m`` never does
            warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        assert e.code in (0, None), (module, args, e.code, out.getvalue()[-2000:])
    finally:
        sys.argv = old_argv
    return out.getvalue()


def _validate(argv):
    from torch.distributed.run import parse_args

    from megak3.launch.torchrun import precheck
    from megak3.job.compose import check

    if argv[:2] == ["-m", "megak3.launch.torchrun"]:
        error = precheck(parse_args(argv[2:]), local=False)
    else:
        argv = argv[2:] if argv[:2] == ["-m", "megak3.train"] else argv
        error = check(argv, env={}, local=False)[1]
    assert error is None, (argv, error)


def exercise(kind, argv, cwd):
    if kind == "front":
        from megak3.__main__ import resolve

        assert resolve(argv)[2] == 0 and resolve(argv)[1]
    elif kind == "syntax":
        subprocess.run(["bash", "-n", str(ROOT / argv[0])], check=True)
    elif kind == "paths":
        names = [a for a in argv if a.startswith("tests") or a == "setup.py"]
        assert names and all((ROOT / n).exists() for n in names), argv
    elif kind == "validate":
        _validate(argv)
    elif kind == "run":
        _run_tool(argv, cwd)
    elif kind == "dry-run":
        _run_tool(argv + ["--dry-run"], cwd)
    elif kind == "help":
        assert "usage:" in _run_tool([argv[0], "--help"], cwd)
    elif kind == "module":
        assert "usage:" in _run_module(argv[1], ["--help"] if argv[2:3] != ["serve"] else ["serve", "--help"])
    elif kind == "endpoint":
        url = next(a for a in argv if "/v1/" in a)
        route = "/v1/" + url.split("/v1/", 1)[1]
        assert f'"{route}"' in (ROOT / "megak3" / "inference" / "server.py").read_text(), route


def test_no_command_longer_than_three_lines():
    long = []
    for doc in DOCS:
        for block in _blocks(doc):
            n = 0
            for line in block.splitlines():
                n = n + 1 if n and prev.rstrip().endswith("\\") else 1
                prev = line
                if n > MAX_LINES:
                    long.append(f"{doc.name}: {block.splitlines()[0][:80]}")
    assert not long, long


@pytest.mark.parametrize("doc", [d for d in DOCS if commands(d)], ids=lambda p: p.name)
def test_every_command_is_exercised(doc, tmp_path):
    cmds = commands(doc)
    assert len(cmds) >= (8 if doc.name == "README.md" else 1)
    done = []
    for cmd in cmds:
        kind, argv = way(cmd)
        work = tmp_path / str(len(done))
        work.mkdir()
        exercise(kind, argv, work)
        done.append(f"{kind:9s} {cmd}")
    print("\n".join(done))
