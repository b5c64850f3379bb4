"""A worker's /v1/models card says what the model was loaded from (`root`, as vLLM's does)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from fastapi.testclient import TestClient

from pdserve.worker.server.app import WorkerState, build_app
from pdserve.worker.server.config import ServerConfig


def _never():
    raise AssertionError("the engine is not loaded in these tests")


def card(model_source):
    # No lifespan (no `with`): the engine never loads, the card is served all the same.
    client = TestClient(build_app(ServerConfig(), "tiny", _never, model_source=model_source))
    (c,) = client.get("/v1/models").json()["data"]
    assert c["id"] == "tiny"
    return c


def test_root_is_the_model_directory_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    assert card("ckpt")["root"] == os.path.join(str(tmp_path), "ckpt")


def test_root_is_the_hub_id_as_given():
    assert card("Qwen/Qwen3-0.6B")["root"] == "Qwen/Qwen3-0.6B"


def test_default_model_root_is_the_engine_directory_once_loaded():
    state = WorkerState(ServerConfig(), "tiny", _never)
    assert state.model_root is None
    state.engine = SimpleNamespace(model_path="/cache/pdserve/smollm2")
    assert state.model_root == "/cache/pdserve/smollm2"
