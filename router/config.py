"""The router's one configuration object, validated once at start-up.

Environment variables are read here and nowhere else (`PDSERVE_API_KEYS`: comma-separated keys,
which is how a Kubernetes Secret is usually mounted into the router pod; `PDSERVE_WORKER_API_KEY`:
the key the router presents to workers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from pdserve.protocol.contract import ENV_API_KEYS, HTTP_PORT, KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT, api_keys_from



def _check_url(url: str, flag: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag}: {url!r} is not an http(s)://host:port URL")
    return url.rstrip("/")


ENV_WORKER_API_KEY = "PDSERVE_WORKER_API_KEY"


def keys_from_env(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    return api_keys_from((os.environ if environ is None else environ).get(ENV_API_KEYS))


def worker_key_from_env(environ: dict[str, str] | None = None) -> str | None:
    return (os.environ if environ is None else environ).get(ENV_WORKER_API_KEY) or None


@dataclass(frozen=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = HTTP_PORT
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    # Discovery: "static" (the URL lists above) or "kubernetes" (namespace + label selector).
    discovery: str = "static"
    namespace: str = "default"
    selector: str = ""
    discovery_interval_s: float = 2.0
    prefill_policy: str = "round-robin"
    decode_policy: str = "least-loaded"
    api_keys: tuple[str, ...] = ()
    # Sent as `Authorization: Bearer` on every call to a worker (requests, probes, scrapes).
    # None: the router's first client key, so workers and router sharing one key just work.
    worker_api_key: str | None = None
    # Prompts estimated shorter than this go straight to a decode worker (local prefill).
    pd_min_prompt_tokens: int = 0
    max_body_bytes: int = 8 * 1024 * 1024
    connect_timeout_s: float = 2.0
    # Upper bound on a prefill call and on a whole non-streaming request.
    request_timeout_s: float = 600.0
    # Longest wait for a streaming upstream's response headers. A worker answers only once its
    # first token exists, so this covers its queueing and (local) prefill: it is no idle gap.
    first_byte_timeout_s: float = 300.0
    # Longest silence tolerated between two chunks of an upstream stream, once it has started.
    stream_idle_timeout_s: float = 120.0
    max_retries: int = 2
    # A worker that fails this many times in a row is ejected, then re-probed with backoff.
    eject_after_failures: int = 3
    eject_backoff_s: float = 1.0
    eject_backoff_max_s: float = 30.0
    probe_interval_s: float = 1.0
    # KV events (prefix-aware policy): every worker publishes on these ports of its own host.
    kv_events_port: int = KV_EVENTS_PORT
    kv_events_replay_port: int = KV_EVENTS_REPLAY_PORT
    # Hugging Face tokenizer directory; needed only by prefix-aware (block hashes need token ids).
    tokenizer: str | None = None
    max_connections: int = 1024
    # Slow or numerous clients (protocol/http_limits.py): request headers must be complete this
    # long after a connection opens, the body must arrive within body_timeout_s; past
    # max_client_connections open connections, new requests get 503.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 30.0
    max_client_connections: int = 4096

    def __post_init__(self) -> None:
        from pdserve.router.policies import available

        if self.discovery not in ("static", "kubernetes"):
            raise ValueError(f"--discovery must be static or kubernetes, not {self.discovery!r}")
        if self.discovery == "static":
            if not self.decode_urls:
                raise ValueError("--decode: at least one decode worker URL is required (or --discovery kubernetes)")
            object.__setattr__(self, "prefill_urls", tuple(_check_url(u, "--prefill") for u in self.prefill_urls))
            object.__setattr__(self, "decode_urls", tuple(_check_url(u, "--decode") for u in self.decode_urls))
        elif not self.selector:
            raise ValueError("--selector is required with --discovery kubernetes (e.g. pdserve.io/modelserving=llama)")
        for flag, name in (("--prefill-policy", self.prefill_policy), ("--decode-policy", self.decode_policy)):
            if name not in available():
                raise ValueError(f"{flag}: unknown policy {name!r} (choose from {', '.join(available())})")
        if "prefix-aware" in (self.prefill_policy, self.decode_policy) and not self.tokenizer:
            raise ValueError("--tokenizer is required by the prefix-aware policy (it hashes the prompt's token ids)")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be 1..65535, not {self.port}")
        if self.pd_min_prompt_tokens < 0:
            raise ValueError("--pd-min-prompt-tokens must be >= 0")
        if self.max_retries < 0 or self.eject_after_failures < 1:
            raise ValueError("--max-retries must be >= 0 and --eject-after-failures >= 1")
        for name in ("connect_timeout_s", "request_timeout_s", "first_byte_timeout_s", "stream_idle_timeout_s", "probe_interval_s",
                     "eject_backoff_s", "discovery_interval_s", "header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.removesuffix('_s').replace('_', '-')} must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("--max-body-bytes must be >= 1024")
        if any(not k for k in self.api_keys):
            raise ValueError("--api-key must not be empty")
        if self.max_client_connections < 1:
            raise ValueError("--max-client-connections must be >= 1")
        if self.worker_api_key is None and self.api_keys:
            object.__setattr__(self, "worker_api_key", self.api_keys[0])
