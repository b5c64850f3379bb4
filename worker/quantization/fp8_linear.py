"""FP8 linear method: the weights, scales and GEMM of one parallel linear layer (parallel/layers.py).

A layer built with `quant=Fp8LinearMethod(cfg)` holds, while loading:
- `weight`: e4m3 [out, in] of this rank (the compute dtype for --quantization fp8, quantized
  after loading);
- the weight scales, fp32, under the checkpoint's name (`weight_scale` or `weight_scale_inv`),
  always stored per output row: [out] (per-channel; a per-tensor scale is written into every row
  of its tensor, so fused q/k/v or gate/up keep each part's own scale exactly, no requantizing
  to a common maximum) or [out, ceil(in / 128)] (block; each row gets its 128-row block's
  scales). Row-wise storage makes tensor-parallel sharding and fused parts independent of the
  128-row block grid: a rank's or a part's rows just copy their blocks' rows;
- `input_scale` [parts] fp32 for a static activation scheme (the GEMM uses their max: all parts
  read the same activations).

After loading (`process_weights_after_loading`):
- on CUDA (sm90+): the weight stays e4m3. Decode-sized calls (M <= 16 rows) run
  kernels/fp8_gemv.py: the FP8 weight times the activations as they are (W8A16; half bf16's
  bytes, no quantize launch). Larger calls quantize the activations (kernels/fp8_quant.py) and
  run `torch._scaled_mm` with row-wise scales (per-channel) or, for 128x128 blocks (row scales
  compressed back to one per 128-row block when every block's rows agree), cuBLASLt's block
  scaling through torch's scaled_mm (kernels/fp8_scaled_mm.py) from SCALED_MM_BLOCK_MIN_M rows
  where a one-time probe at load says it runs and is right on this device, else the Triton
  block-scaled GEMM (kernels/fp8_block_gemm.py). `fp8_gemm_path` is the whole choice.
  The W8A8 paths take their input already quantized where the op before the linear can write
  it (fp8_activations.py: the RMSNorm before qkv/gate_up, the SiLU·mul before down, when
  `fp8_input_format` says so; PDSERVE_FP8_FUSED_QUANT=0 turns that off), else quantize it here.
  All are CUDA-graph capturable: no host sync, only the outputs allocated;
- on CPU (and GPUs without FP8 tensor cores): the weight is dequantized once to the compute
  dtype and the layer becomes a plain linear, so CI runs the same model code on the same FP8
  weight values (activations stay unquantized there).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from pdserve.kernels.reference import dequantize_fp8_ref, quantize_fp8_rows_ref
from pdserve.worker.config.quantization import Fp8Config
from pdserve.worker.quantization.fp8_activations import Fp8ActFormat, Fp8Activations

# Batches up to FP8_GEMV_MAX_M rows take kernels/fp8_gemv.py (W8A16) on the GPU. Up to its MAX_M (64)
# a layer takes it too where the card's table holds a 64-row tile for its shape
# (fp8_gemv.measured_batch_rows): bench/fp8_gemv_tune.py keeps one only where the GEMV took at most
# 0.9x the W8A8 GEMM's time at 64 rows (none now: the W8A8 GEMMs' K split won them back). The rest W8A8.
# FP8_GEMV_MEASURED_ROWS False: FP8_GEMV_MAX_M alone (the bench's same-run baseline). Both are read
# on every call (captured graphs keep the choice of their capture).
FP8_GEMV_MAX_M = 16
FP8_GEMV_MEASURED_ROWS = True
# Per-channel layers take the Triton GEMM (kernels/fp8_block_gemm.fp8_rowwise_gemm: K split where
# the tiles do not cover the SMs) instead of torch._scaled_mm below this many rows (0: never); the
# bench compares both in one run (bench/fp8.py --rowwise-triton).
TRITON_ROWWISE_MAX_M = 0
# Steps of up to this many rows on the GEMV path run the RMSNorm before qkv / gate_up and the SiLU·mul
# before down inside the FP8 GEMV (kernels/fp8_gemv.fp8_prologue_gemv: no launch of their own, as the
# bf16 GEMV does); 0: apart. One row only: the fused norm reads the row's whole x in every program,
# M times more at M rows. bench/fp8.py --fp8-prologue compares both in one run; off until a GPU has.
FP8_GEMV_PROLOGUE_MAX_M = 0
# Block-scaled layers take cuBLASLt's block scaling (torch scaled_mm) from this many rows, the
# Triton block GEMM below: vLLM's H20 table (vllm#49932) has torch's block path 2x slower than a
# Triton GEMM at M = 16-64 and ahead from M = 1024. bench/fp8.py --only blockwise prints the
# crossover on the card.
SCALED_MM_BLOCK_MIN_M = 128
# False keeps every block-scaled layer on the Triton GEMM (the bench compares both in one run).
SCALED_MM_BLOCK = True
# The ops feeding FP8 linears (RMSNorm, SiLU·mul) quantize for their W8A8 GEMMs, so the linears
# run no quantization pass (fp8_activations.py). PDSERVE_FP8_FUSED_QUANT=0: off, each linear
# quantizes its own input as before (same numbers either way). Read on every forward (the bench
# flips it between engines of one process); captured decode graphs keep the choice of their capture.
FUSED_ACT_QUANT = os.environ.get("PDSERVE_FP8_FUSED_QUANT", "1") != "0"


def fp8_gemm_path(m: int, block: bool, scaled_mm_block: bool, measured_rows: int = 0) -> str:
    """Which GEMM an FP8 layer runs for M rows on the GPU: "gemv" (decode sizes, activations
    unquantized), "rowwise" (per-tensor/per-channel: _scaled_mm), "triton_rowwise" (the same
    scales on the Triton GEMM, below TRITON_ROWWISE_MAX_M rows), "scaled_mm_block" (block
    scales on cuBLASLt; `scaled_mm_block`: the layer is eligible and the probe passed) or
    "triton_block". `measured_rows`: the most rows the card's table says the GEMV wins at for
    the layer's shape (0: none past FP8_GEMV_MAX_M)."""
    if m <= max(FP8_GEMV_MAX_M, measured_rows if FP8_GEMV_MEASURED_ROWS else 0):
        return "gemv"
    if not block:
        return "triton_rowwise" if m < TRITON_ROWWISE_MAX_M else "rowwise"
    if scaled_mm_block and m >= SCALED_MM_BLOCK_MIN_M:
        return "scaled_mm_block"
    return "triton_block"


def activation_format(path: str, block_k: int | None) -> Fp8ActFormat | None:
    """The quantized activations a GEMM path reads (None: "gemv" reads them unquantized):
    per token for _scaled_mm; per token and block_k columns for the block GEMMs, the scales
    token-major with rows padded to PAD_M for cuBLASLt (kernels/fp8_scaled_mm.py)."""
    if path == "gemv":
        return None
    if path in ("rowwise", "triton_rowwise"):
        return Fp8ActFormat(None, False, 1)
    if path == "triton_block":
        return Fp8ActFormat(block_k, False, 1)
    from pdserve.kernels import fp8_scaled_mm  # torch only; PAD_M is settled by the load-time probe

    return Fp8ActFormat(block_k, True, fp8_scaled_mm.PAD_M)


def fp8_input_format(linear: nn.Module, m: int) -> Fp8ActFormat | None:
    """What the op before `linear` should hand it for m rows: activations quantized in this
    format (the linear then runs no quantization pass), or None: the activations as they are
    (an unquantized or dequantized linear, a decode-sized batch, a static scale, the switch off)."""
    quant = getattr(linear, "quant", None)
    return None if quant is None else quant.input_format(linear, m)

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
_warned: set[str] = set()


def warn_once(key: str, msg: str, *args, level: int = logging.WARNING) -> None:
    """One line per cause and process, not one per layer."""
    if key not in _warned:
        _warned.add(key)
        log.log(level, msg, *args)


def _param(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def cuda_fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores with row-wise scaled GEMMs: Hopper (sm90) and later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


class Fp8LinearMethod:
    def __init__(self, cfg: Fp8Config):
        self.cfg = cfg

    # -- building ------------------------------------------------------------------------------
    def create_weights(self, layer: nn.Module, num_parts: int) -> None:
        """Replace the layer's weight by the FP8 one and add the scales (on the meta device at
        build time). `param_dtypes` survives load_model's cast to the compute dtype."""
        out, inp = layer.weight.shape
        cfg, layer.param_dtypes = self.cfg, {}
        if cfg.source != "online":
            layer.weight = _param((out, inp), FP8)
            layer.param_dtypes["weight"] = FP8
            shape = (out, -(-inp // cfg.block[1])) if cfg.block else (out,)
            setattr(layer, cfg.scale_name, _param(shape, torch.float32))
            layer.param_dtypes[cfg.scale_name] = torch.float32
            if cfg.activation == "static":
                layer.input_scale = _param((num_parts,), torch.float32)
                layer.param_dtypes["input_scale"] = torch.float32

    # -- loading -------------------------------------------------------------------------------
    def load_scale(self, layer: nn.Module, name: str, param: nn.Parameter, loaded: torch.Tensor,
                   rows: tuple[int, int, int], cols: tuple[int, int] | None, part: int) -> None:
        """Copy this rank's part of a checkpoint scale. rows = (first row in the layer, first
        row in the checkpoint tensor, count); cols = (first checkpoint column, count) for a
        row-parallel layer's input split, None for all columns."""
        t = (loaded if isinstance(loaded, torch.Tensor) else loaded[:]).to(torch.float32)
        if name == "input_scale":
            param.data[part].copy_(t.reshape(()))
            return
        dst, src, n = rows
        if self.cfg.block:
            bn, bk = self.cfg.block
            first = src // bn
            blocks = t[first:(src + n - 1) // bn + 1]
            expanded = blocks.repeat_interleave(bn, dim=0)[src - first * bn:src - first * bn + n]
            if cols is not None:
                expanded = expanded[:, cols[0] // bk:cols[0] // bk + param.shape[1]]
            param.data[dst:dst + n].copy_(expanded)
        elif t.numel() == 1:  # per-tensor: every row of this part
            param.data[dst:dst + n].fill_(t.reshape(()).item())
        else:  # per-channel [out, 1] or [out]
            param.data[dst:dst + n].copy_(t.reshape(-1)[src:src + n])

    def process_weights_after_loading(self, layer: nn.Module, compute_dtype: torch.dtype,
                                      kernels: bool | None = None) -> None:
        """`kernels`: keep the weight FP8 and run the FP8 GEMMs (None: where the device has FP8
        tensor cores; True in the CPU tests of this path, under Triton's interpreter)."""
        cfg = self.cfg
        if cfg.source == "online":
            w8, scale = quantize_fp8_rows_ref(layer.weight.data)
        else:
            w8, scale = layer.weight.data, getattr(layer, cfg.scale_name).data
            delattr(layer, cfg.scale_name)
        static = None
        if cfg.activation == "static":
            static = layer.input_scale.data.max().reshape(1)
            del layer.input_scale
        if kernels is None:
            kernels = cuda_fp8_supported(w8.device)
            if kernels and cfg.block is None and (w8.shape[0] % 16 or w8.shape[1] % 16):
                warn_once("align", "an FP8 weight of shape %s: _scaled_mm needs both sizes multiples of 16; "
                                   "such weights are dequantized to %s", list(w8.shape), compute_dtype)
                kernels = False
        if not kernels:
            # The dequantizing path: the same FP8 weight values, a plain GEMM in the compute dtype.
            if w8.device.type == "cuda" and not cuda_fp8_supported(w8.device):
                warn_once("sm90", "no FP8 tensor cores (sm90+) on %s: FP8 weights are dequantized to %s at load",
                          w8.device, compute_dtype)
            layer.weight = nn.Parameter(dequantize_fp8_ref(w8, scale, cfg.block).to(compute_dtype),
                                        requires_grad=False)
            layer.quant = None
            return
        layer.weight = nn.Parameter(w8, requires_grad=False)
        layer.input_scale_static = static
        if cfg.block:
            bn = cfg.block[0]
            compact = scale[::bn].contiguous()
            if torch.equal(compact.repeat_interleave(bn, dim=0)[:scale.shape[0]], scale):
                scale, layer.scale_rows = compact, bn  # one scale row per 128-row block, as published
            else:
                layer.scale_rows = 1  # blocks straddle fused parts (small models): keep one per row
            layer.w_scale = scale.contiguous()
            layer.scaled_mm_block = self._scaled_mm_block_ok(layer, compute_dtype)
        else:
            layer.w_scale = scale.reshape(1, -1).contiguous()  # [1, out]: _scaled_mm's row-wise scale_b
        if w8.device.type == "cuda":
            from pdserve.kernels.fp8_gemv import measured_batch_rows

            layer.gemv_measured_rows = measured_batch_rows(w8.device, *w8.shape, cfg.block is not None)

    def _scaled_mm_block_ok(self, layer: nn.Module, compute_dtype: torch.dtype) -> bool:
        """Whether this block-scaled layer may take cuBLASLt's block scaling: 128x128 blocks, a
        shape it takes (fp8_scaled_mm.weight_ineligible), and the device's probe passed (once per
        process; a failure is logged once and the layer keeps the Triton GEMM)."""
        from pdserve.kernels.fp8_scaled_mm import probe_blockwise, weight_ineligible, weight_scale_operand

        w8 = layer.weight
        if not SCALED_MM_BLOCK or w8.device.type != "cuda" or tuple(self.cfg.block) != (128, 128):
            return False
        why = weight_ineligible(w8.shape[0], w8.shape[1], layer.scale_rows)
        if why is not None:
            warn_once("sm-shape-" + why, "FP8 block weight %s runs the Triton block GEMM: %s", list(w8.shape), why)
            return False
        weight_scale_operand(layer.w_scale)  # the layout the call reads: a view, checked once here
        ok, detail = probe_blockwise(w8.device, compute_dtype)
        if not ok:
            warn_once("sm-probe", "torch scaled_mm block scaling (cuBLASLt) unavailable on %s for %s output (%s): "
                                  "FP8 block weights run the Triton block GEMM", w8.device, compute_dtype, detail)
        else:
            warn_once("sm-probe-ok", "FP8 block weights: cuBLASLt block scaling from %d rows (probe: %s)",
                      SCALED_MM_BLOCK_MIN_M, detail, level=logging.INFO)
        return ok

    # -- running (CUDA) ------------------------------------------------------------------------
    def _path(self, layer: nn.Module, m: int) -> str:
        return fp8_gemm_path(m, self.cfg.block is not None, getattr(layer, "scaled_mm_block", False),
                             getattr(layer, "gemv_measured_rows", 0))

    def input_format(self, layer: nn.Module, m: int) -> Fp8ActFormat | None:
        """fp8_input_format for this layer (after loading, on the kernel path). A static
        activation scale keeps its own quantization here (the fused ops compute dynamic scales)."""
        if not FUSED_ACT_QUANT or getattr(layer, "input_scale_static", None) is not None:
            return None
        return activation_format(self._path(layer, m), self.cfg.block[1] if self.cfg.block else None)

    def prologue_gemv(self, layer: nn.Module, m: int):
        """The FP8 GEMV with the op before it fused in, for this layer at m rows, called as
        kernels/fused_gemv.fused_gemv is (x, prologue, bias=, norm_weight=, eps=, residual=) ->
        (out, new residual or None); None where such a step takes another path."""
        if m > FP8_GEMV_PROLOGUE_MAX_M or self._path(layer, m) != "gemv":
            return None
        from pdserve.kernels.fp8_gemv import fp8_prologue_gemv

        scale_rows = layer.scale_rows if self.cfg.block else None

        def run(x, prologue, bias=None, norm_weight=None, eps=1e-6, residual=None):
            out, new_res = fp8_prologue_gemv(x, layer.weight, layer.w_scale, scale_rows, prologue,
                                             norm_weight=norm_weight, eps=eps, residual=residual)
            return (out if bias is None else out + bias), new_res

        return run

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Activations, bias: torch.Tensor | None) -> torch.Tensor:
        """x: the activations [..., K], or Fp8Activations [M, K] quantized by the op before this
        layer in the format `input_format` gave for M rows."""
        from pdserve.kernels.fp8_quant import quantize_fp8

        if isinstance(x, Fp8Activations):
            pre, lead, dtype, m = x, (x.rows,), x.dtype, x.rows
        else:
            pre, lead, dtype = None, x.shape[:-1], x.dtype
            x2 = x.reshape(-1, x.shape[-1])
            m = x2.shape[0]
        path = self._path(layer, m)
        fmt = activation_format(path, self.cfg.block[1] if self.cfg.block else None)
        if pre is not None and pre.fmt != fmt:
            raise ValueError(f"FP8 linear: activations quantized as {pre.fmt}, its {path} GEMM at M={m} reads {fmt}")
        if path == "gemv":
            # Decode-sized batches: the FP8 weight times unquantized activations (fp8_gemv.py: W8A8
            # measured slower than bf16 here; this reads half bf16's bytes, and no quantize launch).
            from pdserve.kernels.fp8_gemv import fp8_gemv

            out = fp8_gemv(x2.contiguous(), layer.weight, layer.w_scale,
                           layer.scale_rows if self.cfg.block else None)
        else:
            if pre is not None:  # quantized by the op before (kernels/rms_norm_fp8.py, silu_and_mul_fp8.py)
                xq, xs = pre.q, pre.scale
            else:
                static = layer.input_scale_static if path in ("rowwise", "triton_rowwise") else None
                xq, xs = quantize_fp8(x2, static_scale=static, **fmt.kwargs())
            if path == "scaled_mm_block":
                from pdserve.kernels.fp8_scaled_mm import block_linear_quantized

                out = block_linear_quantized(xq, xs, m, layer.weight, layer.w_scale, dtype)
            elif path == "triton_block":
                from pdserve.kernels.fp8_block_gemm import fp8_block_gemm

                out = fp8_block_gemm(xq, xs, layer.weight, layer.w_scale, layer.scale_rows, dtype)
            elif path == "triton_rowwise":
                from pdserve.kernels.fp8_block_gemm import fp8_rowwise_gemm

                out = fp8_rowwise_gemm(xq, xs, layer.weight, layer.w_scale, dtype)
            else:
                # Row-wise scaling (scale_a [M, 1], scale_b [1, N]) writes bfloat16 only.
                out = torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.w_scale,
                                       out_dtype=torch.bfloat16)
                if out.dtype != dtype:
                    out = out.to(dtype)
        if bias is not None:
            out = out + bias
        return out.view(*lead, out.shape[-1])


def linear_method(cfg: Fp8Config | None, prefix: str, parts: list[str]) -> Fp8LinearMethod | None:
    """The method of the linear fusing checkpoint modules prefix.part (None: unquantized)."""
    if cfg is None or not cfg.quantizes(prefix, parts):
        return None
    return Fp8LinearMethod(cfg)


def keep_quantized_dtypes(net: nn.Module) -> nn.Module:
    """After `net.to(dtype)` (on the meta device): give FP8 weights and fp32 scales their dtypes back."""
    for m in net.modules():
        for name, dtype in getattr(m, "param_dtypes", {}).items():
            p = getattr(m, name)
            if p.dtype != dtype:
                setattr(m, name, nn.Parameter(torch.empty(p.shape, dtype=dtype, device=p.device), requires_grad=False))
    return net


def process_quantized(net: nn.Module, compute_dtype: torch.dtype) -> None:
    """After the checkpoint is loaded: each FP8 layer's post-processing (see the module doc)."""
    for m in net.modules():
        if getattr(m, "quant", None) is not None:
            m.quant.process_weights_after_loading(m, compute_dtype)
        if hasattr(m, "finish_loading"):  # MoE experts: every FP8 matrix met its scale (models/moe.py)
            m.finish_loading(compute_dtype)
