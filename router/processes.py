"""`pdserve router --workers N`: N router processes serving one port.

The parent binds the port once and hands the listening socket to N spawned processes; the kernel
spreads new connections over the processes accepting on it. Each process is a whole router:

- health: each probes every worker itself (N probes per interval per worker) and keeps its own
  ejections, so a worker failing one process's calls is ejected there first;
- the KV-event index (prefix-aware): each subscribes to every worker's event stream and replay
  socket itself (ZMQ PUB serves any number of subscribers), so each holds the whole index;
- flow control and other bounds on the pod as a whole are split: each process enforces
  1/N of `--flow-control-max-inflight`, `--flow-control-max-queue`, the per-tenant limits,
  `--max-client-connections`, `--max-connections` and `--hold-queue` (rounded down; a limit
  smaller than N is a configuration error). So no limit is ever exceeded across the pod, but a
  tenant whose requests land unevenly can be held back before it reaches its whole limit;
- /metrics is the scraped process's own (a scrape lands on one process): sum over the pod's
  processes by scraping each, or run one process per pod and scale pods instead.

A process that dies is started again; SIGTERM/SIGINT stop them all (each drains as one router
does) and the parent exits 0.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import signal
import socket
import threading

from pdserve.protocol.flags import ConfigError
from pdserve.router.config import RouterConfig

log = logging.getLogger("pdserve.router")

# The pod-wide bounds each process takes 1/N of: (field, flag, value that means "no limit").
SPLIT = (
    ("flow_control_max_inflight", "--flow-control-max-inflight", 0),
    ("flow_control_max_queue", "--flow-control-max-queue", None),
    ("flow_control_tenant_max_inflight", "--flow-control-tenant-max-inflight", 0),
    ("flow_control_tenant_tokens_per_minute", "--flow-control-tenant-tokens-per-minute", 0),
    ("max_client_connections", "--max-client-connections", None),
    ("max_connections", "--max-connections", None),
    ("hold_queue", "--hold-queue", None),
)


def per_process(config: RouterConfig) -> RouterConfig:
    """What each of `config.workers` processes enforces: 1/N of every pod-wide bound."""
    n = config.workers
    if n == 1:
        return config
    split = {}
    for name, flag_, unlimited in SPLIT:
        value = getattr(config, name)
        if value == unlimited:
            continue
        if value < n:
            raise ConfigError(
                flag_,
                f"{value} cannot be split over --workers {n} processes (each enforces 1/{n}); "
                f"use at least {n} or fewer workers",
            )
        split[name] = value // n
    return dataclasses.replace(config, **split)


def bind(config: RouterConfig) -> socket.socket:
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _child(config: RouterConfig, sock: socket.socket) -> None:
    from pdserve.router.server import serve

    _stop_with_parent()

    serve(config, [sock])


def _stop_with_parent() -> None:
    """SIGTERM this process when the parent dies, however it died (a SIGKILLed parent would
    otherwise leave its processes serving the port). Linux's prctl; elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_processes(config: RouterConfig) -> int:
    """Serve with `config.workers` processes until SIGTERM/SIGINT; 0 once all have stopped."""
    each = per_process(config)
    sock = bind(config)
    ctx = multiprocessing.get_context("spawn")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def start() -> multiprocessing.Process:
        p = ctx.Process(target=_child, args=(each, sock), daemon=False)
        p.start()
        return p

    procs = [start() for _ in range(config.workers)]
    log.info(
        "router serving on %s:%d with %d processes %s", config.host, config.port, len(procs), [p.pid for p in procs]
    )
    while not stop.wait(0.5):
        for i, p in enumerate(procs):
            if not p.is_alive():
                log.warning("router process %d exited (%s); starting another", p.pid, p.exitcode)
                procs[i] = start()
    for p in procs:
        p.terminate()  # SIGTERM: each drains as a single router does
    for p in procs:
        p.join()
    sock.close()
    return 0
