"""Mixture-of-experts decoders: Qwen3-MoE, Mixtral, Qwen2-MoE.

All three are the Llama decoder (models/llama.py: attention with Qwen3's q/k norms or Qwen2's
q/k/v bias as the config says, pre-norm residual layers) with the MLP of the layers in
`cfg.moe_layers` replaced by the sparse block (models/moe.py); the other layers keep the dense
MLP (Qwen's mlp_only_layers / decoder_sparse_step). What differs between the three is data:
the router's normalisation (`norm_topk_prob`), Qwen2-MoE's shared expert, and Mixtral's
checkpoint names, mapped here at load.
"""

from __future__ import annotations

import re

from torch import nn

from pdserve.worker.attention.backend import AttentionBackend
from pdserve.worker.config.model import ModelConfig
from pdserve.worker.models.llama import LlamaForCausalLM
from pdserve.worker.models.moe import SparseMoeBlock
from pdserve.worker.parallel.shard import TPShard

# layers.N.mlp.experts.E.{gate,up,down}_proj.weight (Qwen) | ...{w1,w3,w2}.weight (Mixtral); FP8
# checkpoints add each matrix's weight_scale (per-tensor / per-channel) or weight_scale_inv (blocks)
# and, for static activation schemes, an input_scale (unused: the experts run in the compute dtype).
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                     r"\.(weight|weight_scale|weight_scale_inv|input_scale)$")
_PART = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
         "down_proj": ("w2", None), "w2": ("w2", None)}


def expert_checkpoint_target(name: str) -> tuple[str, object] | None:
    """A per-expert checkpoint tensor's (our parameter, its weight loader's part id); None: not one."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    param, part = _PART[m.group(3)]
    kind = m.group(4)
    if kind == "input_scale":
        return f"{m.group(1)}.input_scale", None  # no such parameter: load_weights skips it
    return f"{m.group(1)}.{param}", (int(m.group(2)), part) + (("scale",) if kind != "weight" else ())


class MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, shard: TPShard) -> nn.Module | None:
        return SparseMoeBlock(cfg, backend, shard, layer_idx) if layer_idx in cfg.moe_layers else None

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        # Mixtral keeps its sparse block under `block_sparse_moe`; ours is `mlp` for every family.
        name = name.replace(".block_sparse_moe.", ".mlp.")
        target = expert_checkpoint_target(name)
        return target if target is not None else super().checkpoint_target(name)
