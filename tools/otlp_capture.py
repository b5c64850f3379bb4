"""A real OTLP trace receiver (tests/helpers/otlp_receiver.py: OTLP/HTTP, and gRPC where grpcio is
installed) for the lab tools, in a process of its own so that decoding the exported spans does
not share the load generator's event loop. Imported by tools/tracing_overhead.py and
tools/trace_picture.py (run by path: this folder is their sys.path[0]).

    with ReceiverProcess() as rx:      # rx.http_url, rx.grpc_url
        ...                            # processes export to rx.http_url
        rx.count()                     # spans received so far (rx.count_not(service): others')
        rx.spans()                     # every span received, as dicts (JSON-ready)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import multiprocessing as mp
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_receiver_module():
    """tests/helpers/otlp_receiver.py loaded by its path: the repository root is never put on
    sys.path (its operator/ folder would shadow the standard library's)."""
    path = ROOT / "tests" / "helpers" / "otlp_receiver.py"
    spec = importlib.util.spec_from_file_location("pdserve_lab_otlp_receiver", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _serve(conn) -> None:
    receiver = load_receiver_module().OTLPReceiver()
    conn.send((receiver.http_url, receiver.grpc_url))
    try:
        while True:
            cmd = conn.recv()
            if cmd == "count":
                conn.send(len(receiver.spans))
            elif isinstance(cmd, tuple) and cmd[0] == "count_not":  # spans not of that service
                conn.send(sum(1 for s in list(receiver.spans) if s.service != cmd[1]))
            elif cmd == "spans":
                conn.send([dataclasses.asdict(s) for s in list(receiver.spans)])
            else:
                break
    finally:
        receiver.close()
        conn.send("closed")


class ReceiverProcess:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.http_url = self.grpc_url = None

    def __enter__(self) -> "ReceiverProcess":
        self._proc.start()
        if not self._conn.poll(60):
            raise RuntimeError("the OTLP receiver process did not start in 60 s")
        self.http_url, self.grpc_url = self._conn.recv()
        return self

    def _ask(self, cmd: str):
        self._conn.send(cmd)
        return self._conn.recv()

    def count(self) -> int:
        return self._ask("count")

    def count_not(self, service: str) -> int:
        """Spans received from every service but `service`."""
        return self._ask(("count_not", service))

    def spans(self) -> list[dict]:
        return self._ask("spans")

    def __exit__(self, *exc) -> None:
        if self._proc.is_alive():
            self._conn.send("stop")
            self._conn.poll(10)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
