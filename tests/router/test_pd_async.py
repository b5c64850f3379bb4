"""P/D with --async-scheduling on both workers answers exactly as one synchronous worker.

Real processes on a tiny random-weight checkpoint, for each KV transport (tcp, nixl): a prefill
and a decode worker with --async-scheduling, their streamed hand-offs cut into 8-token chunks
(--kv-stream-split even: a prompt of a few dozen tokens runs as several chunks, each launched
before the one before is made readable), the router in front (streamed hand-off, its default),
and beside them a worker without the flag and without KV transfer: the reference. Greedy and
seeded requests (an unseeded sample has nothing to equal), named cases and the property test's
drawn requests (tests/router/test_pd_equality.py).
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given

from tests.helpers.processes import stop_together
from tests.helpers.properties import live_settings
from tests.router.conftest import Launcher
from tests.router.test_pd_equality import ARGS, ENV, TEXTS, assert_same, chat, disaggregated, requests
from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess

pytestmark = pytest.mark.slow

ASYNC = ("--async-scheduling", "--kv-stream-chunk-tokens", "8", "--kv-stream-split", "even")
SINGLE = ARGS[:8]  # served name, context, block size, KV memory: what the P/D workers have, no KV transfer
LONG = " ".join(TEXTS)  # several streamed chunks


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """The synchronous single worker both transports' stacks are compared with: one for the
    module (it holds no KV of theirs), started once instead of once per transport."""
    with WorkerProcess(tiny_checkpoint("llama"), *SINGLE) as single:
        assert "async scheduling on" not in single.output()
        yield single.url


@contextlib.contextmanager
def async_pd_stack(ckpt, transport: str):
    def kv_worker(role):
        return WorkerProcess(ckpt, *ARGS, *ASYNC, "--role", role, "--kv-transfer", transport,
                             "--kv-port", str(free_port()), env=ENV)

    p, d = kv_worker("prefill"), kv_worker("decode")
    launcher = Launcher()
    try:
        for w in (p, d):
            w.start()
        for w in (p, d):
            w.wait_ready()
        assert "async scheduling on" in p.output() and "async scheduling on" in d.output()
        router = launcher.router("--prefill", p.url, "--decode", d.url)
        yield router.url
    finally:
        # signalled together, so the three shutdowns overlap
        stop_together([*(proc.popen for proc in launcher.procs), p.proc, d.proc])


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def stack(request, tiny_checkpoint, reference):
    with async_pd_stack(tiny_checkpoint("llama"), request.param) as router_url:
        yield router_url, reference


GREEDY = {"temperature": 0, "ignore_eos": True}
CASES = {
    "greedy-long": ("completions", {"prompt": LONG, "max_tokens": 12, **GREEDY}),
    "greedy-stream": ("completions", {"prompt": LONG, "max_tokens": 10, "stream": True, **GREEDY}),
    "greedy-chat-logprobs": ("chat", {"messages": chat(LONG), "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
                                      **GREEDY}),
    "seeded": ("completions", {"prompt": LONG, "max_tokens": 10, "seed": 11, "temperature": 1.0}),
    "seeded-n": ("completions", {"prompt": LONG, "max_tokens": 10, "n": 3, "seed": 11, "temperature": 1.0}),
    "seeded-chat-stream": ("chat", {"messages": chat(TEXTS[3]), "max_tokens": 9, "seed": 5, "temperature": 0.8,
                                    "top_p": 0.9, "stream": True}),
    "min-tokens": ("completions", {"prompt": LONG, "max_tokens": 8, "min_tokens": 3, "temperature": 0}),
    "stop-string": ("completions", {"prompt": LONG, "max_tokens": 8, "stop": ["e", " t"], "temperature": 0}),
    "prompt-list": ("completions", {"prompt": [LONG, TEXTS[0]], "max_tokens": 6, **GREEDY}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_named_request_equals_one_synchronous_worker(stack, name):
    route, body = CASES[name]
    before = disaggregated(stack[0])
    assert_same(stack, route, body)
    # A hand-off carries one sequence: prompt lists and n > 1 are served whole by the decode worker.
    one_sequence = body.get("n", 1) == 1 and not isinstance(body.get("prompt"), list)
    if one_sequence and "stop" not in body:  # (a first token that hits a stop string ends on the prefill)
        assert disaggregated(stack[0]) > before


@live_settings(25)
@given(case=requests())
def test_any_request_equals_one_synchronous_worker(stack, case):
    route, body = case
    assert_same(stack, route, body)
