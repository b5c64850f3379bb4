"""spec.lora: LoRA adapters on every worker of both roles (docs/lora.md), as pure functions.

The pod template carries only what a worker needs at start: `--enable-lora` and its slots, the
runtime-update switch ($VLLM_ALLOW_RUNTIME_LORA_UPDATING) and the adapters' PVCs. The adapter
list is not in it, so adding or removing an adapter rolls nothing out: the operator loads the
list into every ready worker through vLLM's runtime endpoints, a new pod included, and unloads
what left the list (operator/lora_sync.py, over `plan` below)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from pdserve.protocol.contract import ENV_RUNTIME_LORA

ADAPTER_MOUNT = "/adapters"  # a pvc:// adapter's claim, read-only, at /adapters/<claim>
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16


class LoRASpecError(ValueError):
    """A bad spec.lora (spec.py turns it into its SpecError)."""


@dataclass(frozen=True)
class LoRAAdapter:
    name: str  # what clients put in `model`
    source: str  # hf://org/name, pvc://claim/path or an absolute path in the pod

    @property
    def claim(self) -> str | None:
        return self.source.removeprefix("pvc://").partition("/")[0] if self.source.startswith("pvc://") else None

    @property
    def path(self) -> str:
        """What the worker loads (`lora_path`): a hub id or a directory in the pod."""
        if self.source.startswith("hf://"):
            return self.source.removeprefix("hf://")
        if self.source.startswith("pvc://"):
            claim, _, sub = self.source.removeprefix("pvc://").partition("/")
            return f"{ADAPTER_MOUNT}/{claim}/{sub}".rstrip("/")
        return self.source


@dataclass(frozen=True)
class LoRASpec:
    adapters: tuple[LoRAAdapter, ...] = ()
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None

    @property
    def claims(self) -> tuple[str, ...]:
        """The PVCs the adapters live on, sorted: only a new claim changes the pod template."""
        return tuple(sorted({a.claim for a in self.adapters if a.claim}))

    def desired(self) -> dict[str, str]:
        return {a.name: a.path for a in self.adapters}


def parse(d: Mapping[str, Any] | None, model_name: str) -> LoRASpec | None:
    if d is None:
        return None
    adapters = []
    for i, a in enumerate(d.get("adapters") or ()):
        name, source = str(a.get("name") or ""), str(a.get("source") or "")
        where = f"spec.lora.adapters[{i}]"
        if not name or not source:
            raise LoRASpecError(f"{where}: name and source are required")
        if name == model_name:
            raise LoRASpecError(f"{where}: {name!r} is the base model's name")
        if any(c.isspace() or c == "," for c in name):
            raise LoRASpecError(f"{where}: {name!r}: no spaces or commas in an adapter's name")
        if source.startswith("hf://"):
            repo = source.removeprefix("hf://")
            if "@" in repo or repo.count("/") != 1:
                raise LoRASpecError(f"{where}: {source!r}: hf://org/name (a pinned @revision is not supported "
                                    "for adapters)")
        elif source.startswith("pvc://"):
            claim, _, sub = source.removeprefix("pvc://").partition("/")
            if not claim or not sub:
                raise LoRASpecError(f"{where}: {source!r}: pvc://claim/path/to/adapter")
        elif not source.startswith("/"):
            raise LoRASpecError(f"{where}: {source!r}: hf://org/name, pvc://claim/path or an absolute path")
        adapters.append(LoRAAdapter(name, source))
    names = [a.name for a in adapters]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise LoRASpecError(f"spec.lora.adapters: {dup[0]!r} is named twice")
    spec = LoRASpec(tuple(adapters), d.get("maxLoras", DEFAULT_MAX_LORAS),
                    d.get("maxLoraRank", DEFAULT_MAX_LORA_RANK), d.get("maxCpuLoras"))
    if spec.max_cpu_loras is not None and spec.max_cpu_loras < spec.max_loras:
        raise LoRASpecError(f"spec.lora.maxCpuLoras ({spec.max_cpu_loras}) is below maxLoras ({spec.max_loras})")
    return spec


# ---- the pod template (operator/workloads.py) ----------------------------------------------

def worker_args(lora: LoRASpec) -> list[str]:
    """No --lora-modules: the adapters are loaded at runtime (module docstring)."""
    args = ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank)]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    return args


def worker_env() -> list[dict[str, Any]]:
    return [{"name": ENV_RUNTIME_LORA, "value": "true"}]


def volumes(lora: LoRASpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    vols, mounts = [], []
    for i, claim in enumerate(lora.claims):
        vols.append({"name": f"lora-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"lora-{i}", "mountPath": f"{ADAPTER_MOUNT}/{claim}", "readOnly": True})
    return vols, mounts


# ---- the live update (operator/lora_sync.py) ------------------------------------------------

@dataclass(frozen=True)
class Load:
    name: str
    path: str


@dataclass(frozen=True)
class Unload:
    name: str


def loaded(models: Mapping[str, Any]) -> dict[str, str]:
    """A worker's /v1/models answer -> {adapter: the path it was loaded from} (cards with a parent)."""
    return {str(c["id"]): str(c.get("root", "")) for c in models.get("data") or () if c.get("parent")}


def plan(desired: Mapping[str, str], current: Mapping[str, str]) -> list[Load | Unload]:
    """What one worker must do to serve exactly `desired`: unloads first (they free host
    memory and names), then loads; an adapter whose source changed is unloaded and reloaded."""
    unloads = [Unload(n) for n in sorted(current) if n not in desired or current[n] != desired[n]]
    loads = [Load(n, desired[n]) for n in sorted(desired) if current.get(n) != desired[n]]
    return [*unloads, *loads]


def status(lora: LoRASpec, workers: Iterable[Mapping[str, str]], errors: Mapping[str, str]) -> dict[str, Any]:
    """status.lora: per adapter of the spec, on how many of the reached workers it is loaded."""
    workers = list(workers)
    adapters = []
    for a in lora.adapters:
        entry: dict[str, Any] = {"name": a.name, "source": a.source,
                                 "loadedOn": sum(1 for w in workers if w.get(a.name) == a.path)}
        if a.name in errors:
            entry["error"] = errors[a.name]
        adapters.append(entry)
    return {"workers": len(workers), "adapters": adapters}
