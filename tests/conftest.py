from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton reads TRITON_INTERPRET when it is first imported: set it before any test module can
# import a kernel, so CPU-only machines (CI) run the kernels in Triton's interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.helpers.triton_interpreter import patch_interpreter

    patch_interpreter()

# NIXL's threads share CI's 2 cores with a dozen workers at times (its progress thread waits on
# UCX's events, but spins with PDSERVE_NIXL_PROGRESS_DELAY_US=0): niced, they yield to the
# workers (worker/kv/nixl_transport.py). Children inherit it.
os.environ.setdefault("PDSERVE_NIXL_PROGRESS_NICE", "19")

import pytest

from tests.checkpoints import write_checkpoint, write_word_tokenizer
from tests.helpers import run_hooks
from tests.xdist_scopes import (  # noqa: F401  (xdist hooks, registered from this conftest)
    IMAGE_MODULES, module_of, pytest_configure_node, pytest_xdist_make_scheduler, record_units)


@pytest.fixture(autouse=True)
def _cpu_native_step_defaults():
    """Each test starts with the native kernels' per-step switches at their defaults: an engine's
    steps set them (worker/executor/cpu_threads.py) and they outlive the engine in this process."""
    from pdserve.kernels import cpu_native

    cpu_native.set_step_invariant(False)
    cpu_native.set_threads(None)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), converted once into the user cache."""
    from pdserve.worker.models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> Path:
    """The tiny checkpoints' tokenizer: the default model's, or PDSERVE_TEST_TOKENIZER_DIR where
    the default model's package cannot be carried (the GPU suite carries its tokenizer files only)."""
    carried = os.environ.get("PDSERVE_TEST_TOKENIZER_DIR")
    return Path(carried) if carried else request.getfixturevalue("default_model_dir")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer_dir):
    """Factory: tiny_checkpoint("llama" | "llama3-rope" | "qwen2" | "qwen3") -> directory."""
    made: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = write_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}"), arch, tokenizer_dir)
        return made[arch]

    return make


# SmolLM2's widths (two layers) on a word-level vocabulary of 1536: bf16 checkpoints where the
# kernels' sums differ with the batch unless the engine is batch-invariant (at the tiny widths
# oneDNN's and the native GEMM's sums happen to agree). Prompts are token ids (the words are t0..).
WIDE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


@pytest.fixture(scope="session")
def wide_checkpoint(tmp_path_factory):
    """Factory: wide_checkpoint("llama" | "qwen2" | "qwen3") -> directory (WIDE's shapes)."""
    tokenizer = write_word_tokenizer(tmp_path_factory.mktemp("word-tokenizer"))
    made: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in made:
            made[arch] = write_checkpoint(tmp_path_factory.mktemp(f"wide-{arch}"), arch, tokenizer, **WIDE)
        return made[arch]

    return make


def _k8s_modules(items) -> set[str]:
    """Modules with a test on the real control plane."""
    return {module_of(i.nodeid) for i in items
            if i.get_closest_marker("k8s") or "k8s_cluster" in getattr(i, "fixturenames", ())}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Modules with tests on the real control plane run together. In one process they run last:
    the cluster (etcd, apiserver, controllers: a tenth of a core or more even when idle) then
    lives only while they run. Under xdist they are one unit of work (tests/xdist_scopes.py),
    handed out first: mostly waiting on controllers, it runs beside the CPU-bound modules on the
    other worker instead of ending the run alone; then come the modules with slow tests, so that
    none of them starts last. Whole modules move, so module fixtures are set up once."""
    k8s = _k8s_modules(items)
    if not hasattr(config, "workerinput"):  # one process, no xdist worker
        items[:] = [i for i in items if module_of(i.nodeid) not in k8s] + [
            i for i in items if module_of(i.nodeid) in k8s
        ]
        config.stash[run_hooks.K8S_UNIT] = k8s
        return
    if k8s:
        k8s |= set(IMAGE_MODULES)
    config.stash[run_hooks.K8S_UNIT] = k8s
    slow = {module_of(i.nodeid) for i in items if i.get_closest_marker("slow")}
    rank = {
        module: (0 if module in k8s else 1 if module in slow else 2)
        for module in map(module_of, (i.nodeid for i in items))
    }
    items.sort(key=lambda i: rank[module_of(i.nodeid)])  # stable: a module's own order stays
    record_units(config, items, k8s)


def pytest_configure(config):
    run_hooks.register(config)
