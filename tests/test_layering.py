"""The package boundaries hold: the worker and the router each import pdserve.protocol, never
each other, and the protocol imports neither (checked by parsing every module's imports, lazy
ones inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(folder: str) -> dict[str, set[str]]:
    """file -> every module it imports (absolute names; relative imports are not used here)."""
    out = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                names.add(node.module or "")
        out[str(path.relative_to(ROOT))] = names
    return out


@pytest.mark.parametrize("folder,forbidden", [
    ("worker", ("pdserve.router",)),
    ("router", ("pdserve.worker",)),
    ("protocol", ("pdserve.worker", "pdserve.router", "pdserve.operator")),
])
def test_no_import_crosses_the_boundary(folder, forbidden):
    found = imported_modules(folder)
    assert found, f"no modules found under {folder}/"
    bad = {f: sorted(m for m in mods if m.startswith(forbidden)) for f, mods in found.items()}
    assert not {f: m for f, m in bad.items() if m}


def test_the_check_sees_imports():
    # Guard against a walker that finds nothing: the worker server does import the protocol.
    assert any(m.startswith("pdserve.protocol") for m in imported_modules("worker")["worker/server/app.py"])
