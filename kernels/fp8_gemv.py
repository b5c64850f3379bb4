"""FP8 weights times unquantized activations for decode-sized M (<= 16 rows): out = x @ (W8 * S)^T.

Why a second FP8 GEMM: at M = 1..16 a linear layer is a pass over its weight, and the FP8
weight is half the bytes of bf16. But the W8A8 paths (dynamic activation quantization, then
torch._scaled_mm or fp8_block_gemm) measured slower than bf16 there on an H200 (Llama-3.1-8B
shapes, M = 1: qkv 31.8 / 48.7 us against bf16's 23.8; docs/fp8-gpu-results.md): an extra launch
for the quantization, and cuBLASLt's row-wise-scaled FP8 kernels are built for large tiles. Here
the weight is read once, converted to the activation dtype in registers, and multiplied with
the activations as they are (no activation quantization: closer to the fp32 reference than W8A8,
and the same values the CPU's dequantizing path computes).

Grid: one program per BLOCK_N output columns (N / BLOCK_N programs stream disjoint rows of W).
Each walks K in BLOCK_K steps: a [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tensor-core dot with M
padded to 16 (compute is free at these sizes; the loads are what count), times the weight's
scale. Scales: per output channel ([N] or [1, N]: applied once at the end), or 128-column groups
([ceil(N / scale_rows), ceil(K / 128)]: applied per K step, BLOCK_K dividing 128).
CUDA-graph capturable: no host sync, only the output allocated. Reference: reference.fp8_gemv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor, dot_in_f32, dot_precision

FP8 = torch.float8_e4m3fn
MAX_M = 16  # past this the W8A8 GEMMs win (they reuse each weight tile across many rows)
GROUP_K = 128


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
                     BLOCKED: tl.constexpr, SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr,
                     DOT_F32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        x = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        w = w.to(x.dtype)
        if DOT_F32:  # the interpreter's bf16 dot is wrong (launch.dot_in_f32)
            x, w = x.to(tl.float32), w.to(tl.float32)
        part = tl.dot(x, w, input_precision=PRECISION, out_dtype=tl.float32)
        if BLOCKED:
            s = tl.load(s_ptr + (offs_n // SCALE_ROWS) * stride_sn + k0 // GROUP, mask=mask_n, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    if not BLOCKED:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemv_config(n: int, k: int, blocked: bool) -> dict:
    """Tiles by shape. Narrow N tiles give enough programs to stream the weight (an H100/H200 has
    132 SMs: N = 4096 at 32 columns is 128 programs); BLOCK_K 128 keeps a block-scaled step inside
    one scale group."""
    bn = 16 if n <= 4096 else 32 if n <= 16384 else 64
    return dict(BLOCK_N=bn, BLOCK_K=128 if blocked or k < 256 else 256, num_warps=4, num_stages=4)


def fp8_gemv(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, scale_rows: int | None = None,
             config: dict | None = None) -> torch.Tensor:
    """x [M <= 16, K] (fp16/bf16/fp32) times e4m3 w8 [N, K] -> [M, N] in x's dtype.
    w_scale: per output channel ([N] or [1, N]) when scale_rows is None; else 128-column group
    scales [ceil(N / scale_rows), ceil(K / 128)] (the block format, scale_rows 128 or 1)."""
    fn = "fp8_gemv"
    check_tensor(fn, "x", x, (None, None), FLOAT_DTYPES)
    m, k = x.shape
    if m > MAX_M:
        raise ValueError(f"{fn}: at most {MAX_M} rows (decode batches), got {m}")
    check_tensor(fn, "w8", w8, (None, k), (FP8,))
    n = w8.shape[0]
    blocked = scale_rows is not None
    if blocked:
        check_tensor(fn, "w_scale", w_scale, (triton.cdiv(n, scale_rows), triton.cdiv(k, GROUP_K)), (torch.float32,))
    else:
        if w_scale.numel() != n or w_scale.dtype != torch.float32:
            raise ValueError(f"{fn}: w_scale must hold {n} float32 per-channel scales, got {tuple(w_scale.shape)} "
                             f"{w_scale.dtype}")
        w_scale = w_scale.reshape(-1)
    check_devices(fn, x=x, w8=w8, w_scale=w_scale)
    for name, t in (("x", x), ("w8", w8), ("w_scale", w_scale)):
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, got strides {t.stride()}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = dict(config or gemv_config(n, k, blocked))
    if blocked and GROUP_K % cfg["BLOCK_K"]:
        raise ValueError(f"{fn}: BLOCK_K must divide {GROUP_K} for group scales, got {cfg['BLOCK_K']}")
    bn = cfg.pop("BLOCK_N")
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x, w8, w_scale, out, m, n, k, x.stride(0), w8.stride(0), w_scale.stride(0) if blocked else 0, out.stride(0),
        BLOCKED=blocked, SCALE_ROWS=scale_rows or 1, GROUP=GROUP_K, DOT_F32=dot_in_f32(x.dtype),
        PRECISION=dot_precision(x.dtype), BLOCK_M=16, BLOCK_N=bn, **cfg)
    return out
