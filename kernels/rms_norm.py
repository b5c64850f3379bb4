"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor
from pdserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    eps,
    stride_xt, stride_rt, stride_ot, stride_nt,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program per row; the whole row lives in registers, so x is read once.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_rt + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype, as the reference (and HF) do before normalising.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_res_ptr + t * stride_nt + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / HIDDEN + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    normed = (h * rstd).to(x.dtype).to(tl.float32)  # the reference's h.to(x.dtype)
    tl.store(out_ptr + t * stride_ot + cols, (normed * w.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def check_rms_norm_args(
    fn: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
) -> tuple[int, int]:
    """Checks the norm's arguments for launcher `fn` (named in the errors); returns (tokens, hidden).

    rms_norm and rms_norm_fp8 (the same norm, its output quantized) take the same x, weight,
    eps and residual: one set of checks, so that both reject the same inputs.
    """
    check_tensor(fn, "x", x, (None, None), FLOAT_DTYPES)
    t, hidden = x.shape
    check_tensor(fn, "weight", weight, (hidden,), FLOAT_DTYPES)
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        check_tensor(fn, "residual", residual, (t, hidden), (x.dtype,))
        tensors["residual"] = residual
    check_devices(fn, **tensors)
    for name, v in tensors.items():
        if v.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, got strides {v.stride()}")
    if not eps > 0:
        raise ValueError(f"{fn}: eps must be > 0, got {eps}")
    return t, hidden


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of reference.rms_norm_ref; returns new tensors, inputs are not modified."""
    t, hidden = check_rms_norm_args("rms_norm", x, weight, eps, residual)
    out = torch.empty((t, hidden), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_res = torch.empty_like(x) if residual is not None else None
    if t == 0:
        return out, new_res
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(t,)](
        x, residual if residual is not None else x, weight, out, new_res if new_res is not None else out,
        eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        new_res.stride(0) if new_res is not None else 0,
        HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 1024, 1), 16),
        **pdl_args(x.device),
    )
    return out, new_res
