"""The router in front of two real `pdserve worker` processes (tiny checkpoint, CPU, TCP KV
transfer, each in both pools), only one of which serves LoRA adapter `a`: requests for `a` go
there for both legs of the P/D path and answer what that worker answers alone; `/v1/models`
lists `a` with the base as parent; an adapter no worker serves is 404 model_not_found; the
router reads each worker's adapter slots from `vllm:lora_requests_info`."""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.lora_checkpoints import write_adapter
from tests.net import free_port
from tests.router.conftest import wait_http
from tests.router.test_failures import eventually

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def stack(module_launch, tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    adapter = write_adapter(tmp_path_factory.mktemp("lora") / "a", base, seed=1)
    workers = []
    for extra in (("--enable-lora", "--max-loras", "2", "--lora-modules", f"a={adapter}"), ()):
        port = free_port()
        cmd = [sys.executable, "-m", "pdserve.cli.main", "worker", "--model", str(base), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port), "--role", "both", "--kv-transfer", "tcp",
               "--kv-host", "127.0.0.1", "--kv-port", str(free_port()), "--kv-peer-allow", "127.0.0.1",
               "--log-level", "warning", *extra]
        workers.append(module_launch._spawn(f"http://127.0.0.1:{port}", cmd))
    for w in workers:
        wait_http(w.url + "/health", w.popen, timeout_s=180, log=w.log)
    router = module_launch.router(*(f for w in workers for f in ("--prefill", w.url, "--decode", w.url)))
    return workers[0], workers[1], router


def complete(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def test_an_adapter_is_routed_to_the_worker_that_serves_it(stack):
    with_a, without_a, router = stack

    def listed() -> dict:
        return {m["id"]: m for m in httpx.get(router.url + "/v1/models").json()["data"]}

    eventually(lambda: "a" in listed())
    assert listed()["a"]["parent"] == "tiny" and "parent" not in listed()["tiny"]
    slots = {w["url"]: w["max_lora"] for w in httpx.get(router.url + "/debug/workers").json()}
    assert slots == {with_a.url: 2, without_a.url: None}

    want = complete(with_a.url, "a").json()["choices"][0]["text"]  # that worker alone, prefilling locally
    assert want != complete(with_a.url, "tiny").json()["choices"][0]["text"]
    for _ in range(3):  # least-loaded would alternate between idle workers: every one must land on with_a
        r = complete(router.url, "a")
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "a" and r.json()["choices"][0]["text"] == want
    assert 'disaggregated="yes"' in httpx.get(router.url + "/metrics").text
    r = complete(router.url, "b")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert complete(router.url, "tiny").status_code == 200
