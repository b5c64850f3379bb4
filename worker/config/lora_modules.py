"""--lora-modules entries, as vLLM writes them: `name=path` or a JSON object
`{"name": .., "path": .., "base_model_name": ..}` (the path a directory or a hub id)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.protocol.flags import ConfigError


@dataclass(frozen=True)
class LoRAModule:
    name: str  # what clients send as `model`
    path: str  # a directory holding adapter_config.json + adapter_model.safetensors, or a hub id
    base_model_name: str | None = None  # informational (vLLM's field); the model card's parent is the base


def parse_lora_module(entry: str) -> LoRAModule:
    """One entry; ValueError saying what is wrong with it."""
    entry = entry.strip()
    if entry.startswith("{"):
        try:
            obj = json.loads(entry)
        except json.JSONDecodeError as e:
            raise ValueError(f"{entry!r} is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ValueError(f'{entry!r}: the JSON form needs string "name" and "path"')
        base = obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f'{entry!r}: "base_model_name" must be a string')
        module = LoRAModule(obj["name"], obj["path"], base)
    else:
        name, sep, path = entry.partition("=")
        if not sep:
            raise ValueError(f"{entry!r} is neither name=path nor a JSON object")
        module = LoRAModule(name.strip(), path.strip())
    if not module.name or not module.path:
        raise ValueError(f"{entry!r}: the name and the path must not be empty")
    return module


def parse_lora_modules(entries: tuple[str, ...]) -> list[LoRAModule]:
    """Every entry, names unique; ConfigError naming --lora-modules and the entry."""
    out: list[LoRAModule] = []
    for entry in entries:
        try:
            module = parse_lora_module(entry)
        except ValueError as e:
            raise ConfigError("--lora-modules", str(e)) from None
        if any(m.name == module.name for m in out):
            raise ConfigError("--lora-modules", f"adapter name {module.name!r} given twice")
        out.append(module)
    return out
