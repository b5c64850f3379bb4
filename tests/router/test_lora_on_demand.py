"""A LoRA adapter only the prefill worker was started with, through the router and real
`pdserve worker` processes (tiny checkpoint, CPU fp32, greedy, TCP KV transfer):

- a decode worker allowed to load adapters at runtime ($VLLM_ALLOW_RUNTIME_LORA_UPDATING) loads
  it from the hand-off's params and answers exactly what the prefill worker answers alone with
  the adapter, for the streamed and the after-prefill hand-off; it serves it from then on;
- a decode worker without that switch is never picked for it: the request is served whole by
  the prefill worker (same answer); a hand-off sent to it directly is 404 model_not_found;
- a hand-off whose adapter cannot be read is a 400 naming the adapter, and the worker serves on."""

from __future__ import annotations

import os
import sys

import httpx
import pytest

from pdserve.protocol.contract import ENV_RUNTIME_LORA, PATH_KV_RELEASE
from pdserve.protocol.kv_transfer import PARAM, prefill_request
from tests.lora_checkpoints import write_adapter
from tests.net import free_port
from tests.router.conftest import wait_http
from tests.router.test_failures import eventually

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def stack(module_launch, tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    d = tmp_path_factory.mktemp("lora")
    a, b = write_adapter(d / "a", base, seed=1), write_adapter(d / "b", base, seed=2)
    env = {k: v for k, v in os.environ.items() if k != ENV_RUNTIME_LORA}
    specs = [("prefill", ("--lora-modules", f"a={a}", f"b={b}"), env),
             ("decode", (), {**env, ENV_RUNTIME_LORA: "true"}),  # loads a hand-off's adapter
             ("decode", (), env)]  # does not
    workers = []
    for role, extra, environ in specs:
        port = free_port()
        cmd = [sys.executable, "-m", "pdserve.cli.main", "worker", "--model", str(base), "--served-model-name", "tiny",
               "--host", "127.0.0.1", "--port", str(port), "--role", role, "--kv-transfer", "tcp",
               "--kv-host", "127.0.0.1", "--kv-port", str(free_port()), "--kv-peer-allow", "127.0.0.1",
               "--log-level", "warning", "--enable-lora", "--max-loras", "2", *extra]
        workers.append(module_launch._spawn(f"http://127.0.0.1:{port}", cmd, environ))
    for w in workers:
        wait_http(w.url + "/health", w.popen, timeout_s=180, log=w.log)
    return workers


def complete(url: str, model: str, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra})


def served(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}


def routed(module_launch, *args: str):
    router = module_launch.router(*args)
    eventually(lambda: {"a", "b"} <= served(router.url))  # the prefill worker's adapters are known
    return router


def test_a_decode_worker_loads_the_adapter_a_hand_off_names(module_launch, stack):
    prefill, loader, _ = stack
    want = {n: complete(prefill.url, n).json()["choices"][0]["text"] for n in ("a", "b")}  # one worker, whole
    assert len({want["a"], want["b"], complete(prefill.url, "tiny").json()["choices"][0]["text"]}) == 3
    assert served(loader.url) == {"tiny"}
    for name, handoff in (("a", "streamed"), ("b", "after-prefill")):
        router = routed(module_launch, "--prefill", prefill.url, "--decode", loader.url, "--pd-handoff", handoff)
        for _ in range(2):  # the first hand-off loads it, the second finds it served
            r = complete(router.url, name)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name and r.json()["choices"][0]["text"] == want[name]
        assert 'disaggregated="yes"' in httpx.get(router.url + "/metrics").text
        card = httpx.get(f"{loader.url}/v1/models/{name}").json()
        assert card["parent"] == "tiny" and card["root"] == httpx.get(f"{prefill.url}/v1/models/{name}").json()["root"]
    base_card = httpx.get(loader.url + "/v1/models/tiny").json()
    assert base_card["runtime_lora_loading"] is True


def test_a_decode_worker_that_may_not_load_it_is_never_picked(module_launch, stack):
    prefill, _, refuser = stack
    want = complete(prefill.url, "a").json()["choices"][0]["text"]
    assert "runtime_lora_loading" not in httpx.get(refuser.url + "/v1/models/tiny").json()
    router = routed(module_launch, "--prefill", prefill.url, "--decode", refuser.url)
    for _ in range(2):  # a hand-off there would be a 404: served whole by the prefill worker instead
        r = complete(router.url, "a")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    assert served(refuser.url) == {"tiny"}
    # Sent there anyway (no router), the hand-off is refused by name, saying what would allow it.
    params = complete(prefill.url, "a", max_tokens=1, **{PARAM: prefill_request({})[PARAM]}).json()[PARAM]
    assert params["lora_name"] == "a" and os.path.isabs(params["lora_path"])
    try:
        r = complete(refuser.url, "a", **{PARAM: params})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert ENV_RUNTIME_LORA in r.json()["error"]["message"]
    finally:
        httpx.post(prefill.url + PATH_KV_RELEASE, json=params, timeout=30)


def test_an_adapter_that_cannot_be_loaded_is_a_clear_400(stack):
    prefill, loader, _ = stack
    params = complete(prefill.url, "a", max_tokens=1, **{PARAM: prefill_request({})[PARAM]}).json()[PARAM]
    try:
        bad = {**params, "lora_name": "gone", "lora_path": "/nonexistent/adapter"}
        r = complete(loader.url, "gone", **{PARAM: bad})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "'gone'" in message and "/nonexistent/adapter" in message
    finally:
        httpx.post(prefill.url + PATH_KV_RELEASE, json=params, timeout=30)
    assert "gone" not in served(loader.url)
    assert complete(loader.url, "tiny").status_code == 200
