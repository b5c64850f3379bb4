"""The router hands the worker it chose a prefix another worker holds (--kv-peer-prefix-min-tokens,
router/peer_prefix.py). Two real aggregated `pdserve worker` processes (tiny checkpoint, CPU, TCP
KV transfer), their real KV events, round-robin routing: the follow-up turn lands on the worker
that lacks the conversation, which pulls it from the other instead of recomputing it, and
answers what the holder answers alone."""

from __future__ import annotations

import sys

import httpx
import pytest

from tests.helpers.metrics import metric
from tests.net import free_port
from tests.router.conftest import wait_http
from tests.router.test_failures import eventually

BLOCK = 4


def _aggregated(launch, ckpt, host: str, events: int):
    port, kv_port = free_port(host), free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli.main",
        "worker",
        "--model",
        str(ckpt),
        "--served-model-name",
        "tiny",
        "--host",
        host,
        "--port",
        str(port),
        "--kv-transfer",
        "tcp",
        "--kv-host",
        "127.0.0.1",
        "--kv-port",
        str(kv_port),
        "--kv-peer-allow",
        "127.0.0.1",
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "256",
        "--kv-events-port",
        str(events),
        "--kv-prefix-pull-bandwidth",
        "1000",
        "--log-level",
        "warning",
    ]
    return launch._spawn(f"http://{host}:{port}", cmd)


@pytest.mark.slow
def test_a_follow_up_on_the_other_worker_pulls_the_conversation_from_its_peer(launch, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    events = free_port("127.0.0.91", span=2)
    workers = [_aggregated(launch, ckpt, host, events) for host in ("127.0.0.91", "127.0.0.92")]
    for w in workers:
        wait_http(w.url + "/health", w.popen, timeout_s=180, log=w.log)
    router = launch.router(
        *(a for w in workers for a in ("--decode", w.url)),
        "--decode-policy",
        "round-robin",
        "--tokenizer",
        str(ckpt),
        "--kv-events-port",
        str(events),
        "--kv-events-replay-port",
        str(events + 1),
        "--kv-peer-prefix-min-tokens",
        "8",
    )

    def complete(url: str, prompt: list[int]) -> str:
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    turn1 = [(i * 7) % 900 + 20 for i in range(10 * BLOCK)]
    complete(router.url, turn1)
    eventually(
        lambda: any((metric(router, "pdserve_router_kv_index_blocks", worker=w.url) or 0) >= 9 for w in workers),
        timeout_s=30,
    )
    holder = next(w for w in workers if metric(router, "pdserve_router_kv_index_blocks", worker=w.url) >= 9)
    other = next(w for w in workers if w is not holder)
    follow = turn1 + [33, 44, 55, 66, 77]
    got = complete(router.url, follow)  # round robin: the other worker
    assert metric(router, "pdserve_router_peer_prefix_pins_total", outcome="pinned") == 1
    assert metric(other, "pdserve_kv_prefix_pulled_tokens_total", outcome="landed") == 10 * BLOCK
    assert got == complete(holder.url, follow)
