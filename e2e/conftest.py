"""Fixtures for the end-to-end tests: the same session fixtures as tests/ (the default model,
converted once into the user cache; tiny random-weight checkpoints)."""

from __future__ import annotations

import pytest

from tests.conftest import default_model_dir, tiny_checkpoint, tokenizer_dir  # noqa: F401  (re-exported fixtures)
from tests.helpers import run_hooks


def pytest_configure(config):
    run_hooks.register(config)  # when e2e/ runs without tests/ (whose conftest registers them too)


@pytest.fixture(scope="session")
def served_name() -> str:
    from pdserve.worker.models.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME
