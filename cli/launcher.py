"""`pdserve up`: a whole prefill/decode stack on this machine, as child processes.

Prefill workers, decode workers and the router each run as their own `pdserve` process in its
own session (process group), logging to a file in the log directory. The launcher prints each
stage with its time, a ready banner with the OpenAI base URL, then watches: Ctrl-C or SIGTERM
stops every child (router first, so nothing new comes in while workers drain), and a child
that dies on its own stops the rest and exits 1 with that child's last log lines.

What to start comes from `cli/stack.py` (`plan()`, pure); this module starts and watches it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdserve.cli.mps import MpsDaemon, MpsUnavailable, start_mps, stop_mps
from pdserve.cli.stack import Child, StackConfig, describe_devices, plan, stack_gpus, workers_per_gpu
from pdserve.protocol.flags import ConfigError, add_flags, from_flags

TAIL_LINES = 30
_POLL_S = 0.2


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, StackConfig)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


@dataclass
class Running:
    child: Child
    proc: subprocess.Popen
    log_path: Path
    ready_at: float | None = None

    def tail(self, n: int = TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:]) or "(empty log)"


class Launcher:
    def __init__(self, config: StackConfig, out=sys.stdout):
        self.config = config
        self.out = out
        self.t0 = time.monotonic()
        self.running: list[Running] = []
        self.stop_signal: int | None = None

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", file=self.out, flush=True)

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        log_dir = Path(self.config.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        if port_in_use(self.config.host, self.config.port):
            print(f"pdserve up: --port: {self.config.host}:{self.config.port} is already in use", file=sys.stderr)
            return 2
        mps = None
        try:
            model_dir, served = self._model()
            gpus = stack_gpus(self.config)
            mps = self._gpu_sharing(gpus, log_dir)
            children = plan(self.config, model_dir, served, gpus, default_model=self.config.model is None, mps=mps)
            self._start(children, log_dir)
            code = self._wait_ready(served)
            if code is None:
                self._banner(served, log_dir)
                code = self._watch()
        finally:
            self._stop_all()
            if mps is not None and (problem := stop_mps(mps)) is not None:
                self.say(f"  the MPS daemon did not quit cleanly: {problem}")
        return code

    def _gpu_sharing(self, gpus: list[str], log_dir: Path) -> MpsDaemon | None:
        """An MPS daemon for the workers that share a GPU (cli/mps.py), or None."""
        shared = [g for g, n in workers_per_gpu(self.config, gpus).items() if n > 1]
        if not shared or self.config.gpu_sharing == "timeslice":
            return None
        try:
            mps = start_mps(log_dir, shared[0])
        except MpsUnavailable as e:
            if self.config.gpu_sharing == "mps":
                raise ConfigError("--gpu-sharing", f"mps was asked for but the daemon did not start: {e}") from None
            self.say(f"  GPU {', '.join(shared)} shared by several workers, time-sliced (no MPS: {e}); "
                     "their kernels take turns")
            return None
        self.say(f"  GPU {', '.join(shared)} shared by several workers: MPS daemon started (pipes in {mps.pipe_dir})")
        return mps

    def _model(self) -> tuple[str, str]:
        if self.config.model is not None:
            return self.config.model, self.config.served_model_name or self.config.model
        from pdserve.worker.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        self.say(f"stage 1/3 model: default {DEFAULT_MODEL_NAME} (converted once into the cache)")
        t = time.monotonic()
        path = ensure_default_model()  # once here, so N workers never convert it concurrently
        self.say(f"  model at {path} ({time.monotonic() - t:.1f}s)")
        return str(path), self.config.served_model_name or DEFAULT_MODEL_NAME

    def _start(self, children: list[Child], log_dir: Path) -> None:
        workers = [c for c in children if c.role != "router"]
        self.say(f"stage 2/3 processes: {self.config.prefill} prefill + {self.config.decode} decode worker(s), "
                 f"kv-transfer {self.config.transport}, device {describe_devices(workers)}; logs in {log_dir}")
        # Each child leads a process group of its own (stopped with its children by killpg; a
        # terminal's Ctrl-C reaches the launcher only), in the launcher's session: a session of
        # its own would also be a scheduler autogroup of its own (Linux's default), where the NIXL
        # progress thread's nice counts only against its own worker, and a worker whose thread
        # spins (PDSERVE_NIXL_PROGRESS_DELAY_US=0) takes as much of the host as all the rest.
        for c in children:
            path = log_dir / f"{c.name}.log"
            with open(path, "ab") as log:
                proc = subprocess.Popen(c.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env={**os.environ, **c.env}, process_group=0,
                                        preexec_fn=_die_with_parent)
            self.running.append(Running(c, proc, path))
            kv = f" kv-port {c.kv_port}" if c.kv_port else ""
            self.say(f"  started {c.name:<10} pid {proc.pid:<7} {c.url}{kv}")

    def _wait_ready(self, served: str) -> int | None:
        self.say("stage 3/3 health: waiting for every worker, then the router to see them all")
        deadline = time.monotonic() + self.config.ready_timeout_s
        with httpx.Client(timeout=2.0) as http:
            while any(r.ready_at is None for r in self.running):
                if (code := self._check_children()) is not None:
                    return code
                if time.monotonic() > deadline:
                    late = ", ".join(r.child.name for r in self.running if r.ready_at is None)
                    self.say(f"pdserve up: not ready after {self.config.ready_timeout_s:.0f}s: {late}")
                    for r in self.running:
                        if r.ready_at is None:
                            self._print_tail(r)
                    return 1
                for r in self.running:
                    if r.ready_at is None and self._is_ready(http, r):
                        r.ready_at = time.monotonic()
                        self.say(f"  {r.child.name:<10} ready ({r.ready_at - self.t0:.1f}s)")
                time.sleep(_POLL_S)
        return None

    def _is_ready(self, http: httpx.Client, r: Running) -> bool:
        try:
            if r.child.role != "router":
                return http.get(r.child.url + "/health").status_code == 200
            resp = http.get(r.child.url + "/ready")
            if resp.status_code != 200:
                return False
            body = resp.json()
            # The router probes on its own clock: wait until it counts every worker we started.
            return (
                body.get("decode_workers") == self.config.decode and body.get("prefill_workers") == self.config.prefill
            )
        except (httpx.HTTPError, ValueError):
            return False

    def _check_children(self) -> int | None:
        if self.stop_signal is not None:
            self.say(f"{signal.Signals(self.stop_signal).name}: stopping")
            return 0
        for r in self.running:
            if r.proc.poll() is not None:
                self.say(f"pdserve up: {r.child.name} (pid {r.proc.pid}) exited with code {r.proc.returncode}; "
                         f"stopping the stack")
                self._print_tail(r)
                return 1
        return None

    def _print_tail(self, r: Running) -> None:
        print(f"---- last lines of {r.log_path} ----\n{r.tail()}\n----", file=self.out, flush=True)

    def _banner(self, served: str, log_dir: Path) -> None:
        base = self.running[-1].child.url + "/v1"
        body = json.dumps({"model": served, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "max_tokens": 32, "temperature": 0})
        print(f"""
pdserve up: ready in {time.monotonic() - self.t0:.1f}s. OpenAI base URL: {base}   model: {served}

  curl {base}/chat/completions -H 'Content-Type: application/json' \\
    -d '{body}'

  python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{base}", api_key="none")
for chunk in client.chat.completions.create(model="{served}", stream=True, max_tokens=32, temperature=0,
        messages=[{{"role": "user", "content": "What is the capital of France?"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
EOF

Logs: {log_dir}/   Ctrl-C stops the whole stack.
""", file=self.out, flush=True)

    def _watch(self) -> int:
        while True:
            if (code := self._check_children()) is not None:
                return code
            time.sleep(_POLL_S)

    def _stop_all(self) -> None:
        """Router first (no new requests), then the workers (they drain), then SIGKILL stragglers.
        Whole process groups, so nothing a child started outlives the stack."""
        alive = [r for r in self.running if r.proc.poll() is None]
        if not alive:
            return
        self.say(f"stopping {len(alive)} process(es)")
        routers = [r for r in alive if r.child.role == "router"]
        for group in (routers, [r for r in alive if r.child.role != "router"]):
            for r in group:
                _signal_group(r.proc, signal.SIGTERM)
            _wait(group, 10.0 if group is routers else self.config.shutdown_timeout_s)
        for r in alive:
            if r.proc.poll() is None:
                self.say(f"  {r.child.name} did not stop in time: SIGKILL")
            _signal_group(r.proc, signal.SIGKILL)  # also reaps anything left in the group
            r.proc.wait()
        self.say("stopped: " + ", ".join(f"{r.child.name}={r.proc.returncode}" for r in self.running))


def _die_with_parent() -> None:
    """Linux: a child gets SIGTERM if the launcher itself is killed (SIGKILL cannot be caught,
    so this is the only way a `kill -9` of `pdserve up` leaves no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait(group: list[Running], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for r in group:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def run(args: argparse.Namespace) -> int:
    # A ConfigError reaches pdserve.cli.main, which names the flag and exits 2.
    return Launcher(from_flags(StackConfig, args)).run()
