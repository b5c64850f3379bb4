"""Real processes for the end-to-end tests.

`UpProcess` runs `pdserve up` itself and reads its stage log. `Stack` starts the very same
children (`pdserve.cli.stack.plan`: same command lines, same environment) one by one, so
a fault test can kill, stop or restart any single worker while the rest keep serving; `pdserve
up` itself would (rightly) take the whole stack down when a child dies. Every process runs in
its own session and is stopped by its process group at teardown.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.cli.stack import StackConfig, plan
from tests.helpers.processes import send, wait_healthy

ROOT = Path(__file__).resolve().parents[1]


def eventually(check, timeout_s: float = 30.0, what: str = "condition"):
    """Poll `check()` until it returns something truthy; fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached in {timeout_s}s (last: {last!r})")


def pid_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie awaiting its parent's wait counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class UpProcess:
    """`pdserve up ARGS` with its stdout in a file; `children` maps name -> (pid, url)."""

    def __init__(self, *args: str, log_path: Path):
        self.cmd = [sys.executable, "-m", "pdserve.cli.main", "up", *args]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> "UpProcess":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 300.0) -> "UpProcess":
        deadline = time.monotonic() + timeout_s
        while "pdserve up: ready in" not in self.output():
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pdserve up not ready after {timeout_s}s:\n{self.output()}")
            time.sleep(0.2)
        return self

    def wait_exit(self, timeout_s: float = 120.0) -> int:
        return self.proc.wait(timeout_s)

    @property
    def base_url(self) -> str:
        return re.search(r"OpenAI base URL: (\S+)", self.output()).group(1)

    @property
    def children(self) -> dict[str, tuple[int, str]]:
        found = re.findall(r"started (\S+)\s+pid (\d+)\s+(http://\S+)", self.output())
        return {name: (int(pid), url) for name, pid, url in found}

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                send(self.proc, signal.SIGKILL, group=True)
                self.proc.wait()
        return self.proc.returncode

    def kill_leftovers(self) -> None:
        """Teardown safety net: SIGKILL any child still alive (a passing test leaves none)."""
        for pid, _ in self.children.values():
            if pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class Stack:
    """The children of `pdserve up`, each started, killed or restarted on its own."""

    def __init__(self, config: StackConfig, model_dir: Path, served_name: str, log_dir: Path):
        self.children = {c.name: c for c in plan(config, str(model_dir), served_name)}
        self.served_name = served_name
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.baseline: dict[str, int] = {}  # free blocks when the worker became healthy

    def url(self, name: str) -> str:
        return self.children[name].url

    @property
    def workers(self) -> list[str]:
        return [n for n, c in self.children.items() if c.role != "router"]

    def start(self, name: str) -> None:
        c = self.children[name]
        with open(self.log_dir / f"{name}.log", "ab") as log:
            self.procs[name] = subprocess.Popen(c.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env={**os.environ, **c.env},
                                                start_new_session=True)

    def wait_healthy(self, name: str, timeout_s: float = 300.0) -> None:
        wait_healthy(self.url(name), self.procs[name], timeout_s, lambda: self.log(name)[-3000:])
        if self.children[name].role != "router":
            self.baseline[name] = self.kv(name)["num_free_blocks"]

    def start_all(self) -> "Stack":
        for name in self.children:
            self.start(name)
        for name in self.children:
            self.wait_healthy(name)
        self.wait_router_sees(prefill=sum(c.role == "prefill" for c in self.children.values()),
                              decode=sum(c.role == "decode" for c in self.children.values()))
        return self

    def wait_router_sees(self, prefill: int, decode: int, timeout_s: float = 60.0) -> None:
        def sees() -> bool:
            r = httpx.get(self.url("router") + "/ready", timeout=2)
            # With one role gone the router serves whole requests on the other: "degraded".
            status = "ready" if prefill and decode else "degraded"
            return r.status_code == 200 and r.json().get("status") == status and \
                (r.json()["decode_workers"], r.json()["prefill_workers"]) == (decode, prefill)

        eventually(sees, timeout_s, f"router sees {prefill} prefill + {decode} decode")

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def signal(self, name: str, sig: int) -> None:
        send(self.procs[name], sig, group=True)
        if sig == signal.SIGKILL:
            self.procs[name].wait(30)

    def restart(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.start(name)  # same ports: the router finds it again at the URL it already knows
        self.wait_healthy(name)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def kv(self, name: str) -> dict:
        return httpx.get(self.url(name) + "/debug/kv", timeout=5).json()

    def leaked_blocks(self) -> dict[str, int]:
        """Per live worker: free blocks missing since it started, plus pinned ones; 0 = no leak."""
        out = {}
        for name in [n for n in self.workers if self.alive(n)]:
            kv = self.kv(name)
            out[name] = self.baseline[name] - kv["num_free_blocks"] + kv["num_pinned_blocks"]
        return out

    def no_leaks(self) -> dict[str, int] | None:
        """For eventually(): the (all-zero) leak table once every live worker is back to its start."""
        leaks = self.leaked_blocks()
        return leaks if not any(leaks.values()) else None

    def stop_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                send(proc, signal.SIGCONT, group=True)  # a SIGSTOPped child cannot handle SIGTERM
                send(proc, signal.SIGTERM, group=True)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                send(proc, signal.SIGKILL, group=True)
                proc.wait()
