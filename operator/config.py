"""The operator's configuration: one frozen dataclass, and the only place env vars are read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class OperatorConfig:
    # Empty `namespaces` with all_namespaces=False means: the kubeconfig context's namespace.
    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    # The timer re-runs the full reconcile this often: it picks up pod/Deployment changes for
    # status and repairs children someone deleted or edited.
    resync_interval_s: float = 15.0
    # Optional APIs (ServiceMonitor, HPA/PDB versions) are re-discovered this often.
    discovery_ttl_s: float = 60.0

    def __post_init__(self) -> None:
        if self.namespaces and self.all_namespaces:
            raise ValueError("--namespace and --all-namespaces are mutually exclusive")
        if not self.resync_interval_s > 0:
            raise ValueError(f"resync interval must be > 0 seconds, got {self.resync_interval_s}")
        if not self.discovery_ttl_s >= 0:
            raise ValueError(f"discovery TTL must be >= 0 seconds, got {self.discovery_ttl_s}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> "OperatorConfig":
        env = os.environ if env is None else env
        values: dict = {}
        for key, field, cast in (("PDSERVE_OPERATOR_RESYNC_SECONDS", "resync_interval_s", float),
                                 ("PDSERVE_OPERATOR_DISCOVERY_TTL_SECONDS", "discovery_ttl_s", float)):
            if env.get(key):
                try:
                    values[field] = cast(env[key])
                except ValueError:
                    raise ValueError(f"{key} must be a number, got {env[key]!r}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def load_api_client():
    """An ApiClient for in-cluster credentials when running in a pod, else the kubeconfig
    (KUBECONFIG or ~/.kube/config); a fresh Configuration, not the client's global default."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    return client.ApiClient(cfg)


def kubeconfig_namespace() -> str:
    """The current context's namespace (default "default"), for `pdserve operator` without flags."""
    from kubernetes import config

    try:
        _, ctx = config.list_kube_config_contexts()
    except config.ConfigException:
        ns_file = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
        return open(ns_file).read().strip() if os.path.exists(ns_file) else "default"
    return (ctx.get("context") or {}).get("namespace") or "default"
