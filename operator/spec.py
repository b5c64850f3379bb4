"""The ModelServing spec as frozen dataclasses.

The API server has already validated and defaulted the spec against the CRD schema
(crds/modelservings.pdserve.io.yaml); the defaults here mirror the schema's so the builders
also work on hand-written dicts (unit tests), and a test checks both agree. `SpecError` covers
the cross-field rules a structural schema cannot express on Kubernetes 1.20 (no CEL).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from pdserve.operator import lora as lora_config
from pdserve.operator.config import default_image
from pdserve.operator.lora import LoRASpec
from pdserve.protocol.contract import HTTP_PORT, KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT
from pdserve.protocol.kv_peers import parse_peer
from pdserve.protocol.tracing import PROTOCOLS as TRACE_PROTOCOLS

GPU_RESOURCE = "nvidia.com/gpu"
# Where pod networks live in nearly every cluster (RFC 1918, shared address space, IPv6 ULA):
# a decode worker pulls KV only from these, so a forged kv_transfer_params cannot point it at
# the internet or a cloud metadata address (link-local).
PRIVATE_NETWORKS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fd00::/8")
# The router's built-in policies (pdserve.router.policies.BUILTIN); the CRD enum lists the same.
POLICIES = ("round-robin", "least-loaded", "prefix-aware", "session-affinity")


class SpecError(ValueError):
    """A spec the schema accepts but the operator cannot serve; the message names the field."""


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class ModelSource:
    """`hf://org/name[@revision]`, `pvc://claim/path` or an absolute path inside the image."""

    kind: str  # "hf" | "pvc" | "path"
    repo: str = ""  # hf: org/name
    revision: str | None = None  # hf: a pinned branch, tag or commit
    claim: str = ""  # pvc
    path: str = ""  # pvc: path inside the claim; path: the absolute path

    @classmethod
    def parse(cls, source: str) -> "ModelSource":
        if source.startswith("hf://"):
            repo, _, rev = source.removeprefix("hf://").partition("@")
            return cls("hf", repo=repo, revision=rev or None)
        if source.startswith("pvc://"):
            claim, _, path = source.removeprefix("pvc://").partition("/")
            return cls("pvc", claim=claim, path=path)
        return cls("path", path=source)


@dataclass(frozen=True)
class Autoscaling:
    max_replicas: int
    min_replicas: int = 1
    metric: str = "vllm:num_requests_waiting"
    target_average_value: str = "4"


@dataclass(frozen=True)
class Slo:
    """spec.slo: the latency targets the planner (operator/planner.py) sizes both roles for.
    Per-role bounds come from spec.<role>.autoscaling; a role without it keeps its replicas."""

    ttft_ms: float
    itl_ms: float
    percentile: float = 90.0
    gpu_budget: int | None = None
    target_utilization: float = 0.8
    prefill_tokens_per_second: float | None = None  # capacity seed per prefill worker at the SLO
    decode_tokens_per_second: float | None = None  # capacity seed per decode worker at the SLO
    interval_s: int = 15
    scale_up_cooldown_s: int = 30
    scale_down_window_s: int = 300
    max_scale_down_step: int = 1
    scale_to_zero_after_s: int = 600


@dataclass(frozen=True)
class Rollout:
    """RollingUpdate bounds; None means the role's default (see workloads.rollout_strategy)."""

    max_surge: int | str | None = None
    max_unavailable: int | str | None = None


@dataclass(frozen=True)
class KVTuning:
    """UCX/NIXL settings for a worker pod; unset fields leave the engine's defaults."""

    ucx_tls: str | None = None
    ucx_net_devices: str | None = None
    rdma_resource: str | None = None
    rdma_count: int = 1

    def over(self, base: "KVTuning") -> "KVTuning":
        """Per-role settings over the spec-wide ones, field by field."""
        return KVTuning(self.ucx_tls or base.ucx_tls, self.ucx_net_devices or base.ucx_net_devices,
                        self.rdma_resource or base.rdma_resource,
                        self.rdma_count if self.rdma_resource else base.rdma_count)


@dataclass(frozen=True)
class RoleSpec:
    """One worker role (prefill or decode), or the router (which ignores the worker fields)."""

    role: str
    replicas: int = 1
    tensor_parallel_size: int = 1
    max_num_seqs: int | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    autoscaling: Autoscaling | None = None
    rollout: Rollout = Rollout()
    # {startup|readiness|liveness: {periodSeconds, timeoutSeconds, failureThreshold, initialDelaySeconds}}
    probes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    pod_template: Mapping[str, Any] = field(default_factory=dict)  # strategic merge over the built pod
    shm_size: str | None = None  # None: scaled with tensorParallelSize (workloads.shm_size)
    kv: KVTuning = KVTuning()
    # <role>.kvCache.offloadGiB: None leaves spec.kvCache.offloadGiB (ModelServingSpec.offload_gib)
    offload_gib: float | None = None

    def __post_init__(self) -> None:
        if self.offload_gib is not None and not self.offload_gib >= 0:  # NaN too
            raise SpecError(f"spec.{self.role}.kvCache.offloadGiB must be a number of GiB >= 0, got {self.offload_gib}")
        a = self.autoscaling
        if a is not None and a.min_replicas > a.max_replicas:
            raise SpecError(
                f"spec.{self.role}.autoscaling.minReplicas ({a.min_replicas}) exceeds maxReplicas ({a.max_replicas})"
            )
        if self.rollout.max_surge in (0, "0%") and self.rollout.max_unavailable in (0, "0%"):
            raise SpecError(
                f"spec.{self.role}.rollout: maxSurge and maxUnavailable cannot both be 0 (nothing could move)"
            )


@dataclass(frozen=True)
class FlowControlSpec:
    """spec.router.flowControl: the router's --flow-control-* flags (router/flow_control/);
    unset fields leave the router's defaults."""

    max_inflight: int
    max_queue: int | None = None
    queue_timeout_s: int | None = None
    bands: tuple[int, ...] = ()
    tenant_max_inflight: int | None = None
    tenant_tokens_per_minute: int | None = None
    worker_max_waiting: int | None = None
    worker_max_kv_usage: float | None = None


@dataclass(frozen=True)
class RouterSpec:
    replicas: int = 1
    policy: str | None = None
    prefill_policy: str | None = None
    decode_policy: str | None = None
    pd_min_prompt_tokens: int | None = None
    pd_min_uncached_tokens: int | None = None
    flow_control: FlowControlSpec | None = None
    api_key_secret: SecretKeyRef | None = None
    service_type: str = "ClusterIP"
    service_port: int = 80
    resources: Mapping[str, Any] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] = field(default_factory=dict)
    rollout: Rollout = Rollout()
    probes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    pod_template: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The router refuses the flag otherwise (router/config.py): say so here, not in a crash loop.
        if self.pd_min_uncached_tokens and (self.decode_policy or self.policy) != "prefix-aware":
            raise SpecError("spec.router.pdMinUncachedTokens needs decodePolicy (or policy) prefix-aware: the router "
                            "reads the decode workers' cached prefixes from their KV events")

    @property
    def prefix_aware(self) -> bool:
        """Whether a policy needs token ids (a tokenizer) and the workers' KV events."""
        return "prefix-aware" in (self.policy, self.prefill_policy, self.decode_policy)


@dataclass(frozen=True)
class TracingSpec:
    """spec.tracing: every pod exports its request spans here (protocol/tracing.py)."""

    endpoint: str
    protocol: str = "grpc"
    sampling_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("http://", "https://")):
            raise SpecError(f"spec.tracing.endpoint must be an http(s):// URL, not {self.endpoint!r}")
        if self.protocol not in TRACE_PROTOCOLS:
            raise SpecError(f"spec.tracing.protocol must be one of {', '.join(TRACE_PROTOCOLS)}, not {self.protocol!r}")
        if not 0 <= self.sampling_ratio <= 1:
            raise SpecError(f"spec.tracing.samplingRatio must be in [0, 1], not {self.sampling_ratio}")


@dataclass(frozen=True)
class ModelServingSpec:
    source: str
    image: str
    served_name: str | None = None
    dtype: str = "auto"
    quantization: str = "none"  # fp8: the workers quantize the weights at load (--quantization fp8)
    kv_cache_dtype: str = "auto"  # fp8: both roles' KV caches hold float8 e4m3 (--kv-cache-dtype fp8)
    max_model_len: int | None = None
    hf_token_secret: SecretKeyRef | None = None
    cache_claim: str | None = None  # a PVC for the Hugging Face cache, else an emptyDir
    cache_size: str | None = None  # the emptyDir's sizeLimit and ephemeral-storage request
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    device: str = "cuda"
    prefill: RoleSpec = RoleSpec("prefill")
    decode: RoleSpec = RoleSpec("decode")
    router: RouterSpec = RouterSpec()
    kv_backend: str = "nixl"
    kv_port: int = 5600
    kv: KVTuning = KVTuning()
    kv_peer_allow: tuple[str, ...] = PRIVATE_NETWORKS
    # Shared by all workers, authenticates the KV side channel; None: the operator generates one
    # (naming.kv_secret_ref).
    kv_secret: SecretKeyRef | None = None
    # The one API key workers accept and the router presents to them; None: the operator
    # generates one (naming.worker_api_key_ref).
    worker_api_key_secret: SecretKeyRef | None = None
    network_policy: bool = True
    # NetworkPolicyPeers admitted to the workers' HTTP port for scraping /metrics; None: the
    # default (Prometheus pods anywhere when a ServiceMonitor is made, else nobody).
    metrics_from: tuple[Mapping[str, Any], ...] | None = None
    drain_timeout_s: int = 30
    drain_pre_stop_s: int = 5
    service_monitor: bool = False
    ratio_min: float | None = None
    ratio_max: float | None = None
    slo: Slo | None = None  # the planner owns the autoscaled roles' replicas when set
    lora: LoRASpec | None = None  # LoRA adapters on every worker (operator/lora.py)
    tracing: TracingSpec | None = None
    offload_gib: float = 0.0  # spec.kvCache.offloadGiB: both roles' host KV tier unless a role sets its own

    def __post_init__(self) -> None:
        if not self.offload_gib >= 0:  # NaN too
            raise SpecError(f"spec.kvCache.offloadGiB must be a number of GiB >= 0, got {self.offload_gib}")
        for rs in (self.prefill, self.decode):
            if rs.autoscaling is not None and rs.autoscaling.min_replicas == 0 and self.slo is None:
                raise SpecError(f"spec.{rs.role}.autoscaling.minReplicas 0 needs spec.slo (the planner scales to "
                                "zero; a HorizontalPodAutoscaler cannot)")
        if self.ratio_min is not None and self.ratio_max is not None and self.ratio_min > self.ratio_max:
            raise SpecError(
                f"spec.prefillDecodeRatio.min ({self.ratio_min}) exceeds spec.prefillDecodeRatio.max ({self.ratio_max})"
            )
        for rs in (self.prefill, self.decode):
            limit, request = (_gpu_count(rs.role, rs.resources, kind) for kind in ("limits", "requests"))
            if limit is not None and request is not None and limit != request:
                raise SpecError(f"spec.{rs.role}.resources: requests[{GPU_RESOURCE}] ({request}) must equal "
                                f"limits[{GPU_RESOURCE}] ({limit}) (GPUs cannot be overcommitted)")
            gpus, kind = (limit, "limits") if limit is not None else (request, "requests")
            if self.device == "cuda" and gpus is not None and gpus < rs.tensor_parallel_size:
                raise SpecError(
                    f"spec.{rs.role}.resources.{kind}[{GPU_RESOURCE}] is {gpus} but "
                    f"tensorParallelSize is {rs.tensor_parallel_size}: each worker needs one GPU per rank"
                )
        # Rank r of a prefill worker listens on kvTransfer.port + r: the range must fit and miss
        # the worker's other ports, or a rank fails to bind at start-up.
        last = self.kv_port + self.prefill.tensor_parallel_size - 1
        if last > 65535:
            raise SpecError(f"spec.kvTransfer.port ({self.kv_port}) + spec.prefill.tensorParallelSize - 1 is {last}, "
                            f"past 65535: prefill rank r listens on kvTransfer.port + r")
        taken = {HTTP_PORT} | ({KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT} if self.router.prefix_aware else set())
        if clash := sorted(p for p in taken if self.kv_port <= p <= last):
            raise SpecError(f"spec.kvTransfer.port: the prefill KV ports {self.kv_port}..{last} (one per "
                            f"tensor-parallel rank) include {clash[0]}, which the worker also listens on")
        if self.cache_claim and self.cache_size:
            raise SpecError("spec.model.cache: set claimName (a PVC) or sizeLimit (an emptyDir), not both")
        for peer in self.kv_peer_allow:
            try:
                parse_peer(peer)
            except ValueError as e:
                raise SpecError(f"spec.kvTransfer.peerAllow: {e}") from None

    @property
    def model_source(self) -> ModelSource:
        return ModelSource.parse(self.source)

    @property
    def model_name(self) -> str:
        """What clients put in `model`: servedName, else the source without scheme and revision."""
        if self.served_name:
            return self.served_name
        src = self.model_source
        return {"hf": src.repo, "pvc": f"{src.claim}/{src.path}".rstrip("/"), "path": src.path}[src.kind]

    def role(self, role: str) -> RoleSpec:
        return {"prefill": self.prefill, "decode": self.decode}[role]

    def offload_gib_of(self, role: str) -> float:
        """GiB of the role's host KV tier (worker --kv-offloading-size): its own kvCache.offloadGiB,
        else spec.kvCache.offloadGiB."""
        own = self.role(role).offload_gib
        return self.offload_gib if own is None else own

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> "ModelServingSpec":
        model = spec.get("model") or {}
        if "source" not in model:
            raise SpecError("spec.model.source is required")
        router = spec.get("router") or {}
        service = router.get("service") or {}
        kv = spec.get("kvTransfer") or {}
        ratio = spec.get("prefillDecodeRatio") or {}
        cache = model.get("cache") or {}
        drain = spec.get("drain") or {}
        netpol = spec.get("networkPolicy") or {}
        metrics_from = netpol.get("metricsFrom")
        return cls(
            source=model["source"],
            image=spec.get("image") or default_image(),
            served_name=model.get("servedName"),
            dtype=model.get("dtype", "auto"),
            quantization=model.get("quantization", "none"),
            kv_cache_dtype=spec.get("kvCacheDtype", "auto"),
            max_model_len=model.get("maxModelLen"),
            hf_token_secret=_secret_ref(model.get("hfTokenSecret"), "token"),
            cache_claim=cache.get("claimName"),
            cache_size=None if cache.get("sizeLimit") is None else str(cache["sizeLimit"]),
            image_pull_policy=spec.get("imagePullPolicy", "IfNotPresent"),
            image_pull_secrets=tuple(s["name"] for s in spec.get("imagePullSecrets") or ()),
            device=spec.get("device", "cuda"),
            prefill=_role("prefill", spec.get("prefill") or {}),
            decode=_role("decode", spec.get("decode") or {}),
            router=RouterSpec(
                replicas=router.get("replicas", 1),
                policy=router.get("policy"),
                prefill_policy=router.get("prefillPolicy"),
                decode_policy=router.get("decodePolicy"),
                pd_min_prompt_tokens=router.get("pdMinPromptTokens"),
                pd_min_uncached_tokens=router.get("pdMinUncachedTokens"),
                flow_control=_flow_control(router.get("flowControl")),
                api_key_secret=_secret_ref(router.get("apiKeySecret"), "api-keys"),
                service_type=service.get("type", "ClusterIP"),
                service_port=service.get("port", 80),
                resources=dict(router.get("resources") or {}),
                args=tuple(router.get("args") or ()),
                env=tuple(router.get("env") or ()),
                node_selector=dict(router.get("nodeSelector") or {}),
                tolerations=tuple(router.get("tolerations") or ()),
                affinity=dict(router.get("affinity") or {}),
                rollout=_rollout(router.get("rollout")),
                probes=dict(router.get("probes") or {}),
                pod_template=dict(router.get("podTemplate") or {}),
            ),
            kv_backend=kv.get("backend", "nixl"),
            kv_port=kv.get("port", 5600),
            kv=_kv(kv),
            kv_peer_allow=tuple(kv.get("peerAllow") or PRIVATE_NETWORKS),
            kv_secret=_secret_ref(kv.get("secretRef"), "kv-secret"),
            worker_api_key_secret=_secret_ref(spec.get("workerApiKeySecret"), "api-key"),
            network_policy=bool(netpol.get("enabled", True)),
            metrics_from=None if metrics_from is None else tuple(dict(p) for p in metrics_from),
            drain_timeout_s=drain.get("timeoutSeconds", 30),
            drain_pre_stop_s=drain.get("preStopSeconds", 5),
            service_monitor=bool((spec.get("monitoring") or {}).get("serviceMonitor", False)),
            ratio_min=ratio.get("min"),
            ratio_max=ratio.get("max"),
            slo=_slo(spec.get("slo")),
            lora=_lora(spec.get("lora"), model),
            tracing=_tracing(spec.get("tracing")),
            offload_gib=_gib((spec.get("kvCache") or {}).get("offloadGiB", 0), "spec.kvCache.offloadGiB"),
        )


@dataclass(frozen=True)
class ModelServing:
    """A ModelServing object as the builders need it: identity plus parsed spec."""

    name: str
    namespace: str
    uid: str
    spec: ModelServingSpec
    generation: int = 1
    # uid of the KV Secret the operator generated (reconcile fills it in; "" when the user names
    # one): part of the revision, so a re-created Secret (a new value) rolls pods to a revision
    # that never pairs with pods holding the old value.
    kv_secret_uid: str = ""
    # uid of the generated worker API key Secret ("" when the user names one): annotated on the
    # worker and router pods, so a re-created Secret restarts all of them with the new key.
    worker_api_key_uid: str = ""

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> "ModelServing":
        meta = body["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=meta.get("generation", 1),
            spec=ModelServingSpec.from_dict(body.get("spec") or {}),
        )


def _role(role: str, d: Mapping[str, Any]) -> RoleSpec:
    a = d.get("autoscaling")
    return RoleSpec(
        role=role,
        replicas=d.get("replicas", 1),
        tensor_parallel_size=d.get("tensorParallelSize", 1),
        max_num_seqs=d.get("maxNumSeqs"),
        resources=dict(d.get("resources") or {}),
        args=tuple(d.get("args") or ()),
        env=tuple(d.get("env") or ()),
        node_selector=dict(d.get("nodeSelector") or {}),
        tolerations=tuple(d.get("tolerations") or ()),
        affinity=dict(d.get("affinity") or {}),
        autoscaling=None
        if a is None
        else Autoscaling(
            max_replicas=a["maxReplicas"],
            min_replicas=a.get("minReplicas", 1),
            metric=a.get("metric", "vllm:num_requests_waiting"),
            target_average_value=str(a.get("targetAverageValue", "4")),
        ),
        rollout=_rollout(d.get("rollout")),
        probes=dict(d.get("probes") or {}),
        pod_template=dict(d.get("podTemplate") or {}),
        shm_size=None if d.get("shmSize") is None else str(d["shmSize"]),
        kv=_kv(d.get("kvTransfer") or {}),
        offload_gib=None if (g := (d.get("kvCache") or {}).get("offloadGiB")) is None
        else _gib(g, f"spec.{role}.kvCache.offloadGiB"),
    )


def _gib(value: Any, where: str) -> float:
    """A GiB count as the CRD admits it (a number); anything else is the user's mistake, named."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{where} must be a number of GiB, got {value!r}")
    return float(value)


def _lora(d: Mapping[str, Any] | None, model: Mapping[str, Any]) -> LoRASpec | None:
    if d is None:
        return None
    # The base's client-facing name, as model_name computes it (an adapter may not take it).
    base = model.get("servedName") or ModelServingSpec(source=model["source"], image="").model_name
    try:
        return lora_config.parse(d, base)
    except lora_config.LoRASpecError as e:
        raise SpecError(str(e)) from None


def _tracing(d: Mapping[str, Any] | None) -> TracingSpec | None:
    if not d:
        return None
    if not d.get("endpoint"):
        raise SpecError("spec.tracing.endpoint is required")
    return TracingSpec(d["endpoint"], d.get("protocol", "grpc"), float(d.get("samplingRatio", 1.0)))


def _slo(d: Mapping[str, Any] | None) -> Slo | None:
    if d is None:
        return None
    if "ttftMilliseconds" not in d or "itlMilliseconds" not in d:
        raise SpecError("spec.slo needs ttftMilliseconds and itlMilliseconds")
    return Slo(ttft_ms=d["ttftMilliseconds"], itl_ms=d["itlMilliseconds"], percentile=d.get("percentile", 90.0),
               gpu_budget=d.get("gpuBudget"), target_utilization=d.get("targetUtilization", 0.8),
               prefill_tokens_per_second=d.get("prefillTokensPerSecond"),
               decode_tokens_per_second=d.get("decodeTokensPerSecond"), interval_s=d.get("intervalSeconds", 15),
               scale_up_cooldown_s=d.get("scaleUpCooldownSeconds", 30),
               scale_down_window_s=d.get("scaleDownWindowSeconds", 300),
               max_scale_down_step=d.get("maxScaleDownStep", 1),
               scale_to_zero_after_s=d.get("scaleToZeroAfterSeconds", 600))


def _flow_control(d: Mapping[str, Any] | None) -> FlowControlSpec | None:
    if d is None:
        return None
    if not isinstance(d.get("maxInflight"), int) or d["maxInflight"] < 1:
        raise SpecError("spec.router.flowControl.maxInflight is required, an integer >= 1")
    return FlowControlSpec(max_inflight=d["maxInflight"], max_queue=d.get("maxQueue"),
                           queue_timeout_s=d.get("queueTimeoutSeconds"), bands=tuple(d.get("bands") or ()),
                           tenant_max_inflight=d.get("tenantMaxInflight"),
                           tenant_tokens_per_minute=d.get("tenantTokensPerMinute"),
                           worker_max_waiting=d.get("workerMaxWaiting"), worker_max_kv_usage=d.get("workerMaxKVUsage"))


def _rollout(d: Mapping[str, Any] | None) -> Rollout:
    d = d or {}
    return Rollout(d.get("maxSurge"), d.get("maxUnavailable"))


def _kv(d: Mapping[str, Any]) -> KVTuning:
    rdma = d.get("rdma") or {}
    return KVTuning(d.get("ucxTls"), d.get("ucxNetDevices"), rdma.get("resource"), rdma.get("count", 1))


def _secret_ref(d: Mapping[str, Any] | None, default_key: str) -> SecretKeyRef | None:
    return None if not d else SecretKeyRef(name=d["name"], key=d.get("key", default_key))


def _gpu_count(role: str, resources: Mapping[str, Any], kind: str) -> int | None:
    value = (resources.get(kind) or {}).get(GPU_RESOURCE)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SpecError(
            f"spec.{role}.resources.{kind}[{GPU_RESOURCE}] must be a whole number of GPUs, got {value!r}"
        ) from None
