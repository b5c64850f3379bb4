"""The tree passes ruff's lint as configured in pyproject.toml ([tool.ruff]: pyflakes, pycodestyle,
120 columns). README's test command runs it, so CI does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_sees_a_violation(tmp_path):
    # The check reads the project's settings and fails on a finding: an undefined name.
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "bad.py").write_text("print(undefined_name)\n")
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "F821" in r.stdout, r.stdout + r.stderr
