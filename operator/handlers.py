"""kopf handlers: thin wrappers that run `reconcile` and report its outcome.

`register(registry, config)` binds one reconcile to create, update and resume plus a timer,
so `pdserve operator` and tests (kopf.testing.KopfRunner) build the same operator.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

import kopf
from kubernetes.client import ApiClient
from kubernetes.client.rest import ApiException

from pdserve.operator import autoscaler, lora_sync, naming, status
from pdserve.operator.config import OperatorConfig, load_client_configuration
from pdserve.operator.kube import Kube
from pdserve.operator.reconcile import reconcile
from pdserve.operator.spec import SpecError

RESOURCE = (naming.GROUP, naming.VERSION, naming.PLURAL)
# API errors caused by what the spec asks for (a child the server rejects): retrying the same
# spec cannot help, a new spec will.
_SPEC_CAUSED = (400, 422)
# How often the planner's timer looks; each ModelServing decides at its spec.slo.intervalSeconds.
PLANNER_TICK_S = 5.0
# How often spec.lora's adapters are brought onto the ready workers (a new pod, an edited list).
LORA_TICK_S = 5.0


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _run(body: Any, memo: kopf.Memo, logger: logging.Logger, source: str) -> None:
    """Reconcile one object. Handlers and the timer may fire together for the same object, so
    runs are serialised per object, and each starts from a fresh read (never the event's
    possibly stale body) and writes status itself before releasing the lock: the next run then
    sees what this one did, and condition-change events are posted once."""
    meta = body["metadata"]
    kube: Kube = memo.kube
    with memo.locks.setdefault(meta["uid"], threading.Lock()):
        fresh = kube.get(f"{naming.GROUP}/{naming.VERSION}", naming.KIND, meta["namespace"], meta["name"])
        if fresh is None or fresh["metadata"].get("deletionTimestamp") or fresh["metadata"]["uid"] != meta["uid"]:
            return  # gone: the garbage collector removes the children
        old = (fresh.get("status") or {}).get("conditions") or []
        generation = fresh["metadata"].get("generation", 1)
        try:
            outcome = reconcile(kube, fresh, _now())
        except SpecError as e:
            new = status.invalid_spec_status(generation, str(e), old, _now())
            _report(kube, fresh, new, status.transitions(old, new["conditions"]))
            return  # nothing to retry until the spec changes
        except ApiException as e:
            reason = "ChildRejected" if e.status in _SPEC_CAUSED else "ApiError"
            message = f"{source}: API server answered {e.status} {e.reason}: {(e.body or '')[:400]}"
            conds = [c for c in old if c.get("type") != "Degraded"] + \
                [status.condition("Degraded", True, reason, message, generation)]
            new = {"conditions": status.merge_conditions(old, conds, _now())}
            _report(kube, fresh, new, status.transitions(old, new["conditions"]))
            if e.status in _SPEC_CAUSED:
                raise kopf.PermanentError(message) from e
            raise kopf.TemporaryError(message, delay=10) from e
        _report(kube, fresh, outcome.status, outcome.events)
    logger.debug("reconciled (%s): %s", source, outcome.status["conditions"])


def _live(memo: kopf.Memo, body: Any) -> dict[str, Any] | None:
    """The object as the API server has it now, or None once it is gone, being deleted or replaced
    by one of the same name (a timer's body can be a tick old)."""
    meta = body["metadata"]
    fresh = memo.kube.get(f"{naming.GROUP}/{naming.VERSION}", naming.KIND, meta["namespace"], meta["name"])
    if fresh is None or fresh["metadata"].get("deletionTimestamp") or fresh["metadata"]["uid"] != meta["uid"]:
        return None
    return fresh


def _report(kube: Kube, obj: dict[str, Any], new_status: dict[str, Any], events: list[tuple[str, str, str]]) -> None:
    kube.patch_status(obj, new_status)
    for type_, reason, message in events:
        kopf.event(obj, type=type_, reason=reason, message=message)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> kopf.OperatorRegistry:
    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # Keep kopf's bookkeeping in our own annotations, out of the structural status.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pdserve.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="pdserve.io", key="last-handled-configuration")
        # Events are posted deliberately (_report), not for every log line.
        settings.posting.level = logging.WARNING
        memo.locks = {}  # ModelServing uid -> lock serialising its reconciles
        memo.planner = {}  # ModelServing uid -> autoscaler.Memory
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
    def reconcile_handler(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, reason: str, **_: Any) -> None:
        _run(body, memo, logger, str(reason))

    # The first tick waits one interval: creation is already handled by reconcile_handler.
    @kopf.timer(*RESOURCE, interval=config.resync_interval_s, initial_delay=config.resync_interval_s,
                registry=registry)
    def resync(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        _run(body, memo, logger, "resync")

    # The spec.slo planner: ticks often, decides every spec.slo.intervalSeconds (autoscaler.py).
    @kopf.timer(*RESOURCE, interval=PLANNER_TICK_S, initial_delay=PLANNER_TICK_S, registry=registry,
                when=lambda spec, **_: bool(spec.get("slo")))
    def plan(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
        uid = body["metadata"]["uid"]
        with memo.locks.setdefault(uid, threading.Lock()):
            fresh = _live(memo, body)
            if fresh is None:
                return
            memory = memo.planner.setdefault(uid, autoscaler.Memory())
            try:
                out = autoscaler.tick(memo.kube, fresh, memory, autoscaler.monotonic(), _now())
            except SpecError:
                return  # reconcile reports it
            except ApiException as e:
                raise kopf.TemporaryError(f"planner: API server answered {e.status} {e.reason}", delay=10) from e
            if out is not None:
                for type_, reason, message in out[1]:
                    kopf.event(fresh, type=type_, reason=reason, message=message)

    # spec.lora: load and unload adapters on the running workers (operator/lora_sync.py), no rollout.
    @kopf.timer(*RESOURCE, interval=LORA_TICK_S, registry=registry, when=lambda spec, **_: bool(spec.get("lora")))
    def lora_adapters(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        uid = body["metadata"]["uid"]
        with memo.locks.setdefault(uid, threading.Lock()):
            fresh = _live(memo, body)
            if fresh is None:
                return
            try:
                loaded = lora_sync.sync(memo.kube, fresh)
            except SpecError:
                return  # reconcile reports it
            except ApiException as e:
                raise kopf.TemporaryError(f"LoRA sync: API server answered {e.status} {e.reason}", delay=10) from e
            if loaded is not None and loaded != (fresh.get("status") or {}).get("lora"):
                memo.kube.patch_status(fresh, {"lora": loaded})

    # optional: no finalizer is added for it; a missed deletion only leaves one idle lock
    @kopf.on.delete(*RESOURCE, optional=True, registry=registry)
    def forget(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        memo.locks.pop(body["metadata"]["uid"], None)
        memo.planner.pop(body["metadata"]["uid"], None)

    return registry


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    return register(kopf.OperatorRegistry(), config)
