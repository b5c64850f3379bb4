"""The LoRA term of one base linear, for every GPU slot at once.

A fused linear (qkv_proj = q | k | v, gate_up_proj = gate | up) holds one adapter matrix pair
per part: the parts' A matrices side by side (x is shared: one shrink gives every part's
rank-R product), and each output column's own R rows of B (part i's columns only ever take
product columns [i * R, (i + 1) * R): the expand is told where each part's columns end), so a
fused linear costs one shrink and one expand, 8 launches a decoder layer (qkv, o, gate_up, down):

    a: [slots, in, parts * R]     b: [slots, R, out]     (R = --max-lora-rank)

An adapter of rank r < R fills the first r columns of its part in A and the first r rows of B,
zeros elsewhere; a part the adapter does not adapt stays zero. The scale is folded into B (adapter.py).

Tensor parallelism: the matrices are sharded like the base layer's weight, with its own
coordinates (parallel/layers.py rows_of / cols_of). A column-parallel layer (qkv, gate_up)
keeps A whole and B's columns of its rows. A row-parallel one (o_proj, down_proj) keeps A's
rows of its input columns and B whole: each rank's shrink is a partial sum, and since the
expand is linear the layer's own all-reduce sums the ranks' terms into the whole one, with no
collective of LoRA's own.

`LoRAContext.slots` holds the step's slot per token (-1: the base model), set by the model
runner before each forward (a CUDA graph's static buffer in a captured decode step), so the
layers never read anything on the host. An eager step whose tokens come in long runs of one
adapter (a prefill, a mixed step's chunks) also sets `LoRAContext.segments`: the layers then run
the segmented kernels (SGMV: each run's A and B read once per row tile) instead of the per-token
ones (BGMV), which stay for decodes and every captured step.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pdserve.worker.lora.adapter import LoRAAdapter


@dataclass(frozen=True)
class LoRAOps:
    shrink: Callable  # (x [T, K], a [S, K, W], slots [T]) -> [T, W] fp32, or [P, T, W] partials by K slice
    # (y [T, N], u (shrink's), b [S, R, N], slots [T], ends) -> y, in place; ends: where each of
    # the W // R parts' output columns end (None: one part)
    expand: Callable
    # The same by segment: (x, a, starts [G + 1], seg_slots [G], max_len) and (y, u, b, starts, seg_slots, max_len,
    # ends)
    shrink_sgmv: Callable
    expand_sgmv: Callable


def lora_ops(backend_name: str) -> LoRAOps:
    """Triton's kernels with the Triton backend, the torch references otherwise (one numerics per engine)."""
    if backend_name == "triton":
        from pdserve.kernels.lora import lora_expand, lora_shrink_partials
        from pdserve.kernels.lora_sgmv import lora_expand_sgmv, lora_shrink_sgmv_partials

        # The split-K shrinks' partials go to the expands as they are: they sum them (no third launch).
        return LoRAOps(lora_shrink_partials, lora_expand, lora_shrink_sgmv_partials, lora_expand_sgmv)
    from pdserve.kernels.reference import lora_expand_ref, lora_expand_sgmv_ref, lora_shrink_ref, lora_shrink_sgmv_ref

    return LoRAOps(lora_shrink_ref, lora_expand_ref, lora_shrink_sgmv_ref, lora_expand_sgmv_ref)


# An eager step runs SGMV when its runs of one adapter average at least this many tokens: a row
# tile is 16 tokens, and shorter runs (decodes of alternating adapters) would leave most of each
# tile idle, where BGMV's one product per token wastes nothing.
SGMV_MIN_AVG_RUN = 8


def segments_of(slots: list[int]) -> tuple[list[int], list[int], int] | None:
    """A step's slot per token as runs of one slot: (starts [G + 1], slots [G], longest run), or
    None when the runs are too short for SGMV (SGMV_MIN_AVG_RUN)."""
    starts, seg_slots = [], []
    for i, s in enumerate(slots):
        if not i or s != slots[i - 1]:
            starts.append(i)
            seg_slots.append(s)
    starts.append(len(slots))
    if not seg_slots or len(slots) < SGMV_MIN_AVG_RUN * len(seg_slots):
        return None
    return starts, seg_slots, max(e - b for b, e in zip(starts, starts[1:]))


# On CUDA each BGMV shrink runs on a second stream beside its base GEMM (it needs only x), the
# expand joining after the GEMM; a captured decode graph then holds the two as parallel branches,
# so the shrinks' launches hide behind the GEMMs (H200, Llama-3.1-8B shapes: batch 8 with 4
# adapters 1.26x the base step against 1.31x in line, docs/lora.md). PDSERVE_LORA_FORK_SHRINK=0
# keeps every LoRA kernel on the compute stream.
FORK_SHRINK = os.environ.get("PDSERVE_LORA_FORK_SHRINK", "1") != "0"


class LoRAContext:
    """The step's slot per token, shared by every LoRA layer of the model, and its segments when
    the step runs SGMV: (starts [G + 1], seg_slots [G] on the device, the longest run)."""

    def __init__(self, max_tokens: int, device: torch.device, fork_shrink: bool | None = None):
        # No adapter anywhere: what a forward without a plan of its own reads (the memory profile).
        self.idle = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.slots = self.idle
        self.segments: tuple[torch.Tensor, torch.Tensor, int] | None = None
        # False: no token of this step runs an adapter (known on the host): the layers add nothing
        # and launch nothing. A graph captured with it True reads its slots on the device; the decode
        # graphs also keep a set captured with it False (base_model) for batches without adapters.
        self.active = True
        # (module, attribute, value) of the small-batch GEMV switches attach_lora turned off (the
        # fused GEMVs never materialize the normed input a LoRA term needs); base_model turns them back on.
        self.gemv_switches: list[tuple[object, str, object]] = []
        # The stream the shrinks fork onto (fork_shrink, CUDA only; None: every LoRA kernel in line).
        fork_shrink = FORK_SHRINK if fork_shrink is None else fork_shrink
        self.side = torch.cuda.Stream(device) if fork_shrink and device.type == "cuda" else None

    @contextlib.contextmanager
    def base_model(self):
        """The model as without --enable-lora while inside: no LoRA term, its GEMV paths back."""
        self.active = False
        for module, name, value in self.gemv_switches:
            setattr(module, name, value)
        try:
            yield
        finally:
            self.active = True
            for module, name, _ in self.gemv_switches:
                setattr(module, name, False)


@dataclass(frozen=True)
class LoRAPart:
    module: str  # the checkpoint's name of this part (q_proj, ...)
    shard_id: object  # the part's id in the base layer (rows_of): "q" | "k" | "v", 0 | 1, None


class LoRALinear:
    """Added to a base linear's output by ParallelLinear.linear (its `lora` attribute)."""

    def __init__(self, base, layer: int, parts: list[LoRAPart], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, ops: LoRAOps, ctx: LoRAContext):
        """`base`: the parallel linear this term is added to (its shard's coordinates)."""
        self.layer, self.parts, self.max_rank = layer, parts, max_rank
        self.rows = [base.rows_of(p.shard_id) for p in parts]  # (first out row here, in the checkpoint, count)
        self.cols = base.cols_of()  # row-parallel: (first input column in the checkpoint, count)
        # A packed output's parts, by the column each ends at (None: one part, the whole output):
        # the base layer lays them out in order, side by side (part i is the expand's slice i).
        ends = [dst + n for dst, _, n in self.rows]
        if [dst for dst, _, _ in self.rows] != [0, *ends[:-1]] or ends[-1] != base.out_features:
            raise ValueError(f"LoRA: layer {layer}'s parts {[p.module for p in parts]} are not side by side in "
                             f"order in the base output (rows {self.rows})")
        self.ends = tuple(ends) if len(parts) > 1 else None
        self.a = torch.zeros(max_loras, base.in_features, len(parts) * max_rank, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, max_rank, base.out_features, dtype=dtype, device=device)
        self.ops, self.ctx = ops, ctx

    def write(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Slot `slot` := the adapter's matrices for this linear (zeros where it adapts nothing;
        None clears the slot). Copies queued on the device's stream: ordered after the steps
        already queued, so one still running never sees the new weights."""
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        if adapter is None:
            return
        for i, (p, (dst, src, n)) in enumerate(zip(self.parts, self.rows)):
            pair = adapter.weights.get((self.layer, p.module))
            if pair is None:
                continue
            la, lb = pair  # [r, in], [out, r]: the whole model's
            if self.cols is not None:
                first, count = self.cols
                la = la[:, first:first + count]
            r, c = la.shape[0], i * self.max_rank
            a[:, c:c + r].copy_(la.t(), non_blocking=True)
            b[:r, dst:dst + n].copy_(lb[src:src + n].t(), non_blocking=True)

    def fork(self, x: torch.Tensor) -> torch.Tensor | None:
        """Called before the base GEMM: the BGMV shrink of x started on the context's side stream
        (LoRAContext.side), or None (no side stream, no adapter this step, or SGMV's segments)."""
        side = self.ctx.side
        if side is None or not self.ctx.active or self.ctx.segments is not None:
            return None
        main = torch.cuda.current_stream(x.device)
        side.wait_stream(main)  # x is ready
        with torch.cuda.stream(side):
            # The partials are allocated on the side stream and read on the main one: their block
            # is only reused by a later shrink on the side stream, which forks after this
            # expand was queued (wait_stream above), so no record_stream is needed.
            return self.ops.shrink(x, self.a, self.ctx.slots[:x.shape[0]])

    def __call__(self, x: torch.Tensor, out: torch.Tensor, forked: torch.Tensor | None = None) -> torch.Tensor:
        """out += x's LoRA term; `forked`: fork(x)'s shrink, joined here (after the base GEMM)."""
        if not self.ctx.active:
            return out
        if self.ctx.segments is not None:
            u = self.ops.shrink_sgmv(x, self.a, *self.ctx.segments)
            return self.ops.expand_sgmv(out, u, self.b, *self.ctx.segments, self.ends)
        slots = self.ctx.slots[:x.shape[0]]
        if forked is not None:
            torch.cuda.current_stream(x.device).wait_stream(self.ctx.side)
            u = forked
        else:
            u = self.ops.shrink(x, self.a, slots)
        return self.ops.expand(out, u, self.b, slots, self.ends)


def attach_lora(model: nn.Module, max_loras: int, max_rank: int, ops: LoRAOps,
                ctx: LoRAContext) -> tuple[list[LoRALinear], dict[tuple[int, str], tuple[int, int]]]:
    """A LoRALinear on every attention and dense-MLP projection of a Llama-family model, and the
    whole model's (in, out) of each (layer, module) an adapter may adapt (adapter.py checks
    them). The small-batch GEMV paths (which bypass the linears' forward) are turned off."""
    from pdserve.worker.models.llama import MLP

    weight = model.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    full = model.shard.full  # the whole model's sizes (this rank's are a slice)
    hidden, q, kv = full.hidden_size, full.num_heads * full.head_dim, full.num_kv_heads * full.head_dim
    made: list[LoRALinear] = []
    shapes: dict[tuple[int, str], tuple[int, int]] = {}

    def add(linear, layer: int, parts: dict[str, tuple[object, int, int]]) -> None:
        linear.lora = LoRALinear(linear, layer, [LoRAPart(m, sid) for m, (sid, _, _) in parts.items()],
                                 max_loras, max_rank, dtype, device, ops, ctx)
        made.append(linear.lora)
        shapes.update({(layer, m): (k, n) for m, (_, k, n) in parts.items()})

    for i, block in enumerate(model.layers):
        attn = block.self_attn
        add(attn.qkv_proj, i, {"q_proj": ("q", hidden, q), "k_proj": ("k", hidden, kv), "v_proj": ("v", hidden, kv)})
        add(attn.o_proj, i, {"o_proj": (None, q, hidden)})
        off = [(attn, "gemv_o"), (block, "gemv_qkv")]
        if isinstance(block.mlp, MLP):
            inter = block.mlp.gate_up_proj.out_sizes[0]
            add(block.mlp.gate_up_proj, i, {"gate_proj": (0, hidden, inter), "up_proj": (1, hidden, inter)})
            add(block.mlp.down_proj, i, {"down_proj": (None, inter, hidden)})
            off.append((block, "gemv_mlp"))
        for module, name in off:
            ctx.gemv_switches.append((module, name, getattr(module, name, None)))
            setattr(module, name, False)
    return made, shapes
