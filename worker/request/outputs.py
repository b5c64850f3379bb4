"""What the engine hands back per step and per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.protocol.kv_transfer import KVTransferParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int | None = None  # the token's place in the vocabulary by logprob, 1 = best (prompt tokens only)


@dataclass
class RequestOutput:
    """Incremental output of one request after one engine step.

    `new_token_ids` holds only the tokens produced since the previous output of this request.
    `finish_reason` is None while running, else "stop" (EOS, stop token or stop string),
    "length" (max_tokens or max_model_len), "abort", or "error" (this request's own processing
    failed; `error` says how: request/isolation.py).
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # with finish_reason "error": what failed
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (or pulled remotely)
    num_output_tokens: int = 0  # total so far
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    # With the first output of a request that asked for prompt logprobs: one per prompt token,
    # None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Set on the final output of a remote-decode prefill, and on a streamed one's first output
    # (its pin, made at admission; no tokens yet).
    kv_transfer_params: KVTransferParams | None = None
    # A streamed hand-off on the decode side: the prefill's first token, arrived with the KV pull
    # (already sent to the client by the router; not a new token).
    handed_over_token_ids: list[int] | None = None
    handed_over_text: str | None = None  # that token's text as the prefill worker released it (async layer)
    # With a request's first output with tokens (or its final one), if it was scheduled: seconds
    # from its arrival to its first scheduling (vLLM's queue time; on a decode worker of a P/D
    # request the KV pull is inside it).
    queue_time: float | None = None
    # With that same output, a remote-prefilled request's hand-off on the decode side, for its
    # trace: (admitted with blocks, pull landed) as time.monotonic() stamps, and the bytes pulled.
    kv_wait: tuple[float, float] | None = None
    kv_bytes: int | None = None
    # Filled by the async layer's detokenizer: new text since the previous output (whole UTF-8
    # characters only; a matched stop string and anything after it removed).
    text: str = ""


@dataclass(frozen=True)
class HostTierStats:
    """The host KV tier's counters (engine/host_tier_index.py, executor/host_kv_store.py)."""

    queries: int  # prompt tokens looked up there (those the device cache missed)
    hits: int  # of those, tokens found there (restored instead of recomputed)
    num_blocks: int  # blocks held now
    num_slots: int
    stored_blocks: int
    restored_blocks: int
    evicted_blocks: int  # dropped by its LRU
    stored_bytes: int
    restored_bytes: int


@dataclass
class EngineStats:
    """A snapshot for /metrics and tests (free-block counts prove nothing leaked)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_pinned_blocks: int  # held for a remote decode worker (KV transfer)
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    host_tier: HostTierStats | None = None  # --kv-offloading-size's tier, None when off

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_total_blocks)
