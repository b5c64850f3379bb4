"""The operator's configuration: one frozen dataclass, and the only place env vars are read."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

# The image a ModelServing without spec.image runs; the chart sets it to its appVersion's image.
DEFAULT_IMAGE_ENV = "PDSERVE_OPERATOR_DEFAULT_IMAGE"
DEFAULT_IMAGE_REPOSITORY = "ghcr.io/pdserve/pdserve"


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
    # None: in-cluster credentials in a pod, else KUBECONFIG / ~/.kube/config.
    kubeconfig: str | None = None

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


def default_image(env: Mapping[str, str] | None = None) -> str:
    """spec.image's default: $PDSERVE_OPERATOR_DEFAULT_IMAGE, else this release's image tag."""
    env = os.environ if env is None else env
    if env.get(DEFAULT_IMAGE_ENV):
        return env[DEFAULT_IMAGE_ENV]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"{DEFAULT_IMAGE_REPOSITORY}:{version('pdserve')}"
    except PackageNotFoundError:
        return f"{DEFAULT_IMAGE_REPOSITORY}:latest"


def load_client_configuration(kubeconfig: str | None = None):
    """A fresh client Configuration (never the client library's global default): from
    `kubeconfig` if given, in-cluster credentials when running in a pod, else KUBECONFIG or
    ~/.kube/config (read now, not when the library was imported)."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        config.load_kube_config(config_file=path, client_configuration=cfg)
    return cfg


def kubeconfig_namespace(kubeconfig: str | None = None) -> str:
    """The current context's namespace (default "default"), for `pdserve operator` without flags."""
    from kubernetes import config

    try:
        _, ctx = config.list_kube_config_contexts(kubeconfig or os.environ.get("KUBECONFIG") or None)
    except config.ConfigException:
        ns_file = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
        return open(ns_file).read().strip() if os.path.exists(ns_file) else "default"
    return (ctx.get("context") or {}).get("namespace") or "default"
