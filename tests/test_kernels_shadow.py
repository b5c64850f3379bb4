"""The checkout's `kernels/` folder (pdserve.kernels) must not hide the installed `kernels`
distribution (Hugging Face's kernel hub, which transformers >= 5.25 imports) from a process whose
sys.path starts at the checkout's root: `python -m` run there (`pdserve up`'s workers, the tests'
workers) or pytest itself. A real interpreter in the root, as those workers are started."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_process_started_in_the_checkout_imports_transformers_models():
    script = ("import kernels, transformers.activations, transformers.models.llama.configuration_llama; "
              "print(kernels.__file__)")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # nothing installed to shadow: the folder itself answers `import kernels`
    assert Path(r.stdout.strip()).resolve() != ROOT / "kernels" / "__init__.py"  # the installed one


def test_pdserve_kernels_stays_pdserves():
    import pdserve.kernels

    assert Path(pdserve.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
