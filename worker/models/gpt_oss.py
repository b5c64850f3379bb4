"""gpt-oss (GptOssForCausalLM) as transformers computes it.

The decoder is the Llama one (models/llama.py) with what the config turns on there: q/k/v and
o_proj biases, a learned sink logit per query head in every softmax (the attention backends'
`sinks`), sliding-window attention on the layers `layer_types` names (`window`), YaRN rope with
its attention factor folded into cos/sin. What is gpt-oss's own lives here, the MLP of every layer:

- the router: a linear with bias, softmax over the k largest logits (computed as the renormalised
  top-k of a softmax over all E, kernels/reference.py: moe_route_ref: the same numbers);
- the experts, stacked as models/moe.py's FusedExperts are (w13 [E, 2I, H], gate rows then up
  rows; w2 [E, H, I]) plus their biases, with the clamped SwiGLU (clamped_swiglu_ref).

Checkpoints, two formats of the experts (the biases are bf16 in both: `gate_up_proj_bias` [E, 2I]
with gate and up interleaved, `down_proj_bias` [E, H]):
- unquantized (bf16 conversions): transformers' module layout, `gate_up_proj` [E, H, 2I] with
  gate and up interleaved (gate = [..., ::2], up = [..., 1::2]) and `down_proj` [E, I, H]; the
  loader separates and transposes them.
- MXFP4 as published (quantization_config.quant_method mxfp4, config/quantization.py):
  `gate_up_proj_blocks` [E, 2I, H/32, 16] / `gate_up_proj_scales` [E, 2I, H/32] and
  `down_proj_blocks` [E, H, I/32, 16] / `down_proj_scales` [E, H, I/32], uint8 (kernels/mxfp4.py:
  already [out, in]; the gate_up rows interleaved gate/up). The loader keeps them packed, only
  permuting gate_up's rows into [gate; up] (and taking this rank's rows of w13 and 32-column
  blocks of w2's I columns under tensor parallelism: I/N must be a multiple of 32, TPShard).
  Where the fused Triton MoE op runs them (`experts_op`), they stay packed: the model's GPU copy of
  the experts is the checkpoint's 4.25 bits per weight, never bf16; elsewhere (CPU, the torch
  attention backend) they are dequantized to the compute dtype once loaded (`finish_loading`).
  `--load-format dummy` fills the packed tensors in place (loader.init_dummy_weights): with the
  fused op, gpt-oss-120b is built from its config.json in its 65 GB.

`experts_op` is the one choice of the experts' op: kernels/fused_moe.fused_moe_routed (biases, the
clamped SwiGLU, bf16 or MXFP4 weights) on the Triton backend, the torch reference
(fused_moe_routed_ref, which takes the same arguments) otherwise. The reference reads expert counts on the
host, which a CUDA graph cannot capture: the model's `cuda_graphs` is True only with the fused op.
FP8 (quant_method fp8 or --quantization fp8) is refused for gpt-oss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.moe_activation import SwigluOAI
from pdserve.kernels.mxfp4 import BLOCK, dequantize_mxfp4
from pdserve.kernels.reference import fused_moe_routed_ref
from pdserve.worker.attention.backend import AttentionBackend
from pdserve.worker.config.model import ModelConfig
from pdserve.worker.config.quantization import QuantizationError
from pdserve.worker.models.llama import LlamaForCausalLM
from pdserve.worker.models.moe import DecodeGate, moe_op
from pdserve.worker.parallel.communicator import all_reduce
from pdserve.worker.parallel.shard import TPShard

# Checkpoint name of each expert tensor (under layers.N.mlp.experts.) -> our parameter, per format.
_DENSE_TENSORS = {"gate_up_proj": "w13", "gate_up_proj_bias": "w13_bias", "down_proj": "w2",
                  "down_proj_bias": "w2_bias"}
_MXFP4_TENSORS = {"gate_up_proj_blocks": "w13", "gate_up_proj_scales": "w13_scale", "down_proj_blocks": "w2",
                  "down_proj_scales": "w2_scale", "gate_up_proj_bias": "w13_bias", "down_proj_bias": "w2_bias"}


def experts_op(backend: AttentionBackend) -> Callable:
    """The experts' op: models/moe.py's choice for the backend (the fused Triton op on the Triton
    backend, the torch reference elsewhere)."""
    return moe_op(backend)


def _uint8(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)


class GptOssExperts(nn.Module):
    """The rank's experts: all E with I/N columns each (tensor parallel), or E/N whole ones
    (expert parallel), as FusedExperts holds them, plus the biases. Under tensor parallelism the
    down bias is added by rank 0 only (the partial outputs are summed), as RowParallelLinear's.

    MXFP4 checkpoints: w13 / w2 are built packed (uint8 [E, 2n, H/2] and [E, H, n/2], kernels/mxfp4.py)
    with their E8M0 exponents w13_scale [E, 2n, H/32] / w2_scale [E, H, n/32], and stay so when
    `packed` (the fused op reads them); otherwise finish_loading dequantizes them."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, op: Callable, packed: bool = False, name: str = "experts"):
        super().__init__()
        self.shard, self.local, self.op, self.name = shard, shard.local_experts, op, name
        self.inter = n = shard.expert_intermediate_size
        e, h = len(self.local), cfg.hidden_size
        self.mxfp4 = cfg.mxfp4 is not None
        self.packed = self.mxfp4 and packed
        self.tensors = _MXFP4_TENSORS if self.mxfp4 else _DENSE_TENSORS
        if self.mxfp4:
            if h % BLOCK or n % BLOCK:
                raise QuantizationError(f"{name}: MXFP4 experts need the hidden size ({h}) and each rank's expert "
                                        f"columns ({n}) to be multiples of {BLOCK}")
            self.w13, self.w13_scale = _uint8(e, 2 * n, h // 2), _uint8(e, 2 * n, h // BLOCK)
            self.w2, self.w2_scale = _uint8(e, h, n // 2), _uint8(e, h, n // BLOCK)
            self.param_dtypes = {p: torch.uint8 for p in ("w13", "w13_scale", "w2", "w2_scale")}
        else:
            self.w13 = nn.Parameter(torch.empty(e, 2 * n, h))
            self.w2 = nn.Parameter(torch.empty(e, h, n))
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * n))
        self.w2_bias = nn.Parameter(torch.empty(e, h))
        self.top_k, self.alpha, self.limit = cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit

    def shard_ids(self, param_name: str) -> list:
        """Each parameter comes whole from one checkpoint tensor (what load_weights checks)."""
        ours = param_name.rpartition(".")[2]
        return [name for name, p in self.tensors.items() if p == ours]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        """`loaded`: the checkpoint's stacked tensor `shard_id` (a tensor, or a safetensors slice
        under tensor parallelism: only the held experts are read)."""
        n = self.inter
        col = 0 if self.shard.expert_parallel else self.shard.rank * n  # this rank's I columns
        if shard_id.endswith(("_blocks", "_scales")):
            self._load_mxfp4(param, loaded, shard_id, col)
            return
        for i, e in enumerate(self.local):
            t = loaded[e:e + 1][0]
            if shard_id == "gate_up_proj":  # [H, 2I], columns gate0 up0 gate1 up1 ...
                param.data[i, :n].copy_(t[:, 0::2][:, col:col + n].t())
                param.data[i, n:].copy_(t[:, 1::2][:, col:col + n].t())
            elif shard_id == "gate_up_proj_bias":  # [2I], interleaved likewise
                param.data[i, :n].copy_(t[0::2][col:col + n])
                param.data[i, n:].copy_(t[1::2][col:col + n])
            elif shard_id == "down_proj":  # [I, H]
                param.data[i].copy_(t[col:col + n].t())
            elif self.shard.expert_parallel or self.shard.rank == 0:  # down_proj_bias [H]
                param.data[i].copy_(t)
            else:
                param.data[i].zero_()

    def _load_mxfp4(self, param: nn.Parameter, loaded, shard_id: str, col: int) -> None:
        """This rank's rows of the packed gate_up (rows 2j, 2j + 1 are gate and up of column j: into
        [gate; up]) or 32-column blocks of the packed down projection, copied as they are."""
        full, n = self.shard.full, self.inter
        gate_up = shard_id.startswith("gate_up")
        rows, k = (2 * full.moe_intermediate_size, full.hidden_size) if gate_up else \
            (full.hidden_size, full.moe_intermediate_size)
        want = (full.num_experts, rows, k // BLOCK) + ((BLOCK // 2,) if shard_id.endswith("_blocks") else ())
        what = f"checkpoint tensor {self.name}.{shard_id}"
        shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())
        if shape != want:
            raise QuantizationError(f"{what} has shape {list(shape)}, expected {list(want)} (MXFP4: [experts, "
                                    f"{'2 x intermediate' if gate_up else 'hidden'}, inputs / {BLOCK}"
                                    f"{', 16 bytes' if len(want) == 4 else ''}])")
        dtype = loaded.dtype if isinstance(loaded, torch.Tensor) else loaded.get_dtype()
        if dtype not in (torch.uint8, "U8"):
            raise QuantizationError(f"{what} is {dtype}; MXFP4 blocks and scales are uint8")
        for i, e in enumerate(self.local):
            if gate_up:  # this rank's columns' rows: gate col, up col, gate col + 1, ...
                t = loaded[e:e + 1, 2 * col:2 * (col + n)][0].reshape(2 * n, -1)
                param.data[i, :n].copy_(t[0::2])
                param.data[i, n:].copy_(t[1::2])
            else:  # [H, I/32(, 16)]: this rank's blocks of I columns
                t = loaded[e:e + 1, :, col // BLOCK:(col + n) // BLOCK][0]
                param.data[i].copy_(t.reshape(full.hidden_size, -1))

    def finish_loading(self, compute_dtype: torch.dtype) -> None:
        """MXFP4 experts where the fused op does not run them: dequantized to the compute dtype, one
        expert at a time (no fp32 copy of a whole layer)."""
        if not self.mxfp4 or self.packed:
            return
        for name in ("w13", "w2"):
            q, s = getattr(self, name), getattr(self, f"{name}_scale")
            dense = torch.empty(*q.shape[:-1], q.shape[-1] * 2, dtype=compute_dtype, device=q.device)
            for i in range(q.shape[0]):
                dense[i] = dequantize_mxfp4(q[i], s[i], compute_dtype)
            setattr(self, name, nn.Parameter(dense, requires_grad=False))
            delattr(self, f"{name}_scale")
        del self.param_dtypes

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], the router's logits [T, E] -> this rank's partial output [T, H]."""
        return self.op(x, self.w13, self.w2, router_logits, self.top_k, True, **self._op_args())

    def forward_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] already routed (weights [T, k] fp32, global expert ids [T, k]) -> this rank's
        partial output [T, H], on the fused op's experts half (kernels/fused_moe.fused_moe)."""
        from pdserve.kernels.fused_moe import fused_moe

        return fused_moe(x, self.w13, self.w2, weights, ids, **self._op_args())

    def _op_args(self) -> dict:
        mxfp4 = dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale) if self.packed else {}
        return dict(expert_offset=self.local.start, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                    activation=SwigluOAI(self.alpha, self.limit), **mxfp4)


class GptOssMoeBlock(nn.Module):
    """Router (replicated, with bias) + experts; checkpoint names `mlp.router.*`, `mlp.experts.*`.

    Where the experts run on the fused Triton op, decode-sized steps route with models/moe.py's
    DecodeGate (the router's GEMV and top-k in one launch, instead of cuBLAS's split-K GEMV, its
    reduce and the routing kernel); larger steps, and the reference op, take the router's logits
    from F.linear."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, op: Callable, layer_idx: int):
        super().__init__()
        self.shard = shard
        self.decode_gate = DecodeGate() if op is not fused_moe_routed_ref else None
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        name = f"model.layers.{layer_idx}.mlp.experts"
        if cfg.mxfp4 is not None and not cfg.mxfp4.converts(name):
            raise QuantizationError(f"quantization_config.modules_to_not_convert = {list(cfg.mxfp4.ignore)} leaves "
                                    f"{name} unquantized: gpt-oss's experts must all be MXFP4 in an mxfp4 checkpoint")
        self.experts = GptOssExperts(cfg, shard, op, packed=op is not fused_moe_routed_ref, name=name)

    def finish_loading(self, compute_dtype: torch.dtype) -> None:
        if self.decode_gate is not None:
            self.decode_gate.allocate(self.router.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode_gate is not None and self.decode_gate.takes(x.shape[0], self.experts.packed):
            weights, ids = self.decode_gate(x, self.router.weight, self.router.bias, self.experts.top_k, True)
            out = self.experts.forward_routed(x, weights, ids)
        else:
            out = self.experts(x, F.linear(x, self.router.weight, self.router.bias))
        return all_reduce(out) if self.shard.size > 1 else out

    def takes_norm(self, x: torch.Tensor, norm: nn.Module) -> bool:
        return self.decode_gate is not None and self.decode_gate.takes_norm(x, norm, self.experts.packed)

    def forward_norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None):
        """norm(x (+ residual)) and this block in the router's launch (takes_norm): (out, x + residual)."""
        weights, ids, h, residual = self.decode_gate(x, self.router.weight, self.router.bias, self.experts.top_k,
                                                     True, norm, residual)
        out = self.experts.forward_routed(h, weights, ids)
        return (all_reduce(out) if self.shard.size > 1 else out), residual


class GptOssForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, shard: TPShard | None = None):
        if cfg.quantization is not None:
            raise QuantizationError(f"{cfg.architecture}: FP8 ({cfg.quantization.describe}) is not implemented for "
                                    f"gpt-oss; run the unquantized or MXFP4 checkpoint without --quantization")
        self.experts_op = experts_op(backend)
        super().__init__(cfg, backend, max_positions, shard)
        # The reference reads expert counts on the host: no CUDA graph can capture it.
        self.cuda_graphs = self.experts_op is not fused_moe_routed_ref

    def make_mlp(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, shard: TPShard) -> nn.Module:
        return GptOssMoeBlock(cfg, shard, self.experts_op, layer_idx)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".mlp.experts"):
            ours = _MXFP4_TENSORS if self.cfg.mxfp4 is not None else _DENSE_TENSORS
            if leaf in ours:
                return f"{owner}.{ours[leaf]}", leaf
            if leaf in _MXFP4_TENSORS or leaf in _DENSE_TENSORS:
                raise QuantizationError(f"checkpoint tensor {name!r} is {'un' if leaf in _DENSE_TENSORS else ''}"
                                        f"quantized, but config.json's quantization_config says the experts are "
                                        f"{'MXFP4' if self.cfg.mxfp4 is not None else 'not quantized'}")
        return super().checkpoint_target(name)
