#!/usr/bin/env python
"""The import structure of megak3/, parallel/ and moonep/, read from the sources (imports inside
functions included), drawn as packages in layer order, and checked against the layering rules.

    python tools/import_graph.py            # the drawing, then the rule check (exit 1 on a violation)
    python tools/import_graph.py --modules  # also every module-level edge between packages

A "package" is megak3.<sub> (megak3/config.py is `megak3.config`), a sub-package of parallel/
(parallel.pipeline, parallel.tensor_parallel, parallel.data_parallel; the modules directly in parallel/
are `parallel`), or moonep. Rules (``check`` returns the violations; tests/test_layering.py runs it):
  - no import circle between modules, and none between packages;
  - the FORBIDDEN arrows below (parallel/ and moonep/ never import the run-level packages; data,
    inference and train never import posttrain; megak3.data.errors imports nothing of megak3);
  - no .py file above MAX_BYTES outside tests/.
"""
from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ("megak3", "parallel", "moonep")
MAX_BYTES = 30_000
FORBIDDEN = (
    # (importer prefix, imported prefix, why)
    ("parallel", "megak3.train", "parallel/ sits below the training loop"),
    ("parallel", "megak3.launch", "parallel/ sits below the launcher"),
    ("parallel", "megak3.job", "the job config composes parallel.config, never the reverse"),
    ("moonep", "megak3.train", "moonep sits below the training loop"),
    ("moonep", "megak3.launch", "moonep sits below the launcher"),
    ("moonep", "parallel", "moonep is the expert-parallel engine parallel/ drives"),
    ("megak3.ops", "megak3.model", "kernels sit below the model"),
    ("megak3.model", "parallel", "model math receives parallel hooks, never imports them"),
    ("megak3.config", "megak3.model", "the model config sits below the model"),
    ("megak3.launch", "megak3.train", "train's entry point calls the launcher, never the reverse"),
    ("megak3.data", "megak3.posttrain", "post-training sits above data"),
    ("megak3.inference", "megak3.posttrain", "post-training sits above inference"),
    ("megak3.train", "megak3.posttrain", "post-training sits above train"),
    ("megak3.data.errors", "megak3", "the data error type is a leaf"),
)


def modules() -> dict:
    """{dotted module name: path} of every .py file under TREES."""
    out = {}
    for tree in TREES:
        for p in sorted((ROOT / tree).rglob("*.py")):
            name = p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
            out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


def imports(name: str, path: Path) -> set:
    """Module names ``name``'s source imports (relative imports resolved; ``from a import b`` also gives
    ``a.b``)."""
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


def module_edges(mods: dict) -> dict:
    """{module: set of modules of the tree it imports} (a name resolves to its longest module prefix)."""
    edges = {}
    for m, p in mods.items():
        got = set()
        for n in imports(m, p):
            while n and n not in mods:
                n = n.rpartition(".")[0]
            if n and n != m:
                got.add(n)
        edges[m] = got
    return edges


def package_of(m: str, mods: dict) -> str:
    parts = m.split(".")
    if parts[0] == "megak3":
        return ".".join(parts[:2])
    if parts[0] == "parallel" and len(parts) >= 2 and (ROOT / "parallel" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def circles(edges: dict) -> list:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def package_edges(edges: dict, mods: dict) -> dict:
    """{package: {imported package: [module edges]}} between different packages."""
    out = defaultdict(lambda: defaultdict(list))
    for a, bs in edges.items():
        for b in bs:
            pa, pb = package_of(a, mods), package_of(b, mods)
            if pa != pb:
                out[pa][pb].append(f"{a} -> {b}")
    return out


def layers(pedges: dict, packages: set) -> list:
    """Packages grouped by depth: layer 0 imports no other package, layer k only layers < k."""
    depth = {}

    def d(p, seen=()):
        if p in depth:
            return depth[p]
        if p in seen:  # a circle: reported by check(); place it anywhere
            return 0
        depth[p] = 1 + max((d(q, seen + (p,)) for q in pedges.get(p, {})), default=-1)
        return depth[p]

    for p in packages:
        d(p)
    out = defaultdict(list)
    for p, k in depth.items():
        out[k].append(p)
    return [sorted(out[k]) for k in sorted(out)]


def check() -> list:
    """The violations of the rules in the module docstring, one line each (empty when clean)."""
    mods = modules()
    edges = module_edges(mods)
    bad = [f"import circle between modules: {' <-> '.join(c)}" for c in circles(edges)]
    pedges = package_edges(edges, mods)
    pgraph = {p: set(qs) for p, qs in pedges.items()}
    for p in {package_of(m, mods) for m in mods}:
        pgraph.setdefault(p, set())
    bad += [f"import circle between packages: {' <-> '.join(c)}" for c in circles(pgraph)]
    for a, bs in edges.items():
        for b in bs:
            for src, dst, why in FORBIDDEN:
                if (a == src or a.startswith(src + ".")) and (b == dst or b.startswith(dst + ".")):
                    bad.append(f"{a} imports {b}: {why}")
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", ".cache", "build") or rel.parts[0].startswith("."):
            continue
        if p.stat().st_size > MAX_BYTES:
            bad.append(f"{rel} is {p.stat().st_size} bytes (> {MAX_BYTES}): split it along its seams")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modules", action="store_true", help="list the module edges under each package arrow")
    args = ap.parse_args(argv)
    mods = modules()
    edges = module_edges(mods)
    pedges = package_edges(edges, mods)
    packages = {package_of(m, mods) for m in mods}
    for k, layer in enumerate(layers(pedges, packages)):
        print(f"layer {k}")
        for p in layer:
            deps = sorted(pedges.get(p, {}))
            print(f"  {p:28s} -> {', '.join(deps) if deps else '(nothing of the tree)'}")
            if args.modules:
                for q in deps:
                    for e in sorted(pedges[p][q]):
                        print(f"      {e}")
    bad = check()
    print(f"\n{len(mods)} modules, {sum(len(v) for v in edges.values())} module edges, {len(packages)} packages; "
          + ("rules hold" if not bad else f"{len(bad)} violation(s):"))
    for line in bad:
        print(f"  {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
