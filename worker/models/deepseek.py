"""DeepSeek-V2/V3 decoders (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; R1, V3.1, Kimi-K2):
the Llama decoder layer (models/llama.py: pre-norm residual blocks, the dense MLP in the first
`first_k_dense_replace` layers) with multi-head latent attention and the DeepSeekMoE block
(config/deepseek.py says what each is).

Attention (`LatentAttention`): the query comes from the hidden state through q_proj, or through
q_a_proj, an RMSNorm and q_b_proj (q_lora_rank); kv_a_proj_with_mqa gives the token's latent
(RMS-normed) and its rope key, which is what the cache keeps (attention/kv_spec.py, attention/mla.py).
Rope turns only the qk_rope_head_dim part, over interleaved pairs where the config says so.

Tensor parallelism: the query and kv_b up-projections are split by heads, o_proj by its input
columns; q_a_proj and kv_a_proj_with_mqa are replicated, so every rank computes and caches the
whole latent (it is shared by all heads).

MoE (`DeepseekMoeBlock`): the router in fp32, its group-limited top-k in one kernel on the Triton
backend (kernels/moe_grouped_route.py; else kernels/reference.py: moe_grouped_route_ref), the
routed experts through the fused MoE op's top-k entry (models/moe.py: FusedExperts.apply_topk), the
shared experts as one dense MLP whose partial sum joins the experts' before the all-reduce.

Checkpoints may carry multi-token-prediction layers (layers numbered from num_hidden_layers on):
they are skipped at load, with a log line.
"""

from __future__ import annotations

import logging
import re

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.reference import rotary_interleaved_ref, rotary_ref
from pdserve.worker.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.worker.attention.mla import latent_attention
from pdserve.worker.config.model import ModelConfig
from pdserve.worker.models.llama import MLP, LlamaForCausalLM, RMSNorm, pointwise_ops
from pdserve.worker.models.moe import FusedExperts, grouped_route_op, moe_op, topk_experts_op
from pdserve.worker.models.moe_causal_lm import expert_checkpoint_target
from pdserve.worker.parallel.communicator import all_reduce
from pdserve.worker.parallel.layers import ColumnParallelLinear, RowParallelLinear
from pdserve.worker.parallel.shard import TPShard
from pdserve.worker.quantization.fp8_linear import linear_method

log = logging.getLogger(__name__)

# transformers builds q_a_layernorm and kv_a_layernorm with their default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6
_LAYER = re.compile(r"^layers\.(\d+)\.")


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, shard: TPShard):
        super().__init__()
        m, q, hidden = cfg.mla, cfg.quantization, cfg.hidden_size
        prefix = f"model.layers.{layer_idx}.self_attn"
        whole = TPShard(0, 1, shard.full)  # replicated linears: every rank holds them whole
        self.layer_idx, self.backend, self.mla = layer_idx, backend, m
        self.num_heads = shard.num_heads
        heads = cfg.num_heads

        def method(name):
            return linear_method(q, prefix, [name])

        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * m.qk_head_dim, False, shard, method("q_proj"))
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, m.q_lora_rank, cfg.qkv_bias, whole, method("q_a_proj"))
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, pointwise_ops(backend))
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, heads * m.qk_head_dim, False, shard,
                                                 method("q_b_proj"))
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, m.latent_dim, cfg.qkv_bias, whole,
                                                       method("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, pointwise_ops(backend))
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), False,
                                              shard, method("kv_b_proj"))
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, hidden, cfg.qkv_bias, shard, method("o_proj"))
        self.rotary = rotary_interleaved_ref if m.rope_interleave else rotary_ref
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, N, R], W_UV [H, V, R]) of this rank's heads, made once after loading. Read
        back through the linear itself (kv_b_proj applied to the identity), so an FP8 kv_b_proj
        gives the matrix its own GEMM computes with (identity rows quantize exactly)."""
        if self._absorbed is None:
            if self.kv_b_proj.weight.is_cuda and torch.cuda.is_current_stream_capturing():
                # Made inside a graph, they would live in its memory pool: the warm-up step makes them.
                raise RuntimeError("LatentAttention: absorbed weights made during CUDA-graph capture; run a "
                                   "forward before capturing")
            m, w = self.mla, self.kv_b_proj.weight
            dtype = w.dtype if w.is_floating_point() and w.element_size() > 1 else self.kv_a_layernorm.weight.dtype
            eye = torch.eye(m.kv_lora_rank, dtype=dtype, device=w.device)
            full = self.kv_b_proj(eye).t().reshape(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
            self._absorbed = (full[:, :m.qk_nope_head_dim].contiguous(), full[:, m.qk_nope_head_dim:].contiguous())
        return self._absorbed

    def expand(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.mla
        kv = self.kv_b_proj(latents).view(latents.shape[0], self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        return kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)

    def forward(self, positions, x, cos_sin, meta: AttentionMetadata):
        m, t = self.mla, x.shape[0]
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))[0])
        q_nope, q_pe = q.view(t, self.num_heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c, _ = self.kv_a_layernorm(c)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe[:, None, :], cos_sin)
        w_uk, w_uv = self.absorbed()
        o = latent_attention(self.backend, self.layer_idx, torch.cat([c, k_pe[:, 0]], dim=-1), q_nope, q_pe, meta,
                             m.softmax_scale, w_uk, w_uv, self.expand)
        return self.o_proj(o.reshape(t, self.num_heads * m.v_head_dim))


class DeepseekMoeBlock(nn.Module):
    """Router (`gate`, fp32, with V3's e_score_correction_bias) + routed experts + shared experts;
    checkpoint names mlp.gate.*, mlp.experts.N.*, mlp.shared_experts.*."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, shard: TPShard, layer_idx: int):
        super().__init__()
        r = cfg.deepseek_routing
        self.routing, self.top_k, self.renormalize, self.shard = r, cfg.num_experts_per_tok, cfg.norm_topk_prob, shard
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        # transformers keeps the router in fp32 whatever the model's dtype; so do we.
        self.gate.param_dtypes = {"weight": torch.float32}
        if r.correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.empty(cfg.num_experts), requires_grad=False)
            self.gate.param_dtypes["e_score_correction_bias"] = torch.float32
        self.experts = FusedExperts(cfg, shard, moe_op(backend), fp8_kernel=backend.name == "triton",
                                    topk_op=topk_experts_op(backend))
        self.route = grouped_route_op(backend)
        self.shared_experts = None
        if r.n_shared_experts:
            self.shared_experts = MLP(cfg, shard, pointwise_ops(backend),
                                      f"model.layers.{layer_idx}.mlp.shared_experts",
                                      inter=cfg.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.routing
        weights, ids = self.route(
            F.linear(x.float(), self.gate.weight.float()), self.top_k, r.scoring, r.n_group, r.topk_group,
            r.group_score, getattr(self.gate, "e_score_correction_bias", None), self.renormalize,
            r.routed_scaling_factor)
        out = self.experts.apply_topk(x, weights, ids)
        if self.shared_experts is not None:
            s = self.shared_experts
            # The down projection without its all-reduce: this rank's partial joins the experts'.
            out = out + s.down_proj.linear(s.silu_and_mul(s.gate_up_proj(x)), None)
        return all_reduce(out) if self.shard.size > 1 else out


class DeepseekForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, shard: TPShard | None = None):
        super().__init__(cfg, backend, max_positions, shard)
        # A decode step on the Triton backend reads slots, lengths and block tables on the device
        # only (the latent write and decode kernels, attention/mla.py), routes in one kernel
        # (kernels/moe_grouped_route.py: shapes only on the host) and runs the experts through the
        # fused op: a CUDA graph can capture it. The torch backend's references read the host (and
        # never run under graphs).
        self.cuda_graphs = backend.name == "triton"

    def make_attention(self, cfg, layer_idx, backend, shard):
        return LatentAttention(cfg, layer_idx, backend, shard)

    def make_mlp(self, cfg, layer_idx, backend, shard):
        return DeepseekMoeBlock(cfg, backend, shard, layer_idx) if layer_idx in cfg.moe_layers else None

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        if ".self_attn." in name:
            return name, None  # no fused projections: q_proj is MLA's own, not a part of qkv_proj
        target = expert_checkpoint_target(name)
        return target if target is not None else super().checkpoint_target(name)

    def load_weights(self, weights) -> None:
        n = self.cfg.num_layers
        skipped: set[int] = set()

        def decoder_layers():
            for name, w in weights:
                m = _LAYER.match(name.removeprefix("model."))
                if m and int(m.group(1)) >= n:
                    skipped.add(int(m.group(1)))
                    continue
                yield name, w

        super().load_weights(decoder_layers())
        if skipped:
            log.info("load: skipped multi-token-prediction layer(s) %s of %s (speculative decoding with them is "
                     "not implemented)", sorted(skipped), self.cfg.architecture)
