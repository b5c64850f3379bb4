"""Rotary position embedding (NeoX / Llama "rotate half" style)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_tensor
from pdserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _rotate(x_ptr, o_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, cos, sin,
            HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    # [H_PAD, HALF_PAD] tile of first halves and one of second halves; cos/sin broadcast over heads.
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < HEADS) & (i < HALF)
    src = x_ptr + t * stride_xt + h * stride_xh + i
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = o_ptr + t * stride_ot + h * stride_oh + i
    tl.store(dst, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])  # a row of a static buffer, or not
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cs_ptr, qo_ptr, ko_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program per token: cos/sin are loaded once and applied to all q and k heads (fp32 math).
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin, HQ, HQ_PAD, HALF, HALF_PAD)
    _rotate(k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin, HKV, HKV_PAD, HALF, HALF_PAD)


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of reference.rotary_ref; returns new tensors. Positions must be < cos_sin_cache rows."""
    fn = "rotary"
    check_tensor(fn, "q", q, (None, None, None), FLOAT_DTYPES)
    t, hq, d = q.shape
    if d % 2:
        raise ValueError(f"{fn}: head_dim must be even, got {d}")
    check_tensor(fn, "k", k, (t, None, d), (q.dtype,))
    check_tensor(fn, "positions", positions, (t,), INDEX_DTYPES)
    check_tensor(fn, "cos_sin_cache", cos_sin_cache, (None, d), FLOAT_DTYPES)
    check_devices(fn, positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)
    for name, v in (("q", q), ("k", k), ("cos_sin_cache", cos_sin_cache)):
        if v.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, got strides {v.stride()}")
    hkv = k.shape[1]
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), torch.empty_like(
        k, memory_format=torch.contiguous_format
    )
    if t == 0:
        return q_out, k_out
    _rotary_kernel[(t,)](
        positions.contiguous(), q, k, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        HQ=hq, HKV=hkv, HQ_PAD=triton.next_power_of_2(hq), HKV_PAD=triton.next_power_of_2(hkv),
        HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2),
        **pdl_args(q.device),
    )
    return q_out, k_out
