"""Processes for router tests: stand-in workers (tests/router/fake_worker.py) and the real
`pdserve router`, each a separate OS process on its own port, stopped by pid at teardown."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.helpers.processes import stop, stop_together, wait_healthy
from tests.net import free_port

ROOT = Path(__file__).resolve().parents[2]
FAKE_WORKER = Path(__file__).with_name("fake_worker.py")


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 90.0, log: Path | None = None) -> None:
    # Generous: a fake worker that loads a tokenizer imports transformers, slow on a busy machine.
    wait_healthy(url, proc, timeout_s, output=lambda: log.read_text(errors="replace")[-2000:] if log else "",
                 ready=lambda r: r.status_code < 500, poll_s=0.05, path="")


@dataclass
class Proc:
    url: str
    popen: subprocess.Popen
    args: list[str] = field(default_factory=list)
    log: Path | None = None  # its stderr

    def stop(self) -> None:
        stop(self.popen, timeout_s=10)

    def control(self, **kw) -> None:
        httpx.post(self.url + "/control", json=kw, timeout=5).raise_for_status()

    def requests(self) -> list[dict]:
        return httpx.get(self.url + "/debug/requests", timeout=5).json()

    def events(self) -> list[dict]:
        """The fake worker's hand-off events, in order (fake_worker.py)."""
        return httpx.get(self.url + "/debug/events", timeout=5).json()

    def kv(self) -> dict:
        return httpx.get(self.url + "/debug/kv", timeout=5).json()


class Launcher:
    def __init__(self, log_dir: Path | None = None) -> None:
        self.procs: list[Proc] = []
        # Each process's stderr goes to a file: a pipe that nobody reads stalls a process once it
        # has logged its buffer's worth (64 KiB), e.g. a warning per failed request in a long module.
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pdserve-test-procs-"))

    def _spawn(self, url: str, cmd: list[str], env: dict | None = None) -> Proc:
        log = self.log_dir / f"{len(self.procs):03d}.log"
        with log.open("wb") as err:
            popen = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
        proc = Proc(url, popen, cmd, log)
        self.procs.append(proc)
        return proc

    def fake_worker(self, *extra: str, host: str = "127.0.0.1", port: int | None = None) -> Proc:
        port = port or free_port(host)
        cmd = [sys.executable, str(FAKE_WORKER), "--host", host, "--port", str(port), *extra]
        proc = self._spawn(f"http://{host}:{port}", cmd)
        wait_http(proc.url + "/health", proc.popen, log=proc.log)
        return proc

    def restart(self, proc: Proc) -> Proc:
        proc.stop()
        fresh = self._spawn(proc.url, proc.args)
        wait_http(fresh.url + "/health", fresh.popen, log=fresh.log)
        return fresh

    def real_pd_workers(self, ckpt, *extra: str, env: dict | None = None, hosts: tuple[str, str] = ("127.0.0.1",) * 2,
                        decode_extra: tuple[str, ...] = ()) -> tuple[Proc, Proc]:
        """A real `pdserve worker` prefill and decode pair (served name "tiny", TCP KV transfer on
        loopback, each allowing its loopback peer), both healthy on return. `hosts`: their HTTP
        addresses (the KV side channel stays on 127.0.0.1); `decode_extra`: the decode worker's own flags."""
        workers = []
        for role, host in zip(("prefill", "decode"), hosts):
            port, kv_port = free_port(host), free_port()
            cmd = [sys.executable, "-m", "pdserve.cli.main", "worker", "--model", str(ckpt), "--served-model-name",
                   "tiny", "--host", host, "--port", str(port), "--role", role, "--kv-transfer", "tcp",
                   "--kv-host", "127.0.0.1", "--kv-port", str(kv_port), "--kv-peer-allow", "127.0.0.1",
                   "--log-level", "warning", *extra, *(decode_extra if role == "decode" else ())]
            workers.append(self._spawn(f"http://{host}:{port}", cmd, env))
        for w in workers:
            wait_http(w.url + "/health", w.popen, timeout_s=180, log=w.log)
        return workers[0], workers[1]

    def router(self, *args: str, env: dict | None = None, wait: bool = True) -> Proc:
        port = free_port()
        cmd = [sys.executable, "-m", "pdserve.cli.main", "router", "--host", "127.0.0.1", "--port", str(port),
               "--probe-interval", "0.2", "--log-level", "warning", *args]
        proc = self._spawn(f"http://127.0.0.1:{port}", cmd, env)
        if wait:
            wait_http(proc.url + "/health", proc.popen, log=proc.log)
        return proc

    def stop_all(self) -> None:
        stop_together([p.popen for p in reversed(self.procs)], timeout_s=10)


@pytest.fixture
def launch(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("procs"))
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="module")
def module_launch(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("procs"))
    yield launcher
    launcher.stop_all()
