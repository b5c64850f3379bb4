"""kopf handlers: thin wrappers that run `reconcile` and report its outcome.

`register(registry, config)` binds one reconcile to create, update and resume plus a timer,
so `pdserve operator` and tests (kopf.testing.KopfRunner) build the same operator.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import kopf
from kubernetes.client import ApiClient
from kubernetes.client.rest import ApiException

from pdserve.operator import naming, status
from pdserve.operator.config import OperatorConfig, load_client_configuration
from pdserve.operator.kube import Kube
from pdserve.operator.reconcile import reconcile
from pdserve.operator.spec import SpecError

RESOURCE = (naming.GROUP, naming.VERSION, naming.PLURAL)
# API errors caused by what the spec asks for (a child the server rejects): retrying the same
# spec cannot help, a new spec will.
_SPEC_CAUSED = (400, 422)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _post(body: Any, events: list[tuple[str, str, str]]) -> None:
    for type_, reason, message in events:
        kopf.event(body, type=type_, reason=reason, message=message)


def _run(body: Any, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, source: str) -> None:
    old = (body.get("status") or {}).get("conditions") or []
    generation = body["metadata"].get("generation", 1)
    try:
        outcome = reconcile(memo.kube, body, _now())
    except SpecError as e:
        new = status.invalid_spec_status(generation, str(e), old, _now())
        patch.status.update(new)
        _post(body, status.transitions(old, new["conditions"]))
        return  # nothing to retry until the spec changes
    except ApiException as e:
        reason = "ChildRejected" if e.status in _SPEC_CAUSED else "ApiError"
        message = f"{source}: API server answered {e.status} {e.reason}: {(e.body or '')[:400]}"
        new = {"conditions": status.merge_conditions(
            old, [c for c in old if c.get("type") != "Degraded"]
            + [status.condition("Degraded", True, reason, message, generation)], _now())}
        patch.status.update(new)
        _post(body, status.transitions(old, new["conditions"]))
        if e.status in _SPEC_CAUSED:
            raise kopf.PermanentError(message) from e
        raise kopf.TemporaryError(message, delay=10) from e
    patch.status.update(outcome.status)
    _post(body, outcome.events)
    logger.debug("reconciled (%s): %s", source, outcome.status["conditions"])


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> kopf.OperatorRegistry:
    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # Keep kopf's bookkeeping in our own annotations, out of the structural status.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pdserve.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="pdserve.io", key="last-handled-configuration")
        # Events are posted deliberately (_post), not for every log line.
        settings.posting.level = logging.WARNING
        memo.kube = Kube(ApiClient(load_client_configuration(config.kubeconfig)), config.discovery_ttl_s)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # kopf's own client login reads the kubeconfig path the client library fixed at import
        # time; ours honours OperatorConfig.kubeconfig and KUBECONFIG as they are now.
        cfg = load_client_configuration(config.kubeconfig)
        header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
        scheme, _, token = (header or "").rpartition(" ")
        return kopf.ConnectionInfo(
            server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
            scheme=scheme or ("Bearer" if token else None), token=token or None,
            username=cfg.username or None, password=cfg.password or None,
            certificate_path=cfg.cert_file, private_key_path=cfg.key_file)

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, registry=registry)
    def reconcile_handler(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger,
                          reason: str, **_: Any) -> None:
        _run(body, patch, memo, logger, str(reason))

    @kopf.timer(*RESOURCE, interval=config.resync_interval_s, registry=registry)
    def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        _run(body, patch, memo, logger, "resync")

    return registry


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    return register(kopf.OperatorRegistry(), config)
