"""LoRA's two halves for a batch in which every token may run another adapter (punica's BGMV:
one gathered matrix-vector product per token, the adapter picked by the token's slot).

  shrink: u[t] = x[t] @ A[slot[t]]        x [T, K], A [S, K, R] -> u [T, R] fp32
  expand: y[t] += u[t] @ B[slot[t]]       u [T, R], B [S, R, N], y [T, N] in place

Slot -1 is the base model: shrink writes zeros, expand leaves the row alone. The slots are read
on the device, the grids depend on shapes only: a decode step with adapters is captured by the
CUDA graphs like any other. A prefill's tokens of one adapter each re-read its A and B (SGMV
would share them across a segment); at LoRA's ranks those reads are small beside the base GEMM.
References: reference.lora_shrink_ref / lora_expand_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, u_ptr, K, R, stride_xt, stride_as, stride_ak, stride_ut,
                        BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    # Grid (T, cdiv(R, BLOCK_R)).
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # Slot -1 reads and adds nothing: its K is taken as 0 (a scalar bool in a mask is not portable).
    k_live = tl.where(slot >= 0, K, 0)
    a_base = a_ptr + tl.maximum(slot, 0) * stride_as
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * stride_xt + k, mask=k < k_live, other=0.0).to(tl.float32)
        av = tl.load(a_base + k[:, None] * stride_ak + r[None, :],
                     mask=(k[:, None] < k_live) & (r[None, :] < R), other=0.0).to(tl.float32)
        acc += tl.sum(xv[:, None] * av, axis=0)
    tl.store(u_ptr + t * stride_ut + r, acc, mask=r < R)


@triton.jit
def _lora_expand_kernel(y_ptr, u_ptr, b_ptr, slots_ptr, N, R, stride_yt, stride_ut, stride_bs, stride_br,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # Grid (T, cdiv(N, BLOCK_N)).
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    r_live = tl.where(slot >= 0, R, 0)  # slot -1: nothing summed, nothing stored
    b_base = b_ptr + tl.maximum(slot, 0) * stride_bs
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        uv = tl.load(u_ptr + t * stride_ut + r, mask=r < r_live, other=0.0)
        bv = tl.load(b_base + r[:, None] * stride_br + n[None, :],
                     mask=(r[:, None] < r_live) & (n[None, :] < N), other=0.0).to(tl.float32)
        acc += tl.sum(uv[:, None] * bv, axis=0)
    out = y_ptr + t * stride_yt + n
    keep = n < tl.where(slot >= 0, N, 0)
    y = tl.load(out, mask=keep, other=0.0).to(tl.float32)
    tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=keep)


def _check(fn: str, rows: torch.Tensor, stack: torch.Tensor, slots: torch.Tensor, inner: int) -> None:
    check_tensor(fn, "stack", stack, (None, None, None), FLOAT_DTYPES)
    check_tensor(fn, "slots", slots, (rows.shape[0],), (torch.int32, torch.int64))
    check_devices(fn, rows=rows, stack=stack, slots=slots)
    if rows.shape[1] != inner:
        raise ValueError(f"{fn}: the rows have {rows.shape[1]} columns, the stack's inner size is {inner}")
    if rows.stride(-1) != 1 or not stack.is_contiguous():
        raise ValueError(f"{fn}: rows must be contiguous in their last dimension and the stack contiguous")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton version of reference.lora_shrink_ref."""
    check_tensor("lora_shrink", "x", x, (None, None), FLOAT_DTYPES)
    _check("lora_shrink", x, a, slots, a.shape[1])
    t, (_, k, r) = x.shape[0], a.shape
    u = torch.empty((t, r), dtype=torch.float32, device=x.device)
    if t == 0 or r == 0:
        return u
    block_r = triton.next_power_of_2(min(r, 64))
    block_k = min(triton.next_power_of_2(k), 128)
    _lora_shrink_kernel[(t, triton.cdiv(r, block_r))](x, a, slots, u, k, r, x.stride(0), a.stride(0), a.stride(1),
                                                      u.stride(0), BLOCK_K=block_k, BLOCK_R=block_r)
    return u


def lora_expand(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton version of reference.lora_expand_ref (in place on y; returns y)."""
    check_tensor("lora_expand", "y", y, (None, None), FLOAT_DTYPES)
    check_tensor("lora_expand", "u", u, (y.shape[0], b.shape[1]), (torch.float32,))
    _check("lora_expand", u, b, slots, b.shape[1])
    if y.shape[1] != b.shape[2] or y.stride(-1) != 1:
        raise ValueError(f"lora_expand: y must be [T, {b.shape[2]}] and contiguous in its last dimension")
    t, (_, r, n) = y.shape[0], b.shape
    if t == 0 or n == 0:
        return y
    block_n = min(triton.next_power_of_2(n), 128)
    block_r = triton.next_power_of_2(min(r, 64))
    _lora_expand_kernel[(t, triton.cdiv(n, block_n))](y, u, b, slots, n, r, y.stride(0), u.stride(0), b.stride(0),
                                                      b.stride(1), BLOCK_N=block_n, BLOCK_R=block_r)
    return y
