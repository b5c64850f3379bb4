"""Pull a prefix a peer holds, or recompute it? The estimates behind the choice, measured online.

A worker handed a peer's pin of a prefix it lacks (protocol/kv_transfer.PrefixPull) compares

    pull      = the blocks' bytes / the link's bytes per second (measured over this worker's pulls)
    recompute = the tokens / this worker's prefill tokens per second (measured over its steps)

and pulls when the pull is cheaper. Both estimates start from priors and follow an exponential
moving average of what is measured, so a slow or congested link, or a fast prefill (a small
model on a big GPU), moves the crossover within a few requests. `--kv-prefix-pull-bandwidth`
fixes the link's estimate instead (a known link, and the tests' slow link).

Series (vLLM-style names, pdserve_ prefix): the two estimates as gauges, the choices by outcome
and the tokens pulled.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge

LINK_PRIOR_BYTES_PER_S = 1e9  # a pod-to-pod TCP link, conservatively (P and D sit on different nodes)
PREFILL_PRIOR_TOKENS_PER_S = 5000.0  # an 8B model's prefill on one GPU is 2-4x this
# Weight of a new measurement: a few requests move the estimate, one outlier does not swing it.
ALPHA = 0.3
# A step that computed fewer prompt tokens than this says more about launch overheads than about
# the prefill's speed: not measured.
MIN_MEASURED_TOKENS = 16


class PrefixPullCost:
    def __init__(self, fixed_link_bytes_per_s: float = 0.0):
        self._lock = threading.Lock()  # pull threads and the step thread both measure
        self.fixed = fixed_link_bytes_per_s > 0
        self.link_bytes_per_s = fixed_link_bytes_per_s if self.fixed else LINK_PRIOR_BYTES_PER_S
        self.prefill_tokens_per_s = PREFILL_PRIOR_TOKENS_PER_S
        self.link_gauge = Gauge(
            "pdserve_kv_prefix_pull_link_bytes_per_second",
            "The link speed a prefix pull from a peer is estimated at (measured over this "
            "worker's KV pulls, or --kv-prefix-pull-bandwidth).",
            registry=None,
        )
        self.prefill_gauge = Gauge(
            "pdserve_kv_prefix_pull_prefill_tokens_per_second",
            "The prefill speed recomputing a prefix is estimated at (measured over this worker's prefill steps).",
            registry=None,
        )
        self.decisions = Counter(
            "pdserve_kv_prefix_pull_decisions",
            "Prefixes a peer held that this worker lacked, by what it chose: pull them "
            "from the peer or recompute them.",
            ("choice",),
            registry=None,
        )
        self.pulled_tokens = Counter(
            "pdserve_kv_prefix_pulled_tokens",
            "Prompt tokens whose KV was pulled from a peer instead of recomputed, by "
            "outcome (landed; failed: recomputed after all).",
            ("outcome",),
            registry=None,
        )
        for choice in ("pull", "recompute"):
            self.decisions.labels(choice)
        for outcome in ("landed", "failed"):
            self.pulled_tokens.labels(outcome)
        self._publish()

    def choose_pull(self, num_tokens: int, num_bytes: int) -> bool:
        """Pull `num_tokens` tokens' KV (`num_bytes`) rather than recompute them? Counted."""
        with self._lock:
            pull_s = num_bytes / self.link_bytes_per_s
            recompute_s = num_tokens / self.prefill_tokens_per_s
        pull = pull_s < recompute_s
        self.decisions.labels("pull" if pull else "recompute").inc()
        return pull

    def observe_pull(self, num_bytes: int, seconds: float) -> None:
        """A pull from a peer landed (any pull whose bytes moved at link speed: not a streamed
        hand-off's, which waits for the prefill computing them)."""
        if self.fixed or seconds <= 0 or num_bytes <= 0:
            return
        with self._lock:
            self.link_bytes_per_s += ALPHA * (num_bytes / seconds - self.link_bytes_per_s)
        self._publish()

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step computed `num_tokens` prompt tokens in `seconds` (its wall time, decodes riding
        along included: what a recompute would cost in that step)."""
        if num_tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        with self._lock:
            self.prefill_tokens_per_s += ALPHA * (num_tokens / seconds - self.prefill_tokens_per_s)
        self._publish()

    def _publish(self) -> None:
        self.link_gauge.set(self.link_bytes_per_s)
        self.prefill_gauge.set(self.prefill_tokens_per_s)

    def collect(self):
        for metric in (self.link_gauge, self.prefill_gauge, self.decisions, self.pulled_tokens):
            yield from metric.collect()
