"""A prefill leg whose first token already ends the answer pins nothing (real worker processes).

The router sends the prefill leg with max_tokens=1 and {"do_remote_decode": true}; when that
token ends the generation (a stop token id, seen by the engine, or a stop string, seen later
by the detokenizer) the router calls no decode worker. The prefill worker must then hand out
no kv_transfer_params and hold no blocks: with --kv-pin-ttl 600 here, a pin left behind
would still be there when these tests poll.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.conftest import Launcher
from tests.router.test_failures import eventually

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Once upon a time in a land far away",
           "Paris is the capital of", "def fibonacci(n):", "Numbers: 1, 2, 3, 4,"]
PREFILL_LEG = {"max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    launcher = Launcher()
    try:
        prefill, decode = launcher.real_pd_workers(tiny_checkpoint("llama"), "--kv-pin-ttl", "600",
                                                   "--block-size", "4", "--max-model-len", "256")
        router = launcher.router("--prefill", prefill.url, "--decode", decode.url)
        yield prefill, decode, router
    finally:
        launcher.stop_all()


@pytest.fixture(scope="module")
def first(stack) -> tuple[str, int, str]:
    """(prompt, greedy first token id, its text) for a prompt whose first token is printable
    and not EOS: a normal prefill leg tells both (its params carry first_token_id); that pin is
    pulled by the decode worker, which is the regression check that normal pins still hold."""
    prefill, decode, _ = stack
    for prompt in PROMPTS:
        r = httpx.post(f"{prefill.url}/v1/completions", json={"model": "tiny", "prompt": prompt, **PREFILL_LEG},
                       timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        params = out.get("kv_transfer_params")
        if out["choices"][0]["finish_reason"] != "length" or not params:
            continue  # EOS first: not this test's subject
        assert prefill.kv()["num_pinned_blocks"] > 0  # a normal prefill leg holds its blocks for the decode
        d = httpx.post(f"{decode.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "kv_transfer_params": params})
        assert d.status_code == 200, d.text
        eventually(lambda: prefill.kv()["num_pinned_blocks"] == 0)  # released by the pull, not the TTL
        text = httpx.post(f"{decode.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}).json()["choices"][0]["text"]
        if text.strip():
            return prompt, int(params["first_token_id"]), text
    pytest.fail("no prompt gave a printable, non-EOS greedy first token")


def no_pins(w) -> bool:
    kv = w.kv()
    return kv["num_pinned_blocks"] == 0 and kv["num_free_blocks"] == kv["num_total_blocks"]


def stopped_prefill_leg(prefill, prompt, **stop) -> dict:
    """A prefill leg (as the router sends it) whose first token ends the answer: no hand-off."""
    r = httpx.post(f"{prefill.url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, **stop, **PREFILL_LEG})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out.get("kv_transfer_params") is None
    return out


def test_stop_string_on_first_token_releases_the_pin(stack, first):
    prefill, _, _ = stack
    prompt, _, text = first
    out = stopped_prefill_leg(prefill, prompt, stop=[text])
    assert out["choices"][0]["text"] == ""  # the stop string itself is not returned
    eventually(lambda: no_pins(prefill))  # the TTL is 600 s: only the release frees them here


def test_stop_token_id_on_first_token_never_pins(stack, first):
    prefill, _, _ = stack
    prompt, token_id, _ = first
    stopped_prefill_leg(prefill, prompt, stop_token_ids=[token_id])
    assert prefill.kv()["num_pinned_blocks"] == 0  # never taken, so nothing to wait for
    eventually(lambda: no_pins(prefill))


def test_router_stop_string_on_first_token(stack, first):
    prefill, decode, router = stack
    prompt, _, text = first
    decode_before = decode.kv()
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stop=[text])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ""
    eventually(lambda: no_pins(prefill))
    assert decode.kv() == decode_before


def test_tensor_parallel_prefill_releases_every_rank(tmp_path_factory, default_model_dir):
    """TP=2 prefill worker: rank 1 mirrors rank 0's pins, and rank 0 frees the blocks only when
    every rank's pin is gone, so the stop-string release must reach rank 1 too (tp_link.py)."""
    from pdserve.worker.kv import side_channel
    from pdserve.worker.kv.auth import SideChannelAuth
    from tests.checkpoints import write_checkpoint
    from tests.worker.test_server_harness import WorkerProcess
    from tests.worker.test_tp_pd import free_kv_ports

    secret = "first-token-finish-tp-secret"
    ckpt = write_checkpoint(tmp_path_factory.mktemp("ckpt-tp"), "llama", default_model_dir, num_key_value_heads=2)
    w = WorkerProcess(ckpt, "--served-model-name", "x", "--max-model-len", "128", "--block-size", "4",
                      "--kv-cache-memory", str(1 << 21), "--role", "prefill", "--kv-transfer", "tcp",
                      "--tensor-parallel-size", "2", "--kv-port", str(free_kv_ports()), "--kv-pin-ttl", "600",
                      env={"PDSERVE_KV_SECRET": secret}).start()
    try:
        w.wait_ready()
        kv = lambda: httpx.get(f"{w.url}/debug/kv", timeout=10).json()  # noqa: E731
        body = {"model": "x", "prompt": PROMPTS[0], "ignore_eos": True, **PREFILL_LEG}
        normal = httpx.post(f"{w.url}/v1/completions", json=body, timeout=120).json()
        params = normal["kv_transfer_params"]
        text = normal["choices"][0]["text"]
        assert kv()["num_pinned_blocks"] > 0
        for rank in (0, 1):  # as a decode worker would after reading every rank's shard
            side_channel.call(params["remote_host"], params["remote_port"] + rank, "release",
                              {"request_id": params["remote_request_id"], "token": params["transfer_token"]},
                              5, SideChannelAuth(secret), params["remote_engine_id"])
        eventually(lambda: kv()["num_pinned_blocks"] == 0)
        if not text:
            pytest.skip("the greedy first token's text is held back (no stop string to match)")
        stopped = httpx.post(f"{w.url}/v1/completions", json={**body, "stop": [text]}, timeout=120).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped.get("kv_transfer_params") is None
        eventually(lambda: kv()["num_pinned_blocks"] == 0 and kv()["num_free_blocks"] == kv()["num_total_blocks"])
    finally:
        w.stop()
