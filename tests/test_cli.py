import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert len(blocks) >= 2, "README must show the two set-up commands first"
    test_command = blocks[1].strip()
    assert "torch==2.13.0" in test_command and "pytest" in test_command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci


def _pdserve(*args):
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", *args], capture_output=True, text=True, timeout=60)


def test_cli_lists_subcommands():
    r = _pdserve("--help")
    assert r.returncode == 0
    for name in ("worker", "router", "operator", "up", "bench"):
        assert name in r.stdout


def test_cli_unknown_subcommand_names_it():
    r = _pdserve("frobnicate")
    assert r.returncode == 2
    assert "frobnicate" in r.stderr
