"""The product runs on what README's first command installs, not on what the `dev` extra adds.

The full proof is `.ci/quickstart.py` (a fresh clone and venv, README's first command verbatim);
this is the fast guard: a subprocess in which every test-only package fails to import, that
imports each component and generates with the CPU engine. It once caught Triton, which only
`dev` installed, being imported by the CPU engine at module level.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dev_only_packages() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {re.split(r"[<>=!\[; ]", d)[0].lower() for d in project["dependencies"]}
    dev = {re.split(r"[<>=!\[; ]", d)[0].lower() for d in project["optional-dependencies"]["dev"]}
    # Import names of the distributions; pytest-timeout's plugin hides behind pytest anyway.
    import_names = {"pyyaml": "yaml", "pytest-timeout": "pytest_timeout"}
    return sorted(import_names.get(d, d).replace("-", "_") for d in dev - runtime)


def test_triton_is_not_a_runtime_dependency():
    # The claim the guard below rests on: if Triton became a runtime dependency this test would
    # be moot, so it says so rather than passing vacuously.
    assert "triton" in dev_only_packages()


def test_cpu_path_runs_without_test_only_packages(tiny_checkpoint):
    blocked = dev_only_packages()
    script = textwrap.dedent(f"""
        import sys
        for name in {blocked!r}:
            sys.modules[name] = None  # `import name` now raises ImportError, as if not installed

        import pdserve.worker.server.app, pdserve.worker.server.main  # noqa: F401
        import pdserve.router.app, pdserve.router.main  # noqa: F401
        import pdserve.operator.handlers  # noqa: F401
        from pdserve.worker.cli import main  # noqa: F401
        from pdserve.worker.config import EngineConfig
        from pdserve.worker.engine import LLMEngine
        from pdserve.worker.sampling_params import SamplingParams

        engine = LLMEngine(EngineConfig(model={str(tiny_checkpoint("llama"))!r}, device="cpu", block_size=4,
                                        max_model_len=64, kv_cache_memory=1 << 20))
        out = engine.generate([[5, 17, 300, 42]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0]) == 4, out
        print("ok", sorted(m for m in {blocked!r} if sys.modules.get(m) is not None))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip() == "ok []"
