"""A real prefill + decode worker pair and the KV bookkeeping checks the P/D tests share."""

from __future__ import annotations

import contextlib
import time

import httpx

from tests.helpers.metrics import metric  # noqa: F401 (the P/D tests import it from here)
from tests.helpers.processes import stop_together
from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess

# A small worker for P/D tests: short context, tiny blocks, a few MiB of KV, loopback peers only.
PD_ARGS = ("--max-model-len", "256", "--block-size", "4", "--kv-cache-memory", str(1 << 22),
           "--kv-peer-allow", "127.0.0.1")


def kv_state(w: WorkerProcess) -> dict:
    return httpx.get(f"{w.url}/debug/kv", timeout=10, headers=w.headers).json()


def wait_clean(w: WorkerProcess, start: dict, timeout: float = 15) -> dict:
    """Pins are freed by the engine loop shortly after release: poll until they are."""
    deadline = time.monotonic() + timeout
    while True:
        s = kv_state(w)
        if (
            s["num_free_blocks"] == start["num_free_blocks"] and s["num_pinned_blocks"] == 0
        ) or time.monotonic() > deadline:
            return s


@contextlib.contextmanager
def pd_pair(ckpt, transport: str, args: tuple, env: dict, pin_ttl: float, pull_timeout: float):
    """(prefill, decode) workers of one transport on loopback, ready; stopped on exit."""
    p = WorkerProcess(ckpt, *args, "--role", "prefill", "--kv-transfer", transport, "--kv-port", str(free_port()),
                      "--kv-pin-ttl", str(pin_ttl), env=env).start()
    d = WorkerProcess(ckpt, *args, "--role", "decode", "--kv-transfer", transport, "--kv-port", str(free_port()),
                      "--kv-pull-timeout", str(pull_timeout), env=env).start()
    try:
        p.wait_ready()
        d.wait_ready()
        yield p, d
    finally:
        stop_together([p.proc, d.proc])  # signalled together: their shutdowns overlap


@contextlib.contextmanager
def leaves_no_kv(workers, timeout: float = 15):
    """The body must leave every worker's free blocks as it found them and nothing pinned."""
    start = {w: kv_state(w) for w in workers}
    yield
    for w in workers:
        end = wait_clean(w, start[w], timeout=timeout)
        assert end["num_free_blocks"] == start[w]["num_free_blocks"], f"{w.url} leaked KV blocks"
        assert end["num_pinned_blocks"] == 0
