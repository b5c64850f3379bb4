"""The LoRA term of one base linear, for every GPU slot at once.

A fused linear (qkv_proj = q | k | v, gate_up_proj = gate | up) holds one adapter matrix pair
per part: the parts' A matrices side by side (x is shared: one shrink gives every part's
rank-R product) and their B matrices block-diagonal (part i's R columns of the product only
reach part i's output rows), so a fused linear still costs one shrink and one expand:

    a: [slots, in, parts * R]     b: [slots, parts * R, out]     (R = --max-lora-rank)

An adapter of rank r < R fills the first r columns of its part, zeros elsewhere; a part the
adapter does not adapt stays zero. The scale is folded into B (adapter.py).

`LoRAContext.slots` holds the step's slot per token (-1: the base model), set by the model
runner before each forward (a CUDA graph's static buffer in a captured decode step), so the
layers never read anything on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pdserve.worker.lora.adapter import LoRAAdapter


@dataclass(frozen=True)
class LoRAOps:
    shrink: Callable  # (x [T, K], a [S, K, R], slots [T]) -> [T, R] fp32
    expand: Callable  # (y [T, N], u [T, R], b [S, R, N], slots [T]) -> y, in place


def lora_ops(backend_name: str) -> LoRAOps:
    """Triton's kernels with the Triton backend, the torch references otherwise (one numerics per engine)."""
    if backend_name == "triton":
        from pdserve.kernels.lora import lora_expand, lora_shrink

        return LoRAOps(lora_shrink, lora_expand)
    from pdserve.kernels.reference import lora_expand_ref, lora_shrink_ref

    return LoRAOps(lora_shrink_ref, lora_expand_ref)


class LoRAContext:
    """The step's slot per token, shared by every LoRA layer of the model."""

    def __init__(self, max_tokens: int, device: torch.device):
        # No adapter anywhere: what a forward without a plan of its own reads (the memory profile).
        self.idle = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.slots = self.idle


@dataclass(frozen=True)
class LoRAPart:
    module: str  # the checkpoint's name of this part (q_proj, ...)
    offset: int  # its first row in the fused output
    size: int


class LoRALinear:
    """Added to a base linear's output by ParallelLinear.linear (its `lora` attribute)."""

    def __init__(self, layer: int, parts: list[LoRAPart], in_features: int, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, ops: LoRAOps, ctx: LoRAContext):
        self.layer, self.parts, self.max_rank = layer, parts, max_rank
        out = sum(p.size for p in parts)
        width = len(parts) * max_rank
        self.a = torch.zeros(max_loras, in_features, width, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, out, dtype=dtype, device=device)
        self.ops, self.ctx = ops, ctx

    def shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """(layer, module) -> (in, out) of each part, as an adapter's checks want them."""
        return {(self.layer, p.module): (self.a.shape[1], p.size) for p in self.parts}

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Slot `slot` := the adapter's matrices for this linear (zeros where it adapts nothing;
        None clears the slot). Copies queued on the device's stream: ordered after the steps
        already queued, so one still running never sees the new weights."""
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        if adapter is None:
            return
        for i, p in enumerate(self.parts):
            pair = adapter.weights.get((self.layer, p.module))
            if pair is None:
                continue
            la, lb = pair  # [r, in], [out, r]
            r, c = la.shape[0], i * self.max_rank
            a[:, c:c + r].copy_(la.t(), non_blocking=True)
            b[c:c + r, p.offset:p.offset + p.size].copy_(lb.t(), non_blocking=True)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        slots = self.ctx.slots[:x.shape[0]]
        u = self.ops.shrink(x, self.a, slots)
        return self.ops.expand(out, u, self.b, slots)


def attach_lora(model: nn.Module, max_loras: int, max_rank: int, ops: LoRAOps, ctx: LoRAContext) -> list[LoRALinear]:
    """A LoRALinear on every attention and dense-MLP projection of a Llama-family model; the
    small-batch GEMV paths (which bypass the linears' forward) are turned off for them."""
    from pdserve.worker.models.llama import MLP

    weight = model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    made: list[LoRALinear] = []

    def add(linear, layer: int, parts: list[LoRAPart]) -> None:
        linear.lora = LoRALinear(layer, parts, linear.in_features, max_loras, max_rank, dtype, device, ops, ctx)
        made.append(linear.lora)

    for i, block in enumerate(model.layers):
        attn = block.self_attn
        q, kv = attn.q_size, attn.kv_size
        add(attn.qkv_proj, i, [LoRAPart("q_proj", 0, q), LoRAPart("k_proj", q, kv), LoRAPart("v_proj", q + kv, kv)])
        add(attn.o_proj, i, [LoRAPart("o_proj", 0, attn.o_proj.out_features)])
        attn.gemv_o = False
        block.gemv_qkv = False
        if isinstance(block.mlp, MLP):
            inter = block.mlp.gate_up_proj.out_sizes[0]
            add(block.mlp.gate_up_proj, i, [LoRAPart("gate_proj", 0, inter), LoRAPart("up_proj", inter, inter)])
            add(block.mlp.down_proj, i, [LoRAPart("down_proj", 0, block.mlp.down_proj.out_features)])
            block.gemv_mlp = False
    return made
