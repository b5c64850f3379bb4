"""The local stack's shape: what `pdserve up` runs, as pure data (no process is started here).

`plan(config)` builds every child's command line and environment, so tests can run the same
commands one by one and kill them individually; `cli/launcher.py` starts and watches them.
"""

from __future__ import annotations

import importlib.util
import os
import re
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.worker.config import ENV_KV_SECRET, ConfigError

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class StackConfig:
    model: str | None = None  # None: the default model, converted once by the launcher
    served_model_name: str | None = None
    prefill: int = 1
    decode: int = 1
    host: str = "0.0.0.0"  # the router's bind address; workers listen on loopback only
    port: int = 8000
    device: str = "auto"
    kv_transfer: str | None = None  # None: nixl if importable, else tcp
    worker_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    log_dir: str | None = None  # None: a fresh temporary directory
    ready_timeout_s: float = 600.0
    shutdown_timeout_s: float = 40.0  # then SIGKILL; workers drain in-flight requests meanwhile

    def __post_init__(self):
        if self.prefill < 0:
            raise ConfigError("--prefill", f"must be >= 0 (0 = every request prefills on its decode worker), got {self.prefill}")
        if self.decode < 1:
            raise ConfigError("--decode", f"must be at least 1, got {self.decode}")
        if not 1 <= self.port <= 65535:
            raise ConfigError("--port", f"must be in 1..65535, got {self.port}")
        if self.device not in DEVICES:
            raise ConfigError("--device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.kv_transfer not in (None, "nixl", "tcp"):
            raise ConfigError("--kv-transfer", f"must be nixl or tcp, got {self.kv_transfer!r}")
        if self.kv_transfer == "nixl" and not nixl_installed():
            raise ConfigError("--kv-transfer", "nixl is not installed (pip install 'pdserve[nixl]'), use tcp")
        if self.device == "cuda" and not visible_gpus():
            raise ConfigError("--device", "cuda was asked for but no GPU is visible")
        if self.model is not None and not self.model:
            raise ConfigError("--model", "must not be empty")
        if self.ready_timeout_s <= 0:
            raise ConfigError("--ready-timeout", f"must be > 0 seconds, got {self.ready_timeout_s}")

    @property
    def transport(self) -> str:
        return self.kv_transfer or ("nixl" if nixl_installed() else "tcp")


def nixl_installed() -> bool:
    # find_spec, not import: importing nixl pulls in torch and UCX, seconds the launcher never needs.
    return any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl"))


@dataclass(frozen=True)
class Child:
    name: str  # prefill-0, decode-1, router
    role: str  # prefill | decode | router
    argv: tuple[str, ...]
    env: dict  # added to the launcher's environment
    url: str
    kv_port: int | None = None


def visible_gpus(environ=None) -> list[str]:
    """GPU ids to hand out, without importing torch: CUDA_VISIBLE_DEVICES if set, else /dev/nvidiaN."""
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip() and g.strip() != "-1"]
    found = [m.group(1) for p in Path("/dev").glob("nvidia*") if (m := re.fullmatch(r"nvidia(\d+)", p.name))]
    return sorted(found, key=int)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports. All n sockets stay bound until every port is chosen: a
    port closed at once may be handed out again by the very next bind."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def plan(config: StackConfig, model_dir: str, served_name: str, gpus: list[str] | None = None) -> list[Child]:
    """Every child's command line: workers on loopback with OS-chosen HTTP and KV ports, then
    the router on --host:--port pointing at them. Several workers on one GPU split its memory."""
    gpus = (visible_gpus() if config.device != "cpu" else []) if gpus is None else gpus
    cli = (sys.executable, "-m", "pdserve.cli.main")
    roles = ["prefill"] * config.prefill + ["decode"] * config.decode
    sharing = {g: sum(1 for i in range(len(roles)) if gpus[i % len(gpus)] == g) for g in gpus}
    # The stack's workers authenticate each other's KV side channel with one random secret (in
    # the environment, not argv, so `ps` does not show it) and pull only from loopback peers.
    kv_secret = secrets.token_hex(16)
    children: list[Child] = []
    ports = free_ports(2 * len(roles))
    for i, role in enumerate(roles):
        port, kv_port = ports[2 * i], ports[2 * i + 1]
        env, device = {ENV_KV_SECRET: kv_secret}, ["--device", "cpu"]
        if gpus:
            gpu = gpus[i % len(gpus)]
            env["CUDA_VISIBLE_DEVICES"] = gpu
            device = ["--device", "cuda"]
            if sharing[gpu] > 1 and "--gpu-memory-utilization" not in " ".join(config.worker_args):
                device += ["--gpu-memory-utilization", f"{0.9 / sharing[gpu]:.2f}"]
        index = i if role == "prefill" else i - config.prefill
        argv = (*cli, "worker", "--model", model_dir, "--served-model-name", served_name,
                "--host", "127.0.0.1", "--port", str(port), "--role", role, "--kv-transfer", config.transport,
                "--kv-host", "127.0.0.1", "--kv-port", str(kv_port), "--kv-peer-allow", "127.0.0.1/32",
                *device, *config.worker_args)
        children.append(Child(f"{role}-{index}", role, argv, env, f"http://127.0.0.1:{port}", kv_port))
    pools = [a for c in children for a in (f"--{c.role}", c.url)]
    router = (*cli, "router", "--host", config.host, "--port", str(config.port), *pools, *config.router_args)
    url_host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
    children.append(Child("router", "router", router, {}, f"http://{url_host}:{config.port}"))
    return children


def describe_devices(workers: list[Child]) -> str:
    gpus = sorted({c.env["CUDA_VISIBLE_DEVICES"] for c in workers if "CUDA_VISIBLE_DEVICES" in c.env})
    return f"cuda (GPUs {', '.join(gpus)}, round-robin)" if gpus else "cpu"
