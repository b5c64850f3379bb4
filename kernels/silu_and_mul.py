"""SwiGLU activation: silu(gate) * up over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor
from pdserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (T, cdiv(I, BLOCK)): gate is x[t, :I], up is x[t, I:].
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_ot + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def check_silu_and_mul_input(fn: str, x: torch.Tensor) -> tuple[int, int]:
    """Checks the fused [gate | up] input for launcher `fn` (named in the errors); returns
    (tokens, intermediate size).

    silu_and_mul and silu_and_mul_fp8 (the same activation, its output quantized) read the same
    x: one set of checks, so that both reject the same inputs.
    """
    check_tensor(fn, "x", x, (None, None), FLOAT_DTYPES)
    t, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"{fn}: x's last dimension must be even ([gate | up]), got {two_i}")
    check_devices(fn, x=x)
    if x.stride(-1) != 1:
        raise ValueError(f"{fn}: x must be contiguous in its last dimension, got strides {x.stride()}")
    return t, two_i // 2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of reference.silu_and_mul_ref (computed in fp32, rounded once)."""
    t, inter = check_silu_and_mul_input("silu_and_mul", x)
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
                          **pdl_args(x.device))
    return out
