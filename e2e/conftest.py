"""Fixtures for the end-to-end tests: the same session fixtures as tests/ (the default model,
converted once into the user cache; tiny random-weight checkpoints)."""

from __future__ import annotations

import pytest

from tests.conftest import default_model_dir, tiny_checkpoint, tokenizer_dir  # noqa: F401  (re-exported fixtures)


@pytest.fixture(scope="session")
def served_name() -> str:
    from pdserve.worker.models.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME
