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
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; (]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def runtime_closure() -> set[str]:
    """Every distribution README's first command installs: pdserve's dependencies (no extras but
    nixl) and theirs, recursively, from the installed metadata."""
    seen: set[str] = set()
    todo = [_name(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    todo.append("nixl-cu13")
    while todo:
        dist = todo.pop()
        if dist in seen:
            continue
        seen.add(dist)
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r and "extra==" not in r]
    return seen


def dev_only_packages() -> list[str]:
    """Import names of what only the `dev` extra brings: its distributions not in the runtime closure."""
    dev = {
        _name(d)
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    }
    only_dev = dev - runtime_closure()
    # A namespace package that runtime distributions share stays importable (`opentelemetry`:
    # fastapi needs its API, only the SDK is dev's).
    modules = {mod for mod, dists in metadata.packages_distributions().items()
               if all(_name(d) in only_dev for d in dists) and mod.isidentifier()}
    return sorted(modules)


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

        import pdserve.operator.handlers  # noqa: F401
        import pdserve.router.app, pdserve.router.main  # noqa: F401
        import pdserve.worker.server.app, pdserve.worker.server.main  # noqa: F401
        from pdserve.cli.main import main  # noqa: F401
        from pdserve.worker.config.engine import EngineConfig
        from pdserve.worker.engine.llm_engine import LLMEngine
        from pdserve.worker.request.sampling_params import SamplingParams

        engine = LLMEngine(EngineConfig(model={str(tiny_checkpoint("llama"))!r}, device="cpu", block_size=4,
                                        max_model_len=64, kv_cache_memory=1 << 20))
        out = engine.generate([[5, 17, 300, 42]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(out[0]) == 4, out
        print("ok", sorted(m for m in {blocked!r} if sys.modules.get(m) is not None))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd="/")
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.strip() == "ok []"
