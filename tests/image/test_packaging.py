"""What `pip install .` (the image, any non-editable install) ships: every package folder.

The editable install the tests run from sees the whole tree, so a subpackage missing from
pyproject.toml's explicit list only fails in a real install, e.g. the image's worker failing at
start with ModuleNotFoundError (pdserve.worker.server.tool_parsers did, found by tests/image).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_listed_in_pyproject():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]))
    assert found - listed == set(), f"package folders pyproject.toml does not ship: {sorted(found - listed)}"
    assert listed - found == set(), f"listed packages with no folder: {sorted(listed - found)}"
