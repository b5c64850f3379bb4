"""Flow control's settings: the router's `--flow-control-*` flags (router/config.py), taken
together and checked once."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.protocol.flags import ConfigError


@dataclass(frozen=True)
class FlowControlConfig:
    max_inflight: int = 0  # requests the router has open on workers at once; 0: flow control off
    max_queue: int = 256  # requests waiting for a slot, all bands and tenants together
    queue_timeout_s: float = 30.0  # longest wait in the queue before 429
    bands: tuple[int, ...] = (-1, 0, 1)  # accepted `priority` values; lower is served sooner
    tenant_max_inflight: int = 0  # per tenant, requests open at once; 0: no limit
    tenant_tokens_per_minute: int = 0  # per tenant, prompt + max_tokens per minute; 0: no limit
    worker_max_waiting: int = 0  # saturated when every decode worker has this many queued (0: not used)
    worker_max_kv_usage: float = 0.0  # ... or uses this share of its KV cache (0: not used)

    @property
    def enabled(self) -> bool:
        return self.max_inflight > 0

    @classmethod
    def of(cls, config) -> FlowControlConfig:
        """From the router's config; raises ConfigError naming the flag at fault."""
        out = cls(config.flow_control_max_inflight, config.flow_control_max_queue,
                  config.flow_control_queue_timeout_s, tuple(sorted(set(config.flow_control_bands))),
                  config.flow_control_tenant_max_inflight, config.flow_control_tenant_tokens_per_minute,
                  config.flow_control_worker_max_waiting, config.flow_control_worker_max_kv_usage)
        for name, value in (("--flow-control-max-inflight", out.max_inflight),
                            ("--flow-control-max-queue", out.max_queue),
                            ("--flow-control-tenant-max-inflight", out.tenant_max_inflight),
                            ("--flow-control-tenant-tokens-per-minute", out.tenant_tokens_per_minute),
                            ("--flow-control-worker-max-waiting", out.worker_max_waiting)):
            if value < 0:
                raise ConfigError(name, f"must be >= 0, not {value}")
        if not out.bands:
            raise ConfigError("--flow-control-bands", "at least one priority value is needed")
        if not 0.0 <= out.worker_max_kv_usage <= 1.0:
            raise ConfigError("--flow-control-worker-max-kv-usage", f"must be in [0, 1], not {out.worker_max_kv_usage}")
        return out
