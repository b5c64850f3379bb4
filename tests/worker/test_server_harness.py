"""A real `pdserve worker` process on a free loopback port, for the server tests (and any other
test that needs a worker). No tests live here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.helpers.processes import stop, wait_healthy
from tests.net import free_port


class WorkerProcess:
    """`with WorkerProcess(model_dir, "--max-model-len", "256") as w:` -> w.url serves /v1."""

    def __init__(self, model: Path | str, *args: str, env: dict[str, str] | None = None, ready_timeout: float = 180,
                 host: str | None = "127.0.0.1"):
        """`host`: its --host (None: none given, the worker's default, which is loopback)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "pdserve.cli.main", "worker", "--model", str(model),
                    *(("--host", host) if host else ()), "--port", str(self.port), "--device", "cpu", *args]
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout = ready_timeout
        # With --api-key, /v1, /metrics and /debug/kv need it: helpers send `headers`.
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pdserve-worker-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    def start(self) -> "WorkerProcess":
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self) -> "WorkerProcess":
        wait_healthy(self.url, self.proc, self.ready_timeout, self.output)
        return self

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        return stop(self.proc, sig, timeout)

    def __enter__(self) -> "WorkerProcess":
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
        os.unlink(self.log.name)
