"""Layering of megak3.data, megak3.inference and megak3.envs, read from the sources (imports inside
functions included): no import circle among their modules, and data / inference / train never import
megak3.posttrain (the chat template and the SFT data live in megak3.data)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megak3/data", "megak3/inference", "megak3/envs")


def _modules(pkg: str) -> dict:
    """{dotted module name: path} of the package directory ``pkg``."""
    out = {}
    for p in sorted((ROOT / pkg).glob("*.py")):
        name = p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


def _imports(name: str, path: Path) -> set:
    """Every module name ``name``'s source imports (relative imports resolved; ``from a import b`` also
    yields ``a.b``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def test_data_inference_envs_have_no_import_circle():
    mods = {}
    for pkg in PACKAGES:
        mods.update(_modules(pkg))
    edges = {m: {i for i in _imports(m, p) if i in mods and i != m} for m, p in mods.items()}

    def reaches(a, b):
        seen, todo = set(), [a]
        while todo:
            for n in edges[todo.pop()] - seen:
                if n == b:
                    return True
                seen.add(n)
                todo.append(n)
        return False

    circles = sorted(f"{a} <-> {b}" for a in mods for b in edges[a] if reaches(b, a))
    assert not circles, circles


def test_data_inference_train_never_import_posttrain():
    bad = [f"{m} imports {i}" for pkg in ("megak3/data", "megak3/inference", "megak3/train")
           for m, p in _modules(pkg).items() for i in _imports(m, p) if i.startswith("megak3.posttrain")]
    assert not bad, bad


def test_data_errors_is_a_leaf():
    assert not {i for i in _imports("megak3.data.errors", ROOT / "megak3/data/errors.py") if i.startswith("megak3")}
