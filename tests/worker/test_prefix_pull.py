"""A prefix a peer holds, pulled through the KV transport instead of recomputed (docs/kv-cache.md).

Two aggregated workers, shared by the cases: `fast` believes its link is fast
(--kv-prefix-pull-bandwidth 1000 GB/s: it always pulls), `slow` that it is slow (1 kB/s: it
always recomputes). A case pins a prefix on one worker (a one-token prefill of it, as the
router asks for it) and hands the other the whole prompt with that pin as `prefix_from`. The
answer must equal a plain one, and both workers end with nothing pinned or held.

The cases run on TCP. The pull decision, the pin's bookkeeping and the decode side's failure
path are the transports' common code (worker/kv/connector*.py); what differs is the byte mover,
which test_kv_transfer.py and test_kv_nixl.py hold to exact bytes on both transports. One NIXL
pair proves a prefix pull through NIXL is chosen, lands every token and answers exactly
(test_a_nixl_pull_is_chosen_and_exact); a second set of NIXL workers for every case cost CI
about a minute.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import random
import signal
import time

import httpx
import pytest

from tests.helpers.processes import stop_together
from tests.net import free_port
from tests.worker.kv_harness import PD_ARGS, leaves_no_kv, metric
from tests.worker.test_server_harness import WorkerProcess

ENV = {"PDSERVE_KV_SECRET": "prefix-pull-tests-shared-secret"}
BLOCK = 4  # PD_ARGS' --block-size
PULLED = "pdserve_kv_prefix_pulled_tokens_total"
DECISIONS = "pdserve_kv_prefix_pull_decisions_total"


def aggregated(ckpt, transport: str, gbps: float, *extra: str) -> WorkerProcess:
    return WorkerProcess(
        ckpt,
        *PD_ARGS,
        "--kv-transfer",
        transport,
        "--kv-port",
        str(free_port()),
        "--kv-prefix-pull-bandwidth",
        str(gbps),
        # No drain at teardown: a case may leave a pin unread on purpose (a refused one), and
        # SIGTERM's drain would hold the worker for the pin's TTL (30 s). Draining has its own
        # tests (test_server_lifecycle.py, test_kv_transfer.py).
        "--shutdown-grace",
        "0",
        *extra,
        env=ENV,
    ).start()


@contextlib.contextmanager
def fast_and_slow(ckpt, transport: str):
    fast = aggregated(ckpt, transport, 1000, "--kv-pull-timeout", "20")
    slow = aggregated(ckpt, transport, 1e-6)
    try:
        fast.wait_ready()
        slow.wait_ready()
        yield ckpt, transport, fast, slow
    finally:
        stop_together([fast.proc, slow.proc])


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    with fast_and_slow(tiny_checkpoint("llama"), "tcp") as workers:
        yield workers


def prompt(seed: int, n: int = 61) -> list[int]:
    """Token ids no other case used: no worker has any of its blocks yet."""
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def pin_prefix(peer: WorkerProcess, ids: list[int], blocks: int) -> dict:
    """What the router asks of the worker that holds a prefix: a one-token prefill of it that
    keeps its blocks pinned; the answer's params are the pin."""
    r = httpx.post(
        f"{peer.url}/v1/completions",
        timeout=60,
        json={"prompt": ids[: blocks * BLOCK], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def complete(w: WorkerProcess, ids: list[int], kv: dict | None = None) -> dict:
    body = {
        "prompt": ids,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        **({"kv_transfer_params": kv} if kv else {}),
    }
    r = httpx.post(f"{w.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def fast_link_pulls_the_prefix_exactly(fast: WorkerProcess, slow: WorkerProcess) -> None:
    ids = prompt(1)
    with leaves_no_kv([fast, slow]):
        source = pin_prefix(slow, ids, 12)
        pulled, chosen = metric(fast, PULLED, outcome="landed"), metric(fast, DECISIONS, choice="pull")
        got = complete(fast, ids, {"prefix_from": source})
        assert metric(fast, DECISIONS, choice="pull") == chosen + 1
        assert metric(fast, PULLED, outcome="landed") == pulled + 12 * BLOCK  # none of it was cached here
    assert got["choices"][0]["text"] == complete(slow, ids)["choices"][0]["text"]
    # The estimates are published: the link's as fixed, the prefill's measured or its prior.
    assert metric(fast, "pdserve_kv_prefix_pull_link_bytes_per_second") == 1e12
    assert metric(fast, "pdserve_kv_prefix_pull_prefill_tokens_per_second") > 0


def test_fast_link_pulls_the_prefix_and_answers_exactly(pair):
    _, _, fast, slow = pair
    fast_link_pulls_the_prefix_exactly(fast, slow)


def test_a_nixl_pull_is_chosen_and_exact(tiny_checkpoint):
    """The same pull through NIXL (its READ of the peer's blocks): chosen, every token landed,
    the answer exact, nothing left pinned or held."""
    with fast_and_slow(tiny_checkpoint("llama"), "nixl") as (_, _, fast, slow):
        fast_link_pulls_the_prefix_exactly(fast, slow)


def test_slow_link_recomputes_and_releases_the_peer_pin(pair):
    _, _, fast, slow = pair
    ids = prompt(2)
    with leaves_no_kv([fast, slow]):  # the peer's pin is released, not left to its TTL
        source = pin_prefix(fast, ids, 12)
        pulled, chosen = metric(slow, PULLED, outcome="landed"), metric(slow, DECISIONS, choice="recompute")
        got = complete(slow, ids, {"prefix_from": source})
        assert metric(slow, DECISIONS, choice="recompute") == chosen + 1
        assert metric(slow, PULLED, outcome="landed") == pulled
    assert got["choices"][0]["text"] == complete(fast, ids)["choices"][0]["text"]


def test_a_prefill_for_a_remote_decode_pulls_the_prefix_too(pair):
    """A prefill worker (here an aggregated one asked to prefill only) handed a peer's prefix pin
    pulls it, computes the rest, and pins the whole prompt for the decode worker, which reads it:
    the P/D answer equals a plain one."""
    _, _, fast, slow = pair
    ids = prompt(6)
    expected = complete(slow, ids)["choices"][0]["text"]
    with leaves_no_kv([fast, slow]):
        source = pin_prefix(slow, ids, 12)  # slow computed it all above: a pin of cached blocks
        pulled = metric(fast, PULLED, outcome="landed")
        r = httpx.post(
            f"{fast.url}/v1/completions",
            timeout=60,
            json={
                "prompt": ids,
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "prefix_from": source},
            },
        )
        assert r.status_code == 200, r.text
        first = r.json()
        assert metric(fast, PULLED, outcome="landed") == pulled + 12 * BLOCK
        rest = complete(slow, ids, first["kv_transfer_params"])  # the decode leg reads fast's pin
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == expected


def test_a_streamed_prefill_announces_its_pin_while_it_pulls_the_prefix(pair):
    """The streamed hand-off: the prefill worker's pin goes out at admission, while it pulls the
    prefix; the decode worker reads blocks as they become readable (the pulled ones once the
    prefill's next step ran) and the answer equals a plain one."""
    import json

    _, _, fast, slow = pair
    ids = prompt(7)
    expected = complete(slow, ids)["choices"][0]["text"]
    with leaves_no_kv([fast, slow]):
        source = pin_prefix(slow, ids, 12)
        pulled = metric(fast, PULLED, outcome="landed")
        kv = {"do_remote_decode": True, "stream_kv": True, "prefix_from": source}
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "kv_transfer_params": kv}
        with httpx.stream("POST", f"{fast.url}/v1/completions", timeout=60, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            early = json.loads(next(lines))["kv_transfer_params"]
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                decoded = pool.submit(complete, slow, ids, early)  # reads while the prefill pulls and runs
                rest = list(lines)
                got = decoded.result(timeout=60)
        assert metric(fast, PULLED, outcome="landed") == pulled + 12 * BLOCK
        first = json.loads(rest[-1])["choices"][0]["text"]
    assert first + got["choices"][0]["text"] == expected


def test_a_pin_of_another_prompt_is_refused(pair):
    _, _, fast, slow = pair
    source = pin_prefix(slow, prompt(3), 4)
    r = httpx.post(
        f"{fast.url}/v1/completions",
        timeout=60,
        json={"prompt": prompt(4), "max_tokens": 2, "kv_transfer_params": {"prefix_from": source}},
    )
    assert r.status_code == 400 and "not a prefix of this one" in r.json()["error"]["message"]


def test_a_peer_that_dies_mid_pull_costs_a_recompute_not_the_answer(pair):
    ckpt, transport, fast, slow = pair
    ids = prompt(5)
    expected = complete(slow, ids)["choices"][0]["text"]
    peer = aggregated(ckpt, transport, 1e-6).wait_ready()
    try:
        with leaves_no_kv([fast]):
            source = pin_prefix(peer, ids, 12)
            failed, chosen = metric(fast, PULLED, outcome="failed"), metric(fast, DECISIONS, choice="pull")
            peer.proc.send_signal(signal.SIGSTOP)  # the pull connects and waits: mid-pull when it dies
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(complete, fast, ids, {"prefix_from": source})
                deadline = time.monotonic() + 30
                while metric(fast, DECISIONS, choice="pull") == chosen:  # admitted, its pull under way
                    assert time.monotonic() < deadline, "the pull never started"
                    time.sleep(0.05)
                peer.proc.kill()
                got = answer.result(timeout=60)
            assert got["choices"][0]["text"] == expected
            assert metric(fast, PULLED, outcome="failed") == failed + 12 * BLOCK
    finally:
        peer.proc.kill()
        peer.stop()
