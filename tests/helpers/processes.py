"""Server processes under test: wait until one answers /health, stop one.

Waiting fails at once when the process exits (with what it logged), and after `timeout_s` at
the latest, so a server that cannot start shows its own error instead of a hung test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import httpx


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180, output: Callable[[], str] = str,
                 ready: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
                 poll_s: float = 0.2, path: str = "/health") -> None:
    """Poll `url + path` until `ready(response)`. `output()`: the process's log, for the error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}:\n{output()}")
        try:
            if ready(httpx.get(url + path, timeout=2)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not ready after {timeout_s}s:\n{output()}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60, group: bool = False) -> int:
    """Send `sig` (to its process group with `group`: a child started with start_new_session and
    its own children), wait up to `timeout_s`, then SIGKILL. -> its exit status."""
    if proc.poll() is None:
        send(proc, sig, group)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            send(proc, signal.SIGKILL, group)
            proc.wait()
    return proc.returncode


def stop_together(procs, sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
    """`stop` for several processes (None entries skipped): every one is signalled first, then
    each is waited for (SIGKILL after `timeout_s`), so their shutdowns overlap: a stack's
    teardown costs about its slowest process's exit instead of the sum of all of them. Each gets
    the signal once (a second SIGTERM makes uvicorn skip its graceful shutdown)."""
    procs = [p for p in procs if p is not None and p.poll() is None]
    for p in procs:
        send(p, sig)
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            send(p, signal.SIGKILL)
            p.wait()


def send(proc: subprocess.Popen, sig: int, group: bool = False) -> None:
    """`sig` to the process (or its group); one already gone is no error."""
    try:
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    except ProcessLookupError:
        pass
