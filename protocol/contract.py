"""Names and numbers more than one component must agree on.

A Kubernetes label, a port or an environment variable read by one process and written by
another (the operator renders them into pod specs; the router reads them back) is defined
here once, so a rename cannot leave the two sides disagreeing.
"""

from __future__ import annotations

# Pod labels: which ModelServing a pod belongs to, its role, and the spec revision it came
# from (the router pairs a prefill and a decode worker only within one revision).
LABEL_MODELSERVING = "pdserve.io/modelserving"
LABEL_ROLE = "pdserve.io/role"
LABEL_REVISION = "pdserve.io/revision"

# Worker roles as labelled and as discovered; a "both" worker serves in either pool.
ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH = "prefill", "decode", "both"

# A completions request's max_tokens when it names none (OpenAI's default): the router's
# prefill request carries it to the prefill worker as the client's decode budget.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# The most alternatives a logprobs field asks for (OpenAI's top_logprobs cap; vLLM's default too).
MAX_LOGPROBS = 20

# The OpenAI HTTP port of workers and routers, and its name in a pod's container ports.
HTTP_PORT = 8000
HTTP_PORT_NAME = "http"
# KV events: every worker publishes on these ports of its own host (live stream, replay).
KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = KV_EVENTS_PORT + 1

# Comma-separated accepted API keys (how a Kubernetes Secret is mounted into a pod).
ENV_API_KEYS = "PDSERVE_API_KEYS"
# The one key the router presents to workers (a keyed worker accepts kv_transfer_params, and
# serves /metrics, only to its holder); the operator sets it from the same Secret as the
# workers' ENV_API_KEYS.
ENV_WORKER_API_KEY = "PDSERVE_WORKER_API_KEY"
# The KV side channel's shared secret, the same on every prefill and decode worker.
ENV_KV_SECRET = "PDSERVE_KV_SECRET"
# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter (off unless "true" or "1").
ENV_RUNTIME_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# A nice value (e.g. "19") for the threads NIXL starts in a worker (its progress thread and
# UCX's async thread); `pdserve up` sets 19 unless the environment says otherwise.
ENV_NIXL_PROGRESS_NICE = "PDSERVE_NIXL_PROGRESS_NICE"
# Microseconds NIXL's UCX progress thread may sleep between polls of its workers' event fds
# (it wakes at once on an event; the timeout covers events UCX misses). 0: it never sleeps
# (NIXL's Python default, a busy core per worker even when idle). Default 1000.
ENV_NIXL_PROGRESS_DELAY_US = "PDSERVE_NIXL_PROGRESS_DELAY_US"

# Request headers: one id for a request across router, prefill and decode; a session key for
# the session-affinity policy.
HEADER_REQUEST_ID = "x-request-id"
HEADER_SESSION_ID = "x-session-id"
# Response header of a worker's 500 that failed one request alone (its own step work raised: a
# gap in validation, not a sick worker; the engine serves on). The router passes that answer to
# the client and neither retries it elsewhere nor counts it against the worker: otherwise a
# request that slips past validation could eject every worker, three times each.
HEADER_REQUEST_FAILED = "x-pdserve-request-failed"
CODE_REQUEST_FAILED = "request_failed"  # its error code (also on a streamed prefill's error line)
# A client's X-Request-Id names the request in every chunk's `id` (`chatcmpl-{id}`), a response
# header, both upstream legs and the logs: a longer one is cut to this, by the router and the
# worker alike (`request_id_from`, `--max-request-id-chars`), so one of 64 KiB is not repeated into every chunk. (vLLM
# takes the header as it comes; 128 holds any UUID, trace or span id with room to spare.)
MAX_REQUEST_ID_CHARS = 128

# The OpenAI routes both the router and the worker serve, by short name.
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# On a prefill worker: the router frees a hand-off's pin that no decode worker was sent
# (the client left first), with the kv_transfer_params the prefill answered as the body.
PATH_KV_RELEASE = "/kv/release"


def request_id_from(header: str | None, max_chars: int = MAX_REQUEST_ID_CHARS) -> str | None:
    """The request id an X-Request-Id header gives (None when there is none), cut to `max_chars`
    (--max-request-id-chars)."""
    return header[:max_chars] if header else None


def api_keys_from(raw: str | None) -> tuple[str, ...]:
    """`PDSERVE_API_KEYS`'s value as a tuple of keys (blanks dropped)."""
    return tuple(k.strip() for k in (raw or "").split(",") if k.strip())
