from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton reads TRITON_INTERPRET when it is first imported: set it before any test module can
# import a kernel, so CPU-only machines (CI) run the kernels in Triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# NIXL's progress thread busy-polls a core per worker; CI has 2 cores and runs a dozen workers
# at times: niced, it yields to them (worker/kv/nixl_transport.py). Children inherit it.
os.environ.setdefault("PDSERVE_NIXL_PROGRESS_NICE", "19")

import pytest

from tests.checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), converted once into the user cache."""
    from pdserve.worker.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, default_model_dir):
    """Factory: tiny_checkpoint("llama" | "llama3-rope" | "qwen2" | "qwen3") -> directory."""
    made: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = write_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, default_model_dir)
        return made[arch]

    return make


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Modules with tests on the real control plane run last, together: the cluster (etcd,
    apiserver, controllers: a tenth of a core or more even when idle) then lives only while they
    run, not for the whole session. Whole modules move, so module fixtures are set up once."""
    k8s_modules = {i.module for i in items
                   if i.get_closest_marker("k8s") or "k8s_cluster" in getattr(i, "fixturenames", ())}
    if k8s_modules:
        items[:] = [i for i in items if i.module not in k8s_modules] + [i for i in items if i.module in k8s_modules]
