"""The tree's import structure (tools/import_graph.py): no import circle between modules or packages,
no forbidden arrow (parallel/ and moonep/ never import the run-level packages, data / inference / train
never import posttrain, ...), no .py file above 30 KB outside tests. The checker itself is tested on
small graphs so a broken checker cannot pass the tree by accident."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import import_graph as G  # noqa: E402


def test_tree_keeps_the_layering_rules():
    assert G.check() == []


def test_circles_finds_module_and_longer_circles():
    assert G.circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert G.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert G.circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_imports_resolves_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    src = pkg / "m.py"
    src.write_text("from .q import f\nfrom .. import top\ndef g():\n    from megak3.train import step\n")
    got = G.imports("x.p.m", src)
    assert {"x.p.q", "x.p.q.f", "x", "x.top", "megak3.train", "megak3.train.step"} <= got


def test_forbidden_arrow_is_reported(monkeypatch):
    mods = G.modules()
    real = G.module_edges

    def planted(m):
        e = real(m)
        e["parallel.plan"] = e["parallel.plan"] | {"megak3.train.step"}
        return e

    monkeypatch.setattr(G, "module_edges", planted)
    bad = G.check()
    assert any(line.startswith("parallel.plan imports megak3.train.step") for line in bad), bad
    assert "parallel.plan" in mods and "megak3.train.step" in mods
