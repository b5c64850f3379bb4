"""One router process: the app under uvicorn until SIGTERM/SIGINT (router/main.py runs one, or
router/processes.py runs N on one bound socket)."""

from __future__ import annotations

import logging
import signal

from pdserve.protocol.http_limits import ClientLimits
from pdserve.protocol.native_http import NativeProtocol
from pdserve.router.config import RouterConfig


def serve(config: RouterConfig, sockets: list | None = None) -> None:
    """One router process until SIGTERM/SIGINT; on `sockets` (already listening) when given."""
    import uvicorn

    from pdserve.router.app import build_app

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config, freeze_heap=True)
    # The generation routes' plain requests skip the ASGI stack (protocol/native_http.py).
    native = app.native_routes(config.max_body_bytes, config.body_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=config.log_level, access_log=False, loop="auto",
                                           # the client's address is never read: no X-Forwarded-For
                                           # rewrite per request
                                           proxy_headers=False,
                                           **ClientLimits(config.header_timeout_s, config.keep_alive_s,
                                                          config.max_client_connections).uvicorn_options(
                                               hold_head=True, protocol=NativeProtocol, native=native)))
    # uvicorn re-raises a caught SIGTERM/SIGINT once it has shut down, so the process would die
    # "by the signal" (-15) after a clean drain; the handlers it restores ignore that replay, so
    # a graceful stop exits 0 like the workers do.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=sockets)
