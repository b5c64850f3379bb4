"""The host KV tier beside P/D transfer (docs/kv-cache.md): a prefill and a decode worker, both
with --kv-offloading-size and a 16-block device cache, so that every prompt evicts the one
before it to the tier and a repeated prompt is restored from it on both sides. A pull then
writes blocks whose previous contents the same schedule evicted to the tier: those copies must
be done before the pull starts (and a batch of pulls alone runs no step to carry them). The
answers must equal a worker's without the tier.
"""

from __future__ import annotations

import concurrent.futures
import json
import random

import httpx
import pytest

from tests.helpers.engines import make_engine
from tests.helpers.metrics import metric
from tests.helpers.processes import stop_together
from tests.net import free_port
from tests.worker.kv_harness import kv_state, leaves_no_kv
from tests.worker.test_server_harness import WorkerProcess

pytestmark = pytest.mark.slow

ENV = {"PDSERVE_KV_SECRET": "host-tier-pd-tests-shared-secret"}
DEVICE_BLOCKS = 16  # of 4 tokens: two of the prompts below, so a third evicts the first
RESTORED = "pdserve_kv_offload_restored_blocks_total"
STORED = "pdserve_kv_offload_stored_blocks_total"


def prompt(seed: int) -> list[int]:
    """30 token ids: 7 full blocks a repeat can take from a cache, room for the answer's 4."""
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(30)]


def worker_args(ckpt) -> tuple[str, ...]:
    per_block = make_engine(ckpt, block_size=4).kv_cache.block_bytes
    return (
        "--max-model-len",
        "64",
        "--block-size",
        "4",
        "--kv-cache-memory",
        str(DEVICE_BLOCKS * per_block),
        "--kv-peer-allow",
        "127.0.0.1",
        "--kv-pin-ttl",
        "10",
        "--kv-offloading-size",
        str(64 * per_block / 2**30),
    )


@pytest.fixture(scope="module")
def plain(tiny_checkpoint):
    """The reference: one worker, the same device cache, no tier (it recomputes what it evicted)."""
    ckpt = tiny_checkpoint("llama")
    w = WorkerProcess(ckpt, *worker_args(ckpt)[:-2], env=ENV).start()  # ready-waited with the first pair
    try:
        yield w
    finally:
        w.stop()


# TCP only: the ordering under test (the tier's copies done before a pull or pin starts) is the
# engine's, ahead of the connector; both transports' pulls land through the same block writes
# (test_pd_equality.py covers NIXL's), and a NIXL pair costs CI ~50 s more of start and stop.
@pytest.fixture(scope="module")
def pair(tiny_checkpoint, plain):
    ckpt = tiny_checkpoint("llama")
    args = (*worker_args(ckpt), "--kv-transfer", "tcp")
    p = WorkerProcess(ckpt, *args, "--role", "prefill", "--kv-port", str(free_port()), env=ENV).start()
    d = WorkerProcess(ckpt, *args, "--role", "decode", "--kv-port", str(free_port()), env=ENV).start()
    try:
        for w in (plain, p, d):
            w.wait_ready()
        assert kv_state(d)["num_total_blocks"] == DEVICE_BLOCKS
        yield p, d
    finally:
        stop_together([p.proc, d.proc])


def complete(w: WorkerProcess, ids: list[int], max_tokens: int, kv: dict | None = None) -> dict:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    if kv is not None:
        body["kv_transfer_params"] = kv
    r = httpx.post(f"{w.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def answer(out: dict, first: dict | None = None) -> tuple[str, list[float]]:
    """Text and token logprobs; with `first`, the prefill's answer (its first token) before it."""
    c = out["choices"][0]
    text, logprobs = c["text"], c["logprobs"]["token_logprobs"]
    if first is not None:
        f = first["choices"][0]
        text, logprobs = f["text"] + text, f["logprobs"]["token_logprobs"] + logprobs
    return text, logprobs


def disaggregated(p: WorkerProcess, d: WorkerProcess, ids: list[int], streamed: bool) -> tuple[str, list[float]]:
    """The router's P/D path by hand: the prefill worker's one-token prefill pins the prompt,
    the decode worker pulls it and answers the rest. Streamed: the pin is announced at admission
    (with the blocks it has, restored ones included) and the decode worker reads it while the
    prefill computes."""
    if not streamed:
        first = complete(p, ids, 1, {"do_remote_decode": True})
        return answer(complete(d, ids, 4, first["kv_transfer_params"]), first)
    body = {
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "kv_transfer_params": {"do_remote_decode": True, "stream_kv": True},
    }
    with httpx.stream("POST", f"{p.url}/v1/completions", timeout=60, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        early = json.loads(next(lines))["kv_transfer_params"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            decoded = pool.submit(complete, d, ids, 4, early)
            rest = list(lines)
            got = decoded.result(timeout=60)
    return answer(got, json.loads(rest[-1]))


@pytest.mark.parametrize("streamed", [False, True])
def test_pd_with_the_host_tier_answers_as_one_worker_without_it(pair, plain, streamed):
    p, d = pair
    a, b, c = (prompt(seed + 10 * streamed) for seed in (1, 2, 3))
    stored, restored = {w: metric(w, STORED) for w in pair}, {w: metric(w, RESTORED) for w in pair}
    with leaves_no_kv([p, d]):
        got = [disaggregated(p, d, ids, streamed) for ids in (a, b, c, a)]
    want = [answer(complete(plain, ids, 4)) for ids in (a, b, c, a)]
    for (text, logprobs), (want_text, want_logprobs) in zip(got, want):
        assert text == want_text
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    # Both sides evicted a's blocks to the tier and took them back from it (a block of a that the
    # device cache still holds is a device hit instead).
    for w in pair:
        assert metric(w, STORED) - stored[w] >= 7 and metric(w, RESTORED) - restored[w] >= 5, w.url
