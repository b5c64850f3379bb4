"""The sparse mixture-of-experts block: a router picks k of E expert MLPs per token, the experts
run as one fused op, and (Qwen2-MoE) a shared expert behind a sigmoid gate is added.

Routing is computed exactly as transformers does, in fp32 (kernels/reference.py: moe_route_ref; the
Triton path: kernels/moe_route.py, or with the sort in one launch, fused_moe.moe_route_align):
softmax over all E router logits,
top-k of the probabilities, and with `norm_topk_prob` (Qwen3-MoE, Qwen2-MoE when set, Mixtral
always) the k probabilities divided by their sum. (Mixtral's "softmax over the top-k logits" is the
same number: softmax then renormalise over the k equals a softmax over the k logits.)

Parallelism (parallel/shard.py's TPShard): every rank has every token (attention's output is
all-reduced), so every rank routes every token identically (replicated gate, same input).
- Without expert parallelism each expert's gate|up rows and down columns are split as a dense
  MLP's: a rank computes I/N columns of every chosen expert, and the partial outputs are summed.
- With it (`--enable-expert-parallel`) a rank holds E/N whole experts and computes only the
  assignments routed to them; the others contribute zeros, and the same all-reduce combines.
  This is the simple all-reduce expert parallelism: no all-to-all token dispatch, so every rank
  still moves a [T, H] partial per layer, and a rank whose experts are popular does more work.
One all-reduce per layer either way: the shared expert's partial sum joins the experts' before it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.reference import dequantize_fp8_ref, fused_moe_routed_ref
from pdserve.worker.attention import AttentionBackend
from pdserve.worker.model_config import ModelConfig
from pdserve.worker.parallel.communicator import all_reduce
from pdserve.worker.parallel.shard import TPShard


def moe_op(backend: AttentionBackend) -> Callable:
    """The routing + experts op (router logits in, the layer's output out), following the attention
    backend as the pointwise ops do (models/llama.py): the Triton kernels on CUDA (and under the
    interpreter in the twin tests; they pick the fewest launches per batch size), the references
    on CPU. One op rather than two, so that decode batches can route and sort in one launch."""
    if backend.name == "triton":
        from pdserve.kernels.fused_moe import fused_moe_routed

        return fused_moe_routed
    return fused_moe_routed_ref



class FusedExperts(nn.Module):
    """The rank's experts stacked: w13 [E_local, 2 I_local, H] (gate rows, then up rows) and
    w2 [E_local, H, I_local], filled from the checkpoint's per-expert tensors at load.

    FP8 checkpoints (Qwen3-30B-A3B-FP8 and the like): an expert's e4m3 matrix and its scale
    (per-tensor, per-channel or 128x128 blocks, `weight_scale` / `weight_scale_inv`) arrive as
    two tensors in either order; once both are here the matrix is dequantized to the compute
    dtype and stored like a bf16 checkpoint's. The fused MoE kernel has no FP8 path yet, so the
    experts take the compute dtype's memory and bandwidth (docs/moe.md); attention and dense or
    shared-expert MLPs keep their FP8 path."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, op: Callable):
        super().__init__()
        self.shard, self.op = shard, op
        self.local = shard.local_experts
        self.inter = shard.expert_intermediate_size
        self.w13 = nn.Parameter(torch.empty(len(self.local), 2 * self.inter, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(len(self.local), cfg.hidden_size, self.inter))
        quant = cfg.quantization
        self.block = quant.block if quant is not None else None
        self._fp8: dict[tuple, dict] = {}  # (expert, part) -> {"weight"|"scale": tensor} until both arrived

    def shard_ids(self, param_name: str) -> list:
        """The parts of a parameter the checkpoint must supply (what load_weights checks)."""
        if param_name.endswith("w13"):
            return [(e, part) for e in self.local for part in (0, 1)]
        return [(e, None) for e in self.local]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id) -> None:
        """`shard_id` = (global expert id, 0 gate | 1 up | None down[, "scale"]). An expert another
        rank holds is skipped without reading it (a safetensors slice is read only when indexed)."""
        expert, part, *scale = shard_id
        if expert not in self.local:
            return
        if scale or _is_fp8(loaded):
            held = self._fp8.setdefault((expert, part), {})
            held["scale" if scale else "weight"] = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
            if len(held) < 2:
                return  # its other half is further in the checkpoint
            del self._fp8[expert, part]
            loaded = dequantize_expert(held["weight"], held["scale"], self.block,
                                       f"expert {expert} {('gate', 'up')[part] if part is not None else 'down'}")
        e, n = expert - self.local.start, self.inter
        col = 0 if self.shard.expert_parallel else self.shard.rank * n  # this rank's I columns
        if part is None:
            param.data[e].copy_(loaded[:, col:col + n])
        else:
            param.data[e, part * n:(part + 1) * n].copy_(loaded[col:col + n])

    def check_loaded(self) -> None:
        """After the checkpoint: an FP8 matrix whose scale never came (or the reverse) is an error."""
        if self._fp8:
            (expert, part), held = next(iter(self._fp8.items()))
            raise ValueError(f"checkpoint: expert {expert} ({'down' if part is None else ('gate', 'up')[part]}) "
                             f"has its FP8 {next(iter(held))} but not its "
                             f"{'scale' if 'weight' in held else 'weight'} ({len(self._fp8)} such tensors)")

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        """x [T, H], the router's logits [T, E] -> this rank's partial output [T, H]. Every rank
        routes over all E experts (global ids); under expert parallelism the op skips
        assignments to experts outside its range (zeros)."""
        return self.op(x, self.w13, self.w2, router_logits, top_k, renormalize, expert_offset=self.local.start)


def _is_fp8(loaded) -> bool:
    if isinstance(loaded, torch.Tensor):
        return loaded.dtype == torch.float8_e4m3fn
    return loaded.get_dtype() == "F8_E4M3"  # a safetensors slice (read under tensor parallelism)


def dequantize_expert(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, what: str) -> torch.Tensor:
    """An expert's e4m3 matrix [rows, cols] and its scale -> fp32: one scale (per-tensor), one per
    row ([rows] or [rows, 1]: per-channel), or one per block ([ceil(rows / 128), ceil(cols / 128)])."""
    rows, cols = w8.shape
    s = scale.float()
    if s.numel() == 1:
        return dequantize_fp8_ref(w8, s.reshape(1).expand(rows))
    if block is not None and s.dim() == 2 and s.shape != (rows, 1):
        bn, bk = block
        if tuple(s.shape) != (-(-rows // bn), -(-cols // bk)):
            raise ValueError(f"checkpoint: {what}'s block scales are {list(s.shape)}, expected "
                             f"[{-(-rows // bn)}, {-(-cols // bk)}] for a [{rows}, {cols}] matrix in {bn}x{bk} blocks")
        return dequantize_fp8_ref(w8, s.repeat_interleave(bn, 0)[:rows], block)  # the reference takes a row each
    if s.numel() != rows:
        raise ValueError(f"checkpoint: {what}'s scale has shape {list(s.shape)}: not one per tensor, per row "
                         f"({rows}) or per {block or (128, 128)} block of a [{rows}, {cols}] matrix")
    return dequantize_fp8_ref(w8, s.reshape(rows))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ the shared expert); checkpoint names `mlp.gate`, `mlp.experts.N.*`,
    `mlp.shared_expert.*`, `mlp.shared_expert_gate` (Mixtral's are renamed to these at load)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, shard: TPShard, layer_idx: int = 0):
        from pdserve.worker.models.llama import MLP, pointwise_ops

        super().__init__()
        self.top_k, self.renormalize, self.shard = cfg.num_experts_per_tok, cfg.norm_topk_prob, shard
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # replicated: [E, H] is small
        self.experts = FusedExperts(cfg, shard, moe_op(backend))
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            # Its checkpoint name, for an FP8 checkpoint's ignore list (its linears follow the dense path).
            self.shared_expert = MLP(cfg, shard, pointwise_ops(backend), f"model.layers.{layer_idx}.mlp.shared_expert",
                                     inter=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        if self.shared_expert is not None:
            s = self.shared_expert
            # The down projection without its all-reduce: this rank's partial joins the experts'.
            shared = s.down_proj.linear(s.silu_and_mul(s.gate_up_proj(x)), None)  # FP8 or not
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
        return all_reduce(out) if self.shard.size > 1 else out
