"""What the built wheel (the image installs it; so would `pip install pdserve`) holds: the
benchmarks users run, never the lab. The GPU scripts and one-off harnesses live in tools/gpu/,
which no package lists; this builds the wheel once, as the Dockerfile does, and reads it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from pdserve.bench.main import BENCHMARKS

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel built from a copy of what the Dockerfile copies (a build in the tree would leave
    build/ and egg-info behind, and race another run's)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in set(PYPROJECT["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_wheel({str(out)!r})"],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (path,) = out.glob("pdserve-*.whl")
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_no_gpu_script_or_lab_harness(wheel):
    names = wheel.namelist()
    assert not [n for n in names if n.endswith(".sh")], "shell scripts in the wheel"
    assert not [n for n in names if n.startswith("tools/") or "/tools/" in n], "tools/ in the wheel"
    assert not [n for n in names if Path(n).name.startswith("gpu_")], "a gpu_* file in the wheel"
    harnesses = {p.name for p in (ROOT / "tools" / "gpu").glob("*.py")}
    assert harnesses, "tools/gpu/ holds the harnesses this test keeps out"
    assert not [n for n in names if n.startswith("pdserve/bench/") and Path(n).name in harnesses]


def test_every_user_facing_benchmark_is_shipped_with_what_it_imports(wheel):
    names = set(wheel.namelist())
    for module in {*BENCHMARKS.values(), "pdserve.bench.main"}:
        assert module.replace(".", "/") + ".py" in names, f"`pdserve bench` runs {module}, not in the wheel"
    # every pdserve.bench module a shipped bench module imports is shipped too (lazy imports included)
    bench = {n for n in names if n.startswith("pdserve/bench/") and n.endswith(".py")}
    for n in bench:
        imported = set()
        for node in ast.walk(ast.parse(wheel.read(n))):
            if isinstance(node, ast.ImportFrom) and node.module == "pdserve.bench":
                imported |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pdserve.bench."):
                imported.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[2] for a in node.names if a.name.startswith("pdserve.bench.")}
        missing = [m for m in imported if f"pdserve/bench/{m}.py" not in bench]
        assert not missing, f"{n} imports {missing}, which the wheel lacks"
    assert "pdserve/cli/main.py" in names and any(n.endswith("entry_points.txt") for n in names)
