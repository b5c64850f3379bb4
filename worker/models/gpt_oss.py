"""gpt-oss (GptOssForCausalLM) as transformers computes it.

The decoder is the Llama one (models/llama.py) with what the config turns on there: q/k/v and
o_proj biases, a learned sink logit per query head in every softmax (the attention backends'
`sinks`), sliding-window attention on the layers `layer_types` names (`window`), YaRN rope with
its attention factor folded into cos/sin. What is gpt-oss's own lives here, the MLP of every layer:

- the router: a linear with bias, softmax over the k largest logits (computed as the renormalised
  top-k of a softmax over all E, kernels/reference.py: moe_route_ref: the same numbers);
- the experts, stacked as models/moe.py's FusedExperts are (w13 [E, 2I, H], gate rows then up
  rows; w2 [E, H, I]) plus their biases. The checkpoint keeps them as transformers' module does:
  `experts.gate_up_proj` [E, H, 2I] with gate and up interleaved (gate = [..., ::2], up =
  [..., 1::2]), `gate_up_proj_bias` [E, 2I] likewise, `down_proj` [E, I, H], `down_proj_bias`
  [E, H]; the loader separates and transposes them. The activation is the clamped SwiGLU
  (kernels/reference.py: clamped_swiglu_ref).

The experts run on the torch reference (fused_moe_ref with biases and the clamped SwiGLU) on
every backend: the Triton fused MoE kernel has neither yet. That path reads expert counts on the
host, so a CUDA graph cannot capture it: `cuda_graphs` is False and the runner decodes eagerly.
MXFP4 checkpoints (quantization_config.quant_method mxfp4) are refused at start
(config/quantization.py), as are FP8 ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.reference import fused_moe_routed_ref
from pdserve.worker.attention.backend import AttentionBackend
from pdserve.worker.config.model import ModelConfig
from pdserve.worker.models.llama import LlamaForCausalLM
from pdserve.worker.parallel.communicator import all_reduce
from pdserve.worker.parallel.shard import TPShard

# Checkpoint name of each expert tensor (under layers.N.mlp.experts.) -> our parameter.
_EXPERT_TENSORS = {"gate_up_proj": "w13", "gate_up_proj_bias": "w13_bias", "down_proj": "w2",
                   "down_proj_bias": "w2_bias"}


class GptOssExperts(nn.Module):
    """The rank's experts: all E with I/N columns each (tensor parallel), or E/N whole ones
    (expert parallel), as FusedExperts holds them, plus the biases. Under tensor parallelism the
    down bias is added by rank 0 only (the partial outputs are summed), as RowParallelLinear's."""

    def __init__(self, cfg: ModelConfig, shard: TPShard):
        super().__init__()
        self.shard, self.local = shard, shard.local_experts
        self.inter = n = shard.expert_intermediate_size
        e, h = len(self.local), cfg.hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * n, h))
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * n))
        self.w2 = nn.Parameter(torch.empty(e, h, n))
        self.w2_bias = nn.Parameter(torch.empty(e, h))
        self.top_k, self.alpha, self.limit = cfg.num_experts_per_tok, cfg.swiglu_alpha, cfg.swiglu_limit

    def shard_ids(self, param_name: str) -> list:
        """Each parameter comes whole from one checkpoint tensor (what load_weights checks)."""
        ours = param_name.rpartition(".")[2]
        return [name for name, p in _EXPERT_TENSORS.items() if p == ours]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: str) -> None:
        """`loaded`: the checkpoint's stacked tensor `shard_id` (a tensor, or a safetensors slice
        under tensor parallelism: only the held experts are read)."""
        n = self.inter
        col = 0 if self.shard.expert_parallel else self.shard.rank * n  # this rank's I columns
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

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], the router's logits [T, E] -> this rank's partial output [T, H]."""
        return fused_moe_routed_ref(x, self.w13, self.w2, router_logits, self.top_k, True,
                                    expert_offset=self.local.start, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                                    swiglu_alpha=self.alpha, swiglu_limit=self.limit)


class GptOssMoeBlock(nn.Module):
    """Router (replicated, with bias) + experts; checkpoint names `mlp.router.*`, `mlp.experts.*`."""

    def __init__(self, cfg: ModelConfig, shard: TPShard):
        super().__init__()
        self.shard = shard
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.experts = GptOssExperts(cfg, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, F.linear(x, self.router.weight, self.router.bias))
        return all_reduce(out) if self.shard.size > 1 else out


class GptOssForCausalLM(LlamaForCausalLM):
    # The experts' torch path reads counts on the host (see the module docstring).
    cuda_graphs = False

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, shard: TPShard | None = None):
        if cfg.quantization is not None:
            from pdserve.worker.config.quantization import QuantizationError

            raise QuantizationError(f"{cfg.architecture}: FP8 ({cfg.quantization.describe}) is not implemented for "
                                    f"gpt-oss; run the unquantized checkpoint without --quantization")
        super().__init__(cfg, backend, max_positions, shard)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, shard: TPShard) -> nn.Module:
        return GptOssMoeBlock(cfg, shard)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        owner, _, leaf = name.rpartition(".")
        if owner.endswith(".mlp.experts") and leaf in _EXPERT_TENSORS:
            return f"{owner}.{_EXPERT_TENSORS[leaf]}", leaf
        return super().checkpoint_target(name)
