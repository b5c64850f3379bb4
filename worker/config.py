"""Engine configuration: one frozen, validated value built from CLI flags or code."""

from __future__ import annotations

import argparse
import ipaddress
import os
from dataclasses import dataclass, field, fields

ROLES = ("both", "prefill", "decode")
ENV_KV_SECRET = "PDSERVE_KV_SECRET"  # the side channel's shared secret (a Kubernetes Secret, say)
DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A configuration value is invalid; `flag` names the CLI flag responsible."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # local dir or hub id; None = the default model (SmolLM2-135M-Instruct)
    served_model_name: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None = max(2048, max_model_len)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV cache on CPU (None = 1 GiB)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    seed: int = 0
    role: str = "both"
    kv_transfer: str | None = None  # nixl | tcp | None (= nixl if installed, else tcp)
    kv_host: str | None = None  # where the KV side channel listens and what peers are told (default: see kv_bind_host)
    kv_bind_host: str | None = None  # without kv_host: listen here (the CLI passes the HTTP --host); None = loopback
    kv_port: int = 5600
    kv_pin_ttl: float = 30.0
    kv_pull_timeout: float = 30.0  # a silent prefill peer costs this much before local prefill
    kv_peer_allow: tuple[str, ...] = ()  # CIDRs/hosts a decode worker may pull from; empty = none
    kv_max_pulls_per_peer: int = 4  # concurrent pulls (and releases) per prefill peer; more wait their turn
    kv_secret: str | None = field(default=None, repr=False)  # side-channel shared secret; None = unauthenticated
    kv_events_port: int | None = None  # ZMQ PUB port for KV cache events (router prefix-aware)

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("--block-size", f"must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs", f"must be at least 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len", f"must be at least 2, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens", f"must be positive, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("--kv-cache-memory", f"must be a positive number of bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("--gpu-memory-utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in DTYPES:
            raise ConfigError("--dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.role not in ROLES:
            raise ConfigError("--role", f"must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kv_transfer not in (None, "nixl", "tcp"):
            raise ConfigError("--kv-transfer", f"must be nixl or tcp, got {self.kv_transfer!r}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("--device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size", f"must be at least 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and (self.role != "both" or self.kv_transfer is not None):
            # The KV connector moves rank 0's cache only; each rank's head shard is not wired yet.
            raise ConfigError("--tensor-parallel-size", "prefill/decode KV transfer with tensor parallelism is not "
                                                        "supported yet; use --role both without --kv-transfer")
        if self.kv_pull_timeout <= 0:
            raise ConfigError("--kv-pull-timeout", f"must be positive seconds, got {self.kv_pull_timeout}")
        if self.kv_pin_ttl <= 0:
            raise ConfigError("--kv-pin-ttl", f"must be positive seconds, got {self.kv_pin_ttl}")
        if self.kv_max_pulls_per_peer < 1:
            raise ConfigError("--kv-max-pulls-per-peer", f"must be at least 1, got {self.kv_max_pulls_per_peer}")
        if self.kv_secret is not None and len(self.kv_secret) < 16:
            raise ConfigError("--kv-secret", f"must be at least 16 characters (a random string, the same on every "
                                             f"worker of the deployment); got {len(self.kv_secret)}")
        for item in self.kv_peer_allow:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                if not item or "/" in item or any(c.isspace() for c in item):
                    raise ConfigError("--kv-peer-allow", f"{item!r} is neither a CIDR nor a host name") from None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="checkpoint directory or hub id (default: SmolLM2-135M-Instruct, offline)")
        g.add_argument("--served-model-name", default=None)
        g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
        g.add_argument("--dtype", default="auto", choices=DTYPES)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--max-num-seqs", type=int, default=64)
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument("--block-size", type=int, default=16)
        g.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes on CPU (default 1 GiB)")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
        g.add_argument("--enforce-eager", action="store_true", help="disable CUDA graphs")
        g.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="shard the model over this many GPUs (processes on CPU), one process per rank")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--role", default="both", choices=ROLES)
        g.add_argument("--kv-transfer", default=None, choices=("nixl", "tcp"))
        g.add_argument("--kv-host", default=None,
                       help="address the KV side channel listens on and advertises (default: listen where HTTP "
                            "listens, advertise $POD_IP or that address)")
        g.add_argument("--kv-port", type=int, default=5600)
        g.add_argument("--kv-pin-ttl", type=float, default=30.0)
        g.add_argument("--kv-pull-timeout", type=float, default=30.0)
        g.add_argument("--kv-peer-allow", nargs="*", default=[],
                       help="CIDRs/host names a decode worker may pull KV from (default: none)")
        g.add_argument("--kv-max-pulls-per-peer", type=int, default=4)
        g.add_argument("--kv-secret", default=None,
                       help=f"shared secret authenticating the KV side channel (prefer ${ENV_KV_SECRET}: "
                            f"arguments are visible in the process list)")
        g.add_argument("--kv-events-port", type=int, default=None)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, environ=os.environ) -> "EngineConfig":
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if "kv_peer_allow" in kwargs:
            kwargs["kv_peer_allow"] = tuple(kwargs["kv_peer_allow"] or ())
        kwargs.setdefault("kv_bind_host", getattr(args, "host", None))  # the HTTP server's --host
        if not kwargs.get("kv_secret"):
            kwargs["kv_secret"] = environ.get(ENV_KV_SECRET) or None
        return cls(**kwargs)
