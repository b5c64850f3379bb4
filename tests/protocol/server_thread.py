"""A real uvicorn server on a loopback port in a thread, for the protocol tests that speak raw HTTP
to it (the one definition their module-scoped fixtures share)."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from tests.net import free_port


@contextlib.contextmanager
def serving(app, **options):
    """Yields the port `app` listens on (uvicorn.Config `options`: the ClientLimits' protocol),
    once uvicorn says it has started (bounded: 30 s); stops the server after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)
