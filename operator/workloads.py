"""Deployments for the prefill workers, decode workers and the router (pure builders)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Mapping

from pdserve.operator import lora, naming, pods
from pdserve.operator.merge import strategic_merge
from pdserve.operator.quantity import GIB, memory_quantity, parse_quantity
from pdserve.operator.spec import GPU_RESOURCE, FlowControlSpec, ModelServing, RoleSpec, Rollout, SpecError
from pdserve.protocol.contract import (ENV_API_KEYS, ENV_WORKER_API_KEY, HTTP_PORT, HTTP_PORT_NAME, KV_EVENTS_PORT,
                                       KV_EVENTS_REPLAY_PORT)
from pdserve.protocol.kv_peers import with_ports

# Big checkpoints take minutes to load: the startup probe allows 30 min before liveness counts.
WORKER_PROBES = {
    "startup": {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 180},
    "readiness": {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
    "liveness": {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
}
# The router is ready only with a healthy decode worker behind it (/ready); /health says the
# process is alive. Its startup covers fetching a tokenizer from the Hub.
ROUTER_PROBES = {
    "startup": {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 60},
    "readiness": {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 2},
    "liveness": {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
}
# Guaranteed enough to tokenize prompts and keep the prefix index; overridable (router.resources).
ROUTER_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
# A rollout that makes no progress this long is reported (Degraded, ProgressDeadlineExceeded);
# it must outlast the startup probe's budget, or every slow model load would read as a failure.
WORKER_PROGRESS_DEADLINE_S = 10 * 180 + 600


def worker_probes(ms: ModelServing) -> dict[str, dict[str, int]]:
    """A draining worker answers /health with 503 (and stops accepting connections): liveness
    must not kill it before the grace period ends, so its failure budget covers the drain."""
    live = WORKER_PROBES["liveness"]
    budget = -(-pods.termination_grace_s(ms) // live["periodSeconds"])
    return {**WORKER_PROBES, "liveness": {**live, "failureThreshold": max(live["failureThreshold"], budget)}}


def rollout_strategy(rollout: Rollout, gpu: bool) -> dict[str, Any]:
    """GPU roles replace a pod before starting its successor (maxSurge 0, maxUnavailable 1), so
    a rollout needs no spare GPU; the router and CPU workers surge one pod first (no capacity
    lost). Either bound may be set per role."""
    surge, unavailable = (0, 1) if gpu else (1, 0)
    return {"type": "RollingUpdate", "rollingUpdate": {
        "maxSurge": surge if rollout.max_surge is None else rollout.max_surge,
        "maxUnavailable": unavailable if rollout.max_unavailable is None else rollout.max_unavailable}}


def worker_args(ms: ModelServing, role: str) -> list[str]:
    s, rs = ms.spec, ms.spec.role(role)
    args = ["--model", pods.model_argument(ms), "--served-model-name", s.model_name, "--host", "0.0.0.0",
            "--port", str(HTTP_PORT), "--device", s.device, "--dtype", s.dtype, "--role", role,
            "--kv-transfer", s.kv_backend, "--kv-port", str(s.kv_port),
            "--tensor-parallel-size", str(rs.tensor_parallel_size),
            "--shutdown-grace", str(s.drain_timeout_s)]
    if s.max_model_len is not None:
        args += ["--max-model-len", str(s.max_model_len)]
    if s.quantization != "none":
        args += ["--quantization", s.quantization]
    if s.kv_cache_dtype != "auto":
        # Both roles alike: a prefill and a decode worker whose KV dtypes differ cannot exchange KV.
        args += ["--kv-cache-dtype", s.kv_cache_dtype]
    if rs.max_num_seqs is not None:
        args += ["--max-num-seqs", str(rs.max_num_seqs)]
    if offload := s.offload_gib_of(role):
        args += ["--kv-offloading-size", f"{offload:g}"]
    if s.router.prefix_aware:
        # KV-cache-aware routing feeds on the workers' block events.
        args += ["--kv-events-port", str(KV_EVENTS_PORT)]
    # Decode workers pull KV from the addresses prefill workers advertise (their pod IPs); prefill
    # workers pull a prefix another prefill worker of the pool holds (the router's
    # --kv-peer-prefix-min-tokens, docs/kv-cache.md). Both only on the prefill ranks' KV ports
    # (rank r listens on kvTransfer.port + r): params naming an allowed address but another port
    # are refused (docs/security.md). An entry that names its own ports keeps them.
    last = s.kv_port + s.prefill.tensor_parallel_size - 1
    args += ["--kv-peer-allow", *(with_ports(peer, s.kv_port, last) for peer in s.kv_peer_allow)]
    if s.lora is not None:
        # Both roles alike: the prefill and the decode leg of a request both run its adapter.
        args += lora.worker_args(s.lora)
    return args + pods.tracing_args(ms) + list(rs.args)


def quantities(resources: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """Resources with every quantity as a string: server-side apply's typed schema (1.20)
    rejects a bare integer quantity with a 500."""
    return {kind: {k: str(v) for k, v in values.items()}
            for kind in ("limits", "requests") if (values := resources.get(kind))}


def worker_resources(ms: ModelServing, rs: RoleSpec) -> dict[str, Any]:
    """The user's resources, plus (unless they set them) one GPU per tensor-parallel rank on
    cuda, the RDMA device, and ephemeral storage for a sized emptyDir model cache."""
    s, kv = ms.spec, rs.kv.over(ms.spec.kv)
    limits = dict(rs.resources.get("limits") or {})
    requests = dict(rs.resources.get("requests") or {})
    if s.device == "cuda":
        # one GPU per rank, unless the user counted them (ModelServingSpec checks it is enough)
        limits.setdefault(GPU_RESOURCE, requests.get(GPU_RESOURCE, rs.tensor_parallel_size))
    if kv.rdma_resource:
        limits.setdefault(kv.rdma_resource, kv.rdma_count)
    if s.model_source.kind == "hf" and s.cache_size and not s.cache_claim:
        requests.setdefault("ephemeral-storage", s.cache_size)
    if offload := s.offload_gib_of(rs.role):
        grow_memory(rs.role, offload, limits, requests)
    return quantities({"limits": limits, "requests": requests})


def grow_memory(role: str, offload_gib: float, limits: dict[str, Any], requests: dict[str, Any]) -> None:
    """The host KV tier is pinned host memory the worker holds from start: the pod's memory request
    grows by it (so the scheduler places the pod where it fits), and so does a memory limit the
    user set (else the tier would eat what the limit left the worker). No request set: the tier's
    size is the request. No limit set: none is made."""
    extra = Decimal(str(offload_gib)) * GIB
    for kind, values in (("requests", requests), ("limits", limits)):
        if (have := values.get("memory")) is not None:
            try:
                values["memory"] = memory_quantity(parse_quantity(have) + extra)
            except ValueError as e:
                raise SpecError(f"spec.{role}.resources.{kind}.memory: {e}") from None
        elif kind == "requests":
            values["memory"] = memory_quantity(extra)


# /dev/shm cap per tensor-parallel rank, and the floor for any worker. Memory-backed and a cap,
# not a reservation: only what is written counts against the pod's memory.
SHM_PER_RANK_GI = 4
SHM_MIN_GI = 8


def shm_size(rs: RoleSpec) -> str:
    """The user's shmSize, else max(8Gi, 4Gi per rank): NCCL's shared-memory transport and
    proxy buffers, and the ranks' step-plan broadcast, grow with the number of ranks in a pod."""
    if rs.shm_size is not None:
        return rs.shm_size
    return f"{max(SHM_MIN_GI, SHM_PER_RANK_GI * rs.tensor_parallel_size)}Gi"


def _scheduling(rs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rs.node_selector:
        out["nodeSelector"] = dict(rs.node_selector)
    if rs.tolerations:
        out["tolerations"] = [dict(t) for t in rs.tolerations]
    if rs.affinity:
        out["affinity"] = dict(rs.affinity)
    return out


def _pod_spec(ms: ModelServing, service_account: str, containers: list, volumes: list, rs) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "serviceAccountName": service_account,
        "securityContext": pods.pod_security_context(),
        "terminationGracePeriodSeconds": pods.termination_grace_s(ms),
        "containers": containers,
        "volumes": volumes,
        **_scheduling(rs),
    }
    if ms.spec.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in ms.spec.image_pull_secrets]
    return spec


def pod_annotations(ms: ModelServing) -> dict[str, str]:
    """On worker and router pods: a re-created generated API key Secret restarts them all, so
    no pod keeps a key the others no longer use."""
    return {naming.ANNOTATION_WORKER_API_KEY_UID: ms.worker_api_key_uid} if ms.worker_api_key_uid else {}


def _deployment(ms: ModelServing, role: str, replicas: int | None, pod_labels: dict[str, str],
                pod_spec: dict[str, Any], strategy: dict[str, Any], override: Mapping[str, Any],
                progress_deadline_s: int | None = None) -> dict[str, Any]:
    meta = naming.metadata(ms, role)
    meta["labels"] = {**meta["labels"], **pod_labels}
    template: dict[str, Any] = {"metadata": {"labels": {**naming.labels(ms, role), **pod_labels}}, "spec": pod_spec}
    if annotations := pod_annotations(ms):
        template["metadata"]["annotations"] = annotations
    if override:
        try:
            template = strategic_merge(template, override)
        except ValueError as e:
            raise SpecError(f"spec.{role}.{e}") from None
        # The selector and revision labels are the operator's: an override cannot unhook pods.
        template["metadata"]["labels"] = {**template["metadata"].get("labels", {}),
                                          **naming.selector_labels(ms, role), **pod_labels}
    spec: dict[str, Any] = {
        "selector": {"matchLabels": naming.selector_labels(ms, role)},
        "strategy": strategy,
        "template": template,
    }
    if progress_deadline_s is not None:
        spec["progressDeadlineSeconds"] = progress_deadline_s
    # Left out when an autoscaler owns the count: server-side apply then leaves it alone.
    if replicas is not None:
        spec["replicas"] = replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}


def build_worker_deployment(ms: ModelServing, role: str) -> dict[str, Any]:
    s, rs = ms.spec, ms.spec.role(role)
    kv, src = rs.kv.over(s.kv), s.model_source
    tmp, tmp_mount = pods.tmp_volume()
    cache, cache_mount = pods.cache_volume(ms)
    # NCCL/NIXL, the tensor-parallel ranks and the tokenizer's workers use /dev/shm, which a
    # container caps at 64 MiB; memory-backed, so it counts against the pod's memory: hence the cap.
    volumes = [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(rs)}}, tmp, cache]
    mounts = [{"name": "shm", "mountPath": "/dev/shm"}, tmp_mount, cache_mount]
    init: list[dict[str, Any]] = []
    lora_env: list[dict[str, Any]] = []
    if s.lora is not None:
        lora_volumes, lora_mounts = lora.volumes(s.lora)
        volumes += lora_volumes
        mounts += lora_mounts
        lora_env = lora.worker_env()
    if src.kind == "pvc":
        volume, mount = pods.model_pvc_volume(src)
        volumes.append(volume)
        mounts.append(mount)
    elif src.kind == "hf" and src.revision:
        init.append(pods.fetch_container(ms, "fetch-model", src, pods.pinned_dir(src), pods.MODEL_FILES,
                                         [tmp_mount, cache_mount]))
    ports = [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}]
    ports += [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in naming.kv_ports(ms, role)]
    if s.router.prefix_aware:
        ports += [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
                  {"name": "kv-replay", "containerPort": KV_EVENTS_REPLAY_PORT, "protocol": "TCP"}]
    # The workers' one API key: /v1 (so kv_transfer_params come only from the router that holds
    # it), /metrics and /debug/kv need it; /health stays open for probes.
    auth_env = [pods.secret_env(ENV_API_KEYS, naming.worker_api_key_ref(ms))]
    container = {
        "name": "worker",
        "image": s.image,
        "imagePullPolicy": s.image_pull_policy,
        "command": ["pdserve", "worker"],
        "args": worker_args(ms, role),
        "ports": ports,
        "env": pods.merge_env(pods.downward_env() + pods.hub_env(ms) + pods.kv_env(ms, kv) + auth_env + lora_env
                              + pods.tracing_env(ms, role), rs.env),
        "resources": worker_resources(ms, rs),
        "volumeMounts": mounts,
        "securityContext": pods.container_security_context(kv),
        "lifecycle": pods.pre_stop(ms),
        **{
            f"{kind}Probe": pods.probe("/health", defaults, rs.probes.get(kind))
            for kind, defaults in worker_probes(ms).items()
        },
    }
    pod_spec = _pod_spec(ms, naming.child_name(ms, "worker"), [container], volumes, rs)
    # Workers never call the API server: no token in their pods.
    pod_spec["automountServiceAccountToken"] = False
    if init:
        pod_spec["initContainers"] = init
    replicas = None if rs.autoscaling else rs.replicas
    return _deployment(ms, role, replicas, {naming.LABEL_REVISION: naming.revision(ms)}, pod_spec,
                       rollout_strategy(rs.rollout, s.device == "cuda"), rs.pod_template, WORKER_PROGRESS_DEADLINE_S)


def router_args(ms: ModelServing) -> list[str]:
    r = ms.spec.router
    args = ["--host", "0.0.0.0", "--port", str(HTTP_PORT), "--discovery", "kubernetes",
            "--namespace", ms.namespace, "--selector", f"{naming.LABEL_MODELSERVING}={ms.name}"]
    for flag, value in (("--policy", r.policy), ("--prefill-policy", r.prefill_policy),
                        ("--decode-policy", r.decode_policy), ("--pd-min-prompt-tokens", r.pd_min_prompt_tokens),
                        ("--pd-min-uncached-tokens", r.pd_min_uncached_tokens)):
        if value is not None:
            args += [flag, str(value)]
    if r.prefix_aware:
        args += ["--tokenizer", pods.tokenizer_argument(ms)]
    args += flow_control_args(r.flow_control)
    if scales_to_zero(ms):
        # The first request after a quiet spell waits for the planner's first worker (a cold
        # start: pull, load, warm up) instead of a 503 (router/admission_queue.py).
        args += ["--hold-timeout", str(HOLD_FOR_COLD_START_S)]
    return args + pods.tracing_args(ms) + list(r.args)


def flow_control_args(fc: FlowControlSpec | None) -> list[str]:
    """spec.router.flowControl as the router's --flow-control-* flags (none: flow control off)."""
    if fc is None:
        return []
    args = ["--flow-control-max-inflight", str(fc.max_inflight)]
    for flag, value in (("--flow-control-max-queue", fc.max_queue),
                        ("--flow-control-queue-timeout", fc.queue_timeout_s),
                        ("--flow-control-tenant-max-inflight", fc.tenant_max_inflight),
                        ("--flow-control-tenant-tokens-per-minute", fc.tenant_tokens_per_minute),
                        ("--flow-control-worker-max-waiting", fc.worker_max_waiting),
                        ("--flow-control-worker-max-kv-usage", fc.worker_max_kv_usage)):
        if value is not None:
            args += [flag, str(value)]
    if fc.bands:
        args += ["--flow-control-bands", *map(str, fc.bands)]
    return args


# Long enough for a model load from a warm node cache; a client still gets 503 + Retry-After past it.
HOLD_FOR_COLD_START_S = 300


def scales_to_zero(ms: ModelServing) -> bool:
    return ms.spec.slo is not None and any(
        rs.autoscaling is not None and rs.autoscaling.min_replicas == 0 for rs in (ms.spec.prefill, ms.spec.decode))


def build_router_deployment(ms: ModelServing) -> dict[str, Any]:
    s, r, src = ms.spec, ms.spec.router, ms.spec.model_source
    tmp, tmp_mount = pods.tmp_volume()
    volumes, mounts, init = [tmp], [tmp_mount], []
    # The key the workers accept, sent on every call to them (requests, probes, scrapes).
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"},
                                 pods.secret_env(ENV_WORKER_API_KEY, naming.worker_api_key_ref(ms))]
    if r.api_key_secret:
        env.append(pods.secret_env(ENV_API_KEYS, r.api_key_secret))  # the keys clients present
    if r.prefix_aware and src.kind == "pvc":
        volume, mount = pods.model_pvc_volume(src)
        volumes.append(volume)
        mounts.append(mount)
    elif r.prefix_aware and src.kind == "hf":
        # A small cache of its own: the router needs only the tokenizer's files.
        volumes.append({"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}})
        cache_mount = {"name": "cache", "mountPath": pods.CACHE_MOUNT}
        mounts.append(cache_mount)
        env = pods.merge_env(env, pods.hub_env(ms))
        if src.revision:
            init.append(pods.fetch_container(ms, "fetch-tokenizer", src, pods.TOKENIZER_DIR, pods.TOKENIZER_FILES,
                                             [tmp_mount, cache_mount]))
    container: dict[str, Any] = {
        "name": "router",
        "image": s.image,
        "imagePullPolicy": s.image_pull_policy,
        "command": ["pdserve", "router"],
        "args": router_args(ms),
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": pods.merge_env(env + pods.tracing_env(ms, "router"), r.env),
        "resources": quantities(r.resources or ROUTER_RESOURCES),
        "volumeMounts": mounts,
        "securityContext": pods.container_security_context(),
        "lifecycle": pods.pre_stop(ms),
        "startupProbe": pods.probe("/health", ROUTER_PROBES["startup"], r.probes.get("startup")),
        "readinessProbe": pods.probe("/ready", ROUTER_PROBES["readiness"], r.probes.get("readiness")),
        "livenessProbe": pods.probe("/health", ROUTER_PROBES["liveness"], r.probes.get("liveness")),
    }
    pod_spec = _pod_spec(ms, naming.child_name(ms, "router"), [container], volumes, r)
    if init:
        pod_spec["initContainers"] = init
    return _deployment(ms, "router", r.replicas, {}, pod_spec, rollout_strategy(r.rollout, gpu=False), r.pod_template)
