"""No file-level import cycle inside the package: a module never imports, through any chain,
a module that imports it back. Lazy imports inside functions count (they only move the cycle
to run time), and so does a package's __init__ importing a submodule that imports the package.

Checked by parsing, not importing: `from a.b import c` is an edge to module a.b.c when that is
a module, else to a.b."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.run_hooks import PACKAGES

ROOT = Path(__file__).resolve().parents[1]


def module_files(root: Path, packages: tuple[str, ...], prefix: str) -> dict[str, Path]:
    """dotted module name -> file, for every .py under each package folder."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if f"{node.module}.{a.name}" in modules:
                        deps.add(f"{node.module}.{a.name}")
                    elif node.module in modules:
                        deps.add(node.module)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in component for b in sorted(graph[a]) if b in component]
    return " | ".join(edges)


def test_no_import_cycle():
    modules = module_files(ROOT, PACKAGES, "pdserve")
    assert len(modules) > 100, f"only {len(modules)} modules found: is ROOT right?"
    graph = import_graph(modules)
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(c, graph) for c in found)


def test_the_check_finds_a_cycle(tmp_path):
    """A synthetic package with a lazy two-file cycle and a package <-> submodule cycle, so that
    the check above cannot pass by seeing nothing."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pdserve.pkg.b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from pdserve.pkg import a\n")
    (pkg / "c.py").write_text("import pdserve.pkg.a\n")  # into the cycle, not part of it
    (pkg / "sub" / "__init__.py").write_text("from pdserve.pkg.sub.leaf import x\n")
    (pkg / "sub" / "leaf.py").write_text("from pdserve.pkg.sub import y\n")
    graph = import_graph(module_files(tmp_path, ("pkg",), "pdserve"))
    assert graph["pdserve.pkg.b"] == {"pdserve.pkg.a"}  # `from pkg import a`: the module, not the package
    assert cycles(graph) == [["pdserve.pkg.a", "pdserve.pkg.b"], ["pdserve.pkg.sub", "pdserve.pkg.sub.leaf"]]
