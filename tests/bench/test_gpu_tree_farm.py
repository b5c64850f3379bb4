"""tools/gpu/lib.sh's tree_farm, which every A/B script (offline_ab.sh, offline_steps.sh,
small_models.sh) and gpu_deps build their importable trees with: run here, since the device
machine is the only other place it runs."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def farm(tree: str, dest: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f'source tools/gpu/lib.sh && tree_farm "{tree}" "{dest}"'], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_a_folder_and_an_archive_become_pdserve(tmp_path):
    old = tmp_path / "old"
    for d in ("worker", "kernels"):  # an older tree: only some of the top-level folders
        (old / d).mkdir(parents=True)
        (old / d / "marker.py").write_text(f"TREE = 'old {d}'\n")
    archive = tmp_path / "old.tar.gz"
    with tarfile.open(archive, "w:gz") as t:
        for d in ("worker", "kernels"):
            t.add(old / d, arcname=d)
    for tree, dest in ((str(old), tmp_path / "farm-dir"), (str(archive), tmp_path / "farm-tar")):
        done = farm(tree, dest)
        assert done.returncode == 0, done.stderr
        assert sorted(p.name for p in (dest / "pdserve").iterdir()) == ["kernels", "worker"]
        assert (dest / "pdserve" / "worker" / "marker.py").read_text() == "TREE = 'old worker'\n"
    # The repo's own tree, by a relative path (from the repo root): every folder it has.
    done = farm(".", tmp_path / "farm-repo")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "farm-repo" / "pdserve" / "kernels").resolve() == REPO / "kernels"


def test_an_archive_that_is_not_there_fails_and_says_so(tmp_path):
    done = farm(str(tmp_path / "missing.tar.gz"), tmp_path / "farm")
    assert done.returncode != 0 and "cannot unpack" in done.stderr
