"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) over a paged KV cache.

Tokens of all scheduled sequences are flattened into one [T] batch (no padding); attention
reads per-sequence context from the paged cache through the attention backend. q/k/v and
gate/up projections are fused at load time (one GEMM each instead of three / two).

The same code runs at any tensor-parallel size: the projections, the embedding and the lm_head
are parallel layers (parallel/layers.py) built from the full model's sizes and the rank's
`TPShard`; each loads its own slice of the checkpoint and runs its own collective. At TP = 1
the shard is the whole model and no collective runs. `self.cfg` is the rank's view (its heads,
MLP columns and vocabulary rows: parallel/shard.py), from which the KV cache is sized.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.kernels.reference import (
    rms_norm_fp8_ref,
    rms_norm_ref,
    rotary_ref,
    silu_and_mul_fp8_ref,
    silu_and_mul_ref,
)
from pdserve.worker.attention.backend import AttentionBackend, AttentionMetadata
from pdserve.worker.config.model import ModelConfig
from pdserve.worker.models.cpu_packed import packed_linear
from pdserve.worker.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    logits,
    weight_loader_of,
)
from pdserve.worker.parallel.shard import TPShard, shard_config
from pdserve.worker.quantization.fp8_activations import Fp8ActFormat, Fp8Activations
from pdserve.worker.quantization.fp8_linear import fp8_input_format, linear_method


@dataclass(frozen=True)
class PointwiseOps:
    """The element-wise stages, all of one kind: torch references or Triton launchers. The
    `_fp8` ones also quantize their output for the FP8 linear after them (fp8_activations.py)."""

    rms_norm: Callable
    rotary: Callable
    silu_and_mul: Callable
    rms_norm_fp8: Callable
    silu_and_mul_fp8: Callable


TORCH_OPS = PointwiseOps(rms_norm_ref, rotary_ref, silu_and_mul_ref, rms_norm_fp8_ref, silu_and_mul_fp8_ref)


def triton_ops() -> PointwiseOps:
    # Imported here, not at module level: Triton is needed only once the Triton backend is
    # chosen, and the CPU path (`pdserve up` as README installs it) has no Triton at all.
    from pdserve.kernels.rms_norm import rms_norm
    from pdserve.kernels.rms_norm_fp8 import rms_norm_fp8
    from pdserve.kernels.rotary import rotary
    from pdserve.kernels.silu_and_mul import silu_and_mul
    from pdserve.kernels.silu_and_mul_fp8 import silu_and_mul_fp8

    return PointwiseOps(rms_norm, rotary, silu_and_mul, rms_norm_fp8, silu_and_mul_fp8)


def gemv_mode(backend: AttentionBackend) -> str | None:
    """The engine's use of the small-batch GEMV path (kernels/fused_gemv.py), from the Triton
    backend's `fused_gemv` switch: None (off: other backends, or the switch False), "measured"
    (the default: the shapes fused_gemv.MEASURED says it wins on this card) or "any" (the switch
    True: every shape that fits, the heuristic config where unmeasured; tests and benches)."""
    if backend.name != "triton":
        return None
    switch = getattr(backend, "fused_gemv", None)
    return None if switch is False else "any" if switch is True else "measured"


def gemv_fits(linear: nn.Module) -> bool:
    """A linear the GEMV can stand in for: unquantized (its weight is the plain [N, K] matrix);
    column- and row-parallel shards qualify as they are (a rank's rows or columns)."""
    return getattr(linear, "quant", None) is None


def prologue_fits(linear: nn.Module) -> bool:
    """A linear whose GEMV can take the norm or SiLU·mul before it: an unquantized one (fused_gemv)
    or an FP8 one (its method's prologue_gemv: kernels/fp8_gemv.py)."""
    quant = getattr(linear, "quant", None)
    return quant is None or hasattr(quant, "prologue_gemv")


@functools.cache
def _gemv_kernel():
    # Imported on use: Triton exists only where the Triton backend was chosen.
    from pdserve.kernels import fused_gemv

    return fused_gemv


def _fused_gemv():
    return _gemv_kernel().fused_gemv


def gemv_rows_ok(x: torch.Tensor, mode: str | bool, prologue: str, weight: torch.Tensor, *others: torch.Tensor) -> bool:
    """A step the GEMV takes under `mode` (gemv_mode's; True reads as "any"): at most MAX_ROWS
    tokens, a shape the kernel's measured table does not hand back to cuBLAS
    (fused_gemv.gemv_preferred), all operands of one dtype (the kernel's contract). Shapes and
    dtypes only: no sync, so a graph captures the branch it replays."""
    n, k = weight.shape
    return (x.shape[0] > 0
            and _gemv_kernel().gemv_preferred(prologue, x.shape[0], n, k, x.device, measured_only=mode == "measured")
            and all(t.dtype == x.dtype for t in (weight, *others)))


def step_gemv(linear: nn.Module, x: torch.Tensor, mode: str | bool | None, prologue: str, *others: torch.Tensor):
    """The GEMV that takes `linear` with `prologue` fused in for this step, called as fused_gemv is
    (x, prologue, bias=, norm_weight=, eps=, residual=) -> (out, new residual or None); None: the
    step runs the op and the linear apart. Unquantized: fused_gemv where gemv_rows_ok says so
    (`others`: the other operands whose dtype must match); FP8: the method's prologue_gemv."""
    if not mode:
        return None
    quant = getattr(linear, "quant", None)
    if quant is not None:
        return quant.prologue_gemv(linear, x.shape[0]) if x.shape[0] > 0 else None
    if not gemv_rows_ok(x, mode, prologue, linear.weight, *others):
        return None
    weight = linear.weight
    return lambda h, pro, **kw: _fused_gemv()(h, weight, pro, **kw)


@functools.cache
def cpu_ops() -> PointwiseOps:
    # The CPU backend's: bf16 rows through the native kernels (the references' values; any other
    # dtype runs the references themselves), the FP8 stages as the references.
    from pdserve.kernels.cpu_pointwise import rms_norm_cpu, rotary_cpu, silu_and_mul_cpu

    return PointwiseOps(rms_norm_cpu, rotary_cpu, silu_and_mul_cpu, rms_norm_fp8_ref, silu_and_mul_fp8_ref)


def pointwise_ops(backend: AttentionBackend) -> PointwiseOps:
    # They follow the attention backend: Triton on CUDA (and under the interpreter in the twin
    # test), the native CPU stages with the CPU backend, the references with the torch backend,
    # so one engine never mixes numerics.
    if backend.name == "triton":
        return triton_ops()
    return cpu_ops() if backend.name == "cpu" else TORCH_OPS


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: PointwiseOps = TORCH_OPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fn = ops.rms_norm
        self.fn_fp8 = ops.rms_norm_fp8

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp8: Fp8ActFormat | None = None):
        """(normed, x + residual or None). `fp8`: normed comes quantized in that format, for the
        FP8 linear after this norm (fp8_input_format); the residual sum stays in x's dtype."""
        if fp8 is not None:
            q, scale, residual = self.fn_fp8(x, self.weight, self.eps, residual, **fp8.kwargs())
            return Fp8Activations(q, scale, x.shape[0], fp8, torch.promote_types(self.weight.dtype, x.dtype)), residual
        if x.dim() == 2 or self.fn is rms_norm_ref:
            return self.fn(x, self.weight, self.eps, residual)
        # Per-head norm (Qwen3 q/k, [T, H, D]): the launcher takes rows, so flatten the heads.
        out, _ = self.fn(x.reshape(-1, x.shape[-1]), self.weight, self.eps)
        return out.view(x.shape), None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies, computed exactly as Hugging Face does (fp32, int64 arange)."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = dict(cfg.rope_scaling)
    if params.get("rope_type") == "llama3":
        factor = params["factor"]
        low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif params.get("rope_type") == "yarn":
        inv, _ = _yarn(cfg)
    return inv


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (YaRN's attention scaling; 1 for the other types)."""
    return _yarn(cfg)[1] if dict(cfg.rope_scaling).get("rope_type") == "yarn" else 1.0


def _yarn(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies and attention factor, as transformers' _compute_yarn_parameters
    computes them (fp32, the same op order)."""
    p, dim, base = dict(cfg.rope_scaling), cfg.rotary_dim, cfg.rope_theta
    old_len = p["original_max_position_embeddings"]
    factor = p.get("factor") or cfg.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the dimension keeps its frequency (extrapolates)
    return interpolation * (1 - keep) + extrapolation * keep, attention


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, shard: TPShard):
        super().__init__()
        ops = pointwise_ops(backend)
        self.rotary = ops.rotary
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        prefix, q = f"model.layers.{layer_idx}.self_attn", cfg.quantization
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.qkv_bias, shard,
                                          linear_method(q, prefix, ["q_proj", "k_proj", "v_proj"]))
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, shard,
                                        linear_method(q, prefix, ["o_proj"]))
        # gpt-oss: a learned sink logit per query head (this rank's heads), and the layer's window.
        self.shard = shard
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if cfg.attention_sinks else None
        self.window = cfg.layer_window(layer_idx)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops) if cfg.qk_norm else None
        self.scale = self.head_dim**-0.5
        self.backend = backend
        # Triton: the projection's bias, Qwen3's q/k norm, rotary and the KV write run as one
        # kernel after the GEMM (backend.forward_rotary): at one token torch adds a bias with a
        # launch of its own, and each norm is one more. The bias comes before the norm, so it
        # moves into the kernel only where the norm does too (or there is none). The torch path
        # keeps Hugging Face's op order, so fp32 stays bit-identical.
        self.fused_epilogue = backend.name == "triton"
        self.norm_in_epilogue = self.fused_epilogue and cfg.qk_norm and getattr(backend, "fuse_qk_norm", False)
        self.bias_in_epilogue = self.fused_epilogue and cfg.qkv_bias and (self.norm_in_epilogue or not cfg.qk_norm)
        # Steps of <= 8 tokens: o_proj as the small-M GEMV (the qkv one, with the norm before it,
        # is DecoderLayer's). Plain attributes, so a benchmark can flip them on a built model.
        self.gemv_o = gemv_mode(backend) if gemv_fits(self.o_proj) else None

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        """The parameters Attention holds itself (the sinks): this rank's query heads."""
        start = self.shard.rank * self.num_heads
        param.data.copy_(loaded[start:start + self.num_heads])

    def extras(self) -> dict:
        """The backend's keyword arguments for this layer: sinks and window where the model has them
        (none for the Llama family, whose calls stay exactly as they were)."""
        if self.sinks is None and not self.window:
            return {}
        return dict(sinks=self.sinks, window=self.window)

    def forward(self, positions, x, cos_sin, meta: AttentionMetadata):
        if self.bias_in_epilogue:
            qkv, bias = self.qkv_proj.linear(x, None), self.qkv_proj.bias
        else:
            qkv, bias = self.qkv_proj(x), None
        return self.attend(positions, qkv, bias, cos_sin, meta)

    def qkv_bias_split(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(bias the projection adds, bias the attention epilogue adds): one of them None."""
        if self.bias_in_epilogue:
            return None, self.qkv_proj.bias
        return self.qkv_proj.bias, None

    def attend(self, positions, qkv, bias, cos_sin, meta: AttentionMetadata):
        """Everything after the qkv projection; `bias`: the part the epilogue adds (or None)."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        extras = self.extras()
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before rotary
            if self.norm_in_epilogue:  # one eps: both norms are built from cfg.rms_norm_eps
                extras["qk_norm"] = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            else:
                q, _ = self.q_norm(q)
                k, _ = self.k_norm(k)
        if self.fused_epilogue:
            o = self.backend.forward_rotary(self.layer_idx, positions, q, k, v, cos_sin, bias, meta, self.scale,
                                            **extras)
        else:
            q, k = self.rotary(positions, q, k, cos_sin)
            o = self.backend.forward(self.layer_idx, q, k, v, meta, self.scale, **extras)
        o = o.reshape(T, self.q_size)
        if self.gemv_o and gemv_rows_ok(o, self.gemv_o, "none", self.o_proj.weight):
            out, _ = _fused_gemv()(o, self.o_proj.weight, bias=self.o_proj.bias)
            return self.o_proj.reduce(out)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard, ops: PointwiseOps = TORCH_OPS, prefix: str = "",
                 inter: int | None = None):
        """`prefix`: its checkpoint name (a quantization config may leave it unquantized); `inter`:
        its width (default the model's intermediate_size; MoE shared experts differ)."""
        super().__init__()
        self.silu_and_mul, self.silu_and_mul_fp8 = ops.silu_and_mul, ops.silu_and_mul_fp8
        inter, q = inter or cfg.intermediate_size, cfg.quantization
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], cfg.mlp_bias, shard,
                                                       linear_method(q, prefix, ["gate_proj", "up_proj"]))
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, shard,
                                           linear_method(q, prefix, ["down_proj"]))

    def forward(self, x):
        """x: the activations, or Fp8Activations quantized for gate_up_proj (its norm's)."""
        return self._down(self.gate_up_proj(x))

    def _down(self, gu: torch.Tensor) -> torch.Tensor:
        fp8 = fp8_input_format(self.down_proj, gu.shape[0])
        if fp8 is None:
            return self.down_proj(self.silu_and_mul(gu))
        # FP8 down_proj on its W8A8 path: SiLU·mul writes the quantized input (no separate pass).
        q, scale = self.silu_and_mul_fp8(gu, **fp8.kwargs())
        return self.down_proj(Fp8Activations(q, scale, gu.shape[0], fp8, gu.dtype))

    def forward_gemv(self, x: torch.Tensor, norm: "RMSNorm", residual: torch.Tensor, mode: str | bool = "any"):
        """norm(x + residual) -> gate_up -> SiLU·mul -> down with the norm fused into the gate/up
        GEMV and SiLU·mul into the down one, each stage where step_gemv takes it under `mode`
        (else that stage runs as forward does); returns (out, x + residual)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        gemv = step_gemv(gate_up, x, mode, "rms_norm", norm.weight)
        if gemv is not None:
            gu, residual = gemv(x, "rms_norm", bias=gate_up.bias, norm_weight=norm.weight, eps=norm.eps,
                                residual=residual)
        else:
            h, residual = norm(x, residual, fp8=fp8_input_format(gate_up, x.shape[0]))
            gu = gate_up(h)
        gemv = step_gemv(down, gu, mode, "silu_mul")
        if gemv is not None:
            out, _ = gemv(gu, "silu_mul", bias=down.bias)
            return down.reduce(out), residual
        return self._down(gu), residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, shard: TPShard,
                 mlp: nn.Module | None = None, attn: nn.Module | None = None):
        """`mlp`: the feed-forward block (default the dense MLP; MoE models pass their sparse block);
        `attn`: the attention block (default Attention; DeepSeek passes its latent attention)."""
        super().__init__()
        ops = pointwise_ops(backend)
        self.self_attn = attn if attn is not None else Attention(cfg, layer_idx, backend, shard)
        self.mlp = mlp if mlp is not None else MLP(cfg, shard, ops, f"model.layers.{layer_idx}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        # Steps of <= 8 tokens on the GEMV path (gemv_mode): each norm runs
        # inside the projection after it. Per projection, only where its weight is a plain matrix;
        # MoE blocks keep their own path (only the dense MLP has forward_gemv).
        # The attributes hold gemv_mode's value (None: off).
        mode = gemv_mode(backend)
        self.gemv_qkv = mode if isinstance(self.self_attn, Attention) and prologue_fits(self.self_attn.qkv_proj) \
            else None
        self.gemv_mlp = mode if isinstance(self.mlp, MLP) and prologue_fits(self.mlp.gate_up_proj) \
            and prologue_fits(self.mlp.down_proj) else None
        # An MoE block that can do the norm before it in its router's launch (models/moe.py GATE_NORM).
        self.mlp_takes_norm = getattr(self.mlp, "takes_norm", None)

    def forward(self, positions, h, residual, cos_sin, meta):
        gemv = self.gemv_qkv and step_gemv(self.self_attn.qkv_proj, h, self.gemv_qkv, "rms_norm",
                                           self.input_layernorm.weight)
        if gemv:
            h, residual = self._attention_gemv(gemv, positions, h, residual, cos_sin, meta)
        else:
            h, residual = self._attention(positions, h, residual, cos_sin, meta)
        if self.gemv_mlp:
            return self.mlp.forward_gemv(h, self.post_attention_layernorm, residual, self.gemv_mlp)
        if self.mlp_takes_norm is not None and self.mlp_takes_norm(h, self.post_attention_layernorm):
            # An MoE block whose router launch does this norm too (models/moe.py's GATE_NORM).
            return self.mlp.forward_norm(h, self.post_attention_layernorm, residual)
        # An FP8 gate_up_proj on its W8A8 path gets its input quantized by the norm.
        fp8 = fp8_input_format(self.mlp.gate_up_proj, h.shape[0]) if isinstance(self.mlp, MLP) else None
        h, residual = self.post_attention_layernorm(h, residual, fp8=fp8)
        return self.mlp(h), residual

    def _attention_gemv(self, gemv, positions, h, residual, cos_sin, meta):
        """input_layernorm(h (+ residual)) fused into the qkv projection (`gemv`: step_gemv's); then attention."""
        attn, norm = self.self_attn, self.input_layernorm
        proj_bias, epilogue_bias = attn.qkv_bias_split()
        qkv, new_res = gemv(h, "rms_norm", bias=proj_bias, norm_weight=norm.weight, eps=norm.eps, residual=residual)
        return attn.attend(positions, qkv, epilogue_bias, cos_sin, meta), h if residual is None else new_res

    def _attention(self, positions, h, residual, cos_sin, meta):
        # Residual adds are fused into the norms: norm(x + residual) also returns the sum. An FP8
        # qkv_proj on its W8A8 path gets its input quantized by the norm (fp8_input_format).
        fp8 = fp8_input_format(getattr(self.self_attn, "qkv_proj", None), h.shape[0])
        if residual is None:
            residual = h
            h, _ = self.input_layernorm(h, fp8=fp8)
        else:
            h, residual = self.input_layernorm(h, residual, fp8=fp8)
        return self.self_attn(positions, h, cos_sin, meta), residual


class LlamaForCausalLM(nn.Module):
    packed_head = None  # the output projection in oneDNN's packed layout (CPU bf16: models/cpu_packed.py)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int, shard: TPShard | None = None):
        """`cfg`: the full model's config; `shard`: this rank's part (None: the whole model, TP = 1)."""
        super().__init__()
        self.shard = shard = shard or TPShard(0, 1, cfg)
        self.cfg = shard_config(shard)  # what this rank holds (the full config at TP = 1)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, backend, shard, self.make_mlp(cfg, i, backend, shard),
                                                 self.make_attention(cfg, i, backend, shard))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, pointwise_ops(backend))
        self.lm_head = None if cfg.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, shard)
        if cfg.quantization is not None and cfg.quantization.source == "compressed-tensors" \
                and self.lm_head is not None and not cfg.quantization.ignored("lm_head"):
            from pdserve.worker.config.quantization import QuantizationError

            raise QuantizationError(f"{cfg.quantization.key}: does not list lm_head, so the checkpoint's lm_head "
                                    f"is FP8; pdserve keeps the lm_head in the compute dtype")
        self.init_rope(max_positions)
        # Called with each decoder layer's index once it has run (queued, on a GPU), while a
        # step that computes a streamed hand-off's prompt runs (kv/layer_clock.py); else None.
        self.after_layer = None

    def make_mlp(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend, shard: TPShard) -> nn.Module | None:
        """Layer `layer_idx`'s feed-forward block; None = the dense MLP (MoE models override this)."""
        return None

    def make_attention(self, cfg: ModelConfig, layer_idx: int, backend: AttentionBackend,
                       shard: TPShard) -> nn.Module | None:
        """Layer `layer_idx`'s attention block; None = Attention (DeepSeek overrides this)."""
        return None

    def init_rope(self, max_positions: int) -> None:
        """cos | sin per position, fp32 [max_positions, rotary_dim]. Re-run after to_empty()."""
        device = self.embed_tokens.weight.device
        if device.type == "meta":
            self.cos_sin = torch.empty(max_positions, self.cfg.rotary_dim, device=device)
            return
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(self.cfg)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        factor = rope_attention_factor(self.cfg)
        if factor != 1.0:  # YaRN: transformers scales cos and sin, in fp32
            cos, sin = cos * factor, sin * factor
        self.cos_sin = torch.cat([cos, sin], dim=-1).to(device)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (final norm applied)."""
        h = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual, self.cos_sin, meta)
            if self.after_layer is not None:
                self.after_layer(i)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Hidden rows -> logits of the full vocabulary (parallel/layers.logits: the weight's dtype
        at TP = 1, fp32 gathered to rank 0 under TP; None on the other ranks)."""
        if self.packed_head is not None and self.shard.size == 1:
            return packed_linear(h, self.packed_head, None).float()
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return logits(h, w, self.shard)

    # Checkpoint names -> our fused parameters: (our name, the part's id for its weight loader).
    STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """A checkpoint tensor's name (without "model.") -> (our parameter's name, the part's id for
        its weight loader). MoE models extend this for their expert tensors."""
        parts = name.split(".")
        shard = None
        if len(parts) >= 2 and parts[-2] in self.STACKED:
            fused, shard = self.STACKED[parts[-2]]
            parts[-2] = fused
        return ".".join(parts), shard

    # FP8 checkpoints' KV-cache scales (k_proj/v_proj.output_scale: AutoFP8's older names).
    KV_CACHE_SCALES = (".k_scale", ".v_scale", ".kv_scale", "_proj.output_scale")

    def load_weights(self, weights) -> None:
        """weights: iterable of (checkpoint name, tensor or safetensors slice). Each parameter's
        weight loader takes its rank's part. Fails loudly on missing/unknown names."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            if name.startswith("model."):
                name = name[len("model."):]
            if "rotary_emb.inv_freq" in name:
                continue
            if name.endswith(self.KV_CACHE_SCALES):
                continue  # FP8 KV-cache scales of FP8 checkpoints: not read by the weights (FP8 KV is its own feature)
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied embeddings: some checkpoints still carry a copy
            target_name, shard = self.checkpoint_target(name)
            if target_name not in params and name.endswith(".input_scale") and self.cfg.quantization is not None:
                continue  # a calibrated activation scale of a dynamic scheme: activations are scaled per call
            if target_name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {self.cfg.architecture}")
            p = params[target_name]
            owner, _, _ = target_name.rpartition(".")
            with torch.no_grad():
                weight_loader_of(self.get_submodule(owner))(p, w, shard)
            loaded.add(f"{target_name}#{shard}")
        expected = set()
        for n in params:
            leaf = n.split(".")[-2] if n.count(".") else ""
            shard_ids = getattr(self.get_submodule(n.rpartition(".")[0]), "shard_ids", None)
            if shard_ids is not None:  # a parameter loaded in parts of its own kind (MoE experts)
                expected |= {f"{n}#{i}" for i in shard_ids(n)}
            elif leaf in ("qkv_proj",):
                expected |= {f"{n}#{i}" for i in "qkv"}
            elif leaf == "gate_up_proj":
                expected |= {f"{n}#{i}" for i in range(2)}
            else:
                expected.add(f"{n}#None")
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
