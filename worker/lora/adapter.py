"""A PEFT LoRA checkpoint, read and checked against the model before anything is loaded.

PEFT writes `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` with, per adapted projection, `lora_A.weight` [r, in] and
`lora_B.weight` [out, r] under the module's name (`...layers.3.self_attn.q_proj.lora_A.weight`).
The layer computes y = x W^T + s (x A^T) B^T with s = lora_alpha / r (lora_alpha / sqrt(r) with
rsLoRA); s is folded into B here, once, so the kernels take no scale.

Everything a request would trip over later is refused here, naming the adapter: a rank over
--max-lora-rank, a module the model has no LoRA slot for, shapes of another base (hidden size),
files missing or unreadable. The result is a host-side value; nothing reaches the GPU until
the manager copies it into a slot, so a refused adapter leaves nothing half-loaded.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may adapt: PEFT's names for the Llama family's linears.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names it (a 400, or a start-up error)."""


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str  # where it was read from (a directory, after any hub download)
    rank: int
    scaling: float  # already folded into `weights`' B matrices
    # (layer, module) -> (A [r, in], B [out, r] * scaling), on the host in the model's dtype
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def resolve_adapter_dir(name: str, path: str) -> str:
    """A directory holding the adapter: `path` itself, else a hub id fetched (both files only)."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path) or path.startswith((".", "/")) or path.count("/") != 1:
        raise LoRAError(f"adapter {name!r}: {path!r} is not a directory (nor a hub id org/name)")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE])
    except Exception as e:  # offline, unknown repo, no access: the hub's reason, named
        raise LoRAError(f"adapter {name!r}: cannot fetch {path!r} from the hub: {e}") from None


def read_adapter(name: str, path: str, shapes: dict[tuple[int, str], tuple[int, int]], max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """The adapter at `path` (a directory or a hub id), checked against the model's LoRA targets:
    `shapes[(layer, module)] = (in_features, out_features)` of every projection it may adapt."""
    directory = resolve_adapter_dir(name, path)
    config = _read_config(name, directory)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoRAError(f"adapter {name!r}: {CONFIG_FILE} needs a positive integer r and a number lora_alpha")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
    for key, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save (full layers trained beside it)"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if config.get(key):
            raise LoRAError(f"adapter {name!r}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_weights(name, directory)
    num_layers = 1 + max((layer for layer, _ in shapes), default=-1)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: tensor {key!r} adapts nothing this server can adapt "
                            f"(only {', '.join(MODULES)} of the decoder layers)")
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in MODULES or (layer, module) not in shapes:
            what = f"layer {layer}" if layer >= num_layers else module
            raise LoRAError(f"adapter {name!r}: targets {module} of layer {layer}, which the model lacks ({what})")
        parts.setdefault((layer, module), {})[which] = t
    if not parts:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: {module} of layer {layer} has lora_{'AB'[('A' in ab)]} "
                            f"without its pair")
        a, b = ab["A"], ab["B"]
        k, n = shapes[(layer, module)]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"adapter {name!r}: {module} of layer {layer} is not rank {rank} "
                            f"(A {tuple(a.shape)}, B {tuple(b.shape)})")
        if a.shape[1] != k or b.shape[0] != n:
            raise LoRAError(f"adapter {name!r}: {module} of layer {layer} maps {a.shape[1]} -> {b.shape[0]} "
                            f"features but the model's maps {k} -> {n}: an adapter of another base model")
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    return LoRAAdapter(name, directory, rank, scaling, weights)


def _read_config(name: str, directory: str) -> dict:
    file = os.path.join(directory, CONFIG_FILE)
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"adapter {name!r}: {file} is missing (not a PEFT adapter directory)") from None
    except (OSError, ValueError) as e:
        raise LoRAError(f"adapter {name!r}: cannot read {file}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"adapter {name!r}: {file} is not a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type {kind!r} is not LoRA")
    return config


def _read_weights(name: str, directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.exists(file):
        raise LoRAError(f"adapter {name!r}: {file} is missing (only safetensors adapters are read)")
    try:
        return load_file(file)
    except Exception as e:  # a truncated or foreign file: safetensors' reason
        raise LoRAError(f"adapter {name!r}: cannot read {file}: {e}") from None
