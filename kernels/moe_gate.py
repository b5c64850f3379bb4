"""An MoE router's linear layer and its top-k routing in one launch, for decode-sized steps.

At decode batch sizes the router costs launches, not bytes: gpt-oss-120b's (128 x 2880, with bias)
ran as a cuBLAS split-K GEMV, its reduce and the routing kernel (4.4 + 1.9 + 1.7 us a layer on an
H200, for 0.74 MB of weights). Here one-warp programs (token t, a strip of BLOCK_E experts, one
BLOCK_K slice of K: a single load each, so no program waits on a chain of loads) write fp32 partial
logits; the last program of a token to arrive (an acq_rel counter, as the split decode attention's
merge) sums the slices in a fixed order, adds the bias, rounds the logits to
the activations' dtype (what F.linear returns) and routes them with moe_route's arithmetic
(_route_one: softmax over E, k arg-max rounds, lowest id on ties, renormalised or not). The
counters are int32 zeros lent by the caller (>= T) and left zero, so a CUDA graph replays the
launch as it is (models/moe.py's DecodeGate lends the device's kernels/arrivals.py counters).

With `norm` the layer's add + RMSNorm before the router runs here too: every program sums the
row's squares itself (H values, from L2) and normalises its own slice, and the first expert
strip's programs store the normed row and the new residual for the experts: one launch a layer
fewer at bs=1; off in the models (models/moe.py's GATE_NORM): a tie on an H200, where the launches it
saves overlap the kernel before them under PDL (docs/results/moe/2026-12-06-h200-moe-launches.md).

Reference: reference.moe_route_ref(F.linear(x, weight, bias).to(x.dtype), top_k, renormalize) —
the same top-k for logits that are not within an fp32 rounding of a tie; with `norm`,
reference.rms_norm_ref first.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pdserve.kernels.arrivals import last_arrival, reset_arrivals
from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor
from pdserve.kernels.moe_route import _route_one
from pdserve.kernels.pdl import pdl_args, pdl_enter
from pdserve.kernels.rms_norm import check_rms_norm_args


class GateNorm(NamedTuple):
    """The RMSNorm (and the residual add before it) that moe_gate does on its input first."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None


MAX_TOKENS = 16  # beyond this a step's router is a GEMM: F.linear, then moe_route
# A program's 4 KB of bf16 weights (gpt-oss: 8 x 23 programs a token). One warp: the routing's
# reductions are then register shuffles (moe_route.ONE_WARP_MAX_EXPERTS).
BLOCK_E, BLOCK_K = 16, 128
NORM_MAX_HIDDEN = 4096  # `norm`: the row in one load, <= 128 fp32 values a thread (gpt-oss: 2880)
_ROUND = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _moe_gate_kernel(x_ptr, w_ptr, b_ptr, part_ptr, weights_ptr, ids_ptr, counter_ptr, K, E, stride_xt, stride_we,
                     res_ptr, g_ptr, h_ptr, new_res_ptr, eps, stride_rt, stride_ht, stride_nt,
                     TOP_K: tl.constexpr, K_TILE: tl.constexpr, E_TILE: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                     RENORMALIZE: tl.constexpr, ROUND: tl.constexpr, NORM: tl.constexpr = False,
                     HAS_RESIDUAL: tl.constexpr = False, BLOCK_H: tl.constexpr = 1, PDL: tl.constexpr = False):
    # Grid (T, cdiv(E, BLOCK_E), SPLIT = cdiv(K, BLOCK_K)). part_ptr: [T, SPLIT, E] fp32 partial logits.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pe = tl.program_id(1)
    s = tl.program_id(2)
    rows = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < E
    ks = s * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    if NORM:
        # The layer's add + RMSNorm before the router, as kernels/rms_norm.py computes it (the sum
        # rounded to x's dtype, the normed value rounded before the weight): each program sums the
        # whole row's squares itself (K values, from L2), then normalises its own slice; the first
        # expert strip's programs store the slice of the normed row and of the new residual.
        # The whole row in one load (BLOCK_H = K rounded up to a power of two): a loop of BLOCK_K
        # loads is a chain of L2 latencies for this one warp (+4 us a call on an H100).
        row = _norm_input(x_ptr, res_ptr, t, stride_xt, stride_rt, tl.arange(0, BLOCK_H), K, HAS_RESIDUAL, ROUND)
        rstd = 1.0 / tl.sqrt(tl.sum(row * row, axis=0) / K + eps)
        v = _norm_input(x_ptr, res_ptr, t, stride_xt, stride_rt, ks, K, HAS_RESIDUAL, ROUND)
        g = tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        xk = _rounded(_rounded(v * rstd, ROUND) * g, ROUND)
        if pe == 0:
            tl.store(h_ptr + t * stride_ht + ks, xk.to(h_ptr.dtype.element_ty), mask=k_ok)
            if HAS_RESIDUAL:
                tl.store(new_res_ptr + t * stride_nt + ks, v.to(new_res_ptr.dtype.element_ty), mask=k_ok)
    else:
        xk = tl.load(x_ptr + t * stride_xt + ks, mask=k_ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_we + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    acc = w * xk[None, :]
    tl.store(part_ptr + (t * SPLIT + s) * E + rows, tl.sum(acc, axis=1), mask=row_ok)
    # The token's last arrival sees its SPLIT x E partials (kernels/arrivals.py).
    if last_arrival(counter_ptr, t, tl.num_programs(1) * SPLIT):
        e = tl.arange(0, E_TILE)
        e_ok = e < E
        logits = tl.zeros([E_TILE], dtype=tl.float32)
        for j in tl.static_range(SPLIT):  # slices in order: the same sum whatever order they finished in
            logits += tl.load(part_ptr + (t * SPLIT + j) * E + e, mask=e_ok, other=0.0)
        if HAS_BIAS:
            logits += tl.load(b_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
        logits = tl.where(e_ok, _rounded(logits, ROUND), float("-inf"))
        best_w, best_id = _route_one(logits, E, TOP_K, K_TILE, E_TILE, RENORMALIZE)
        slot = tl.arange(0, K_TILE)
        tl.store(weights_ptr + t * TOP_K + slot, best_w, mask=slot < TOP_K)
        tl.store(ids_ptr + t * TOP_K + slot, best_id, mask=slot < TOP_K)
        reset_arrivals(counter_ptr, t)


@triton.jit
def _norm_input(x_ptr, res_ptr, t, stride_xt, stride_rt, ks, K, HAS_RESIDUAL: tl.constexpr, ROUND: tl.constexpr):
    # x (+ residual, the sum rounded to x's dtype) at columns ks, as fp32; zero past K.
    ok = ks < K
    v = tl.load(x_ptr + t * stride_xt + ks, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        v = _rounded(v + tl.load(res_ptr + t * stride_rt + ks, mask=ok, other=0.0).to(tl.float32), ROUND)
    return v


@triton.jit
def _rounded(v, ROUND: tl.constexpr):
    # fp32 -> the nearest value of ROUND's (ties to even), as fp32: what F.linear's output holds.
    # bf16 by its bits, since the interpreter's casts to bf16 truncate where a GPU's round.
    if ROUND == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif ROUND == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
             counters: torch.Tensor, norm: GateNorm | None = None) -> tuple[torch.Tensor, ...]:
    """x [T, H] (T <= MAX_TOKENS), the router's weight [E, H] and bias [E] (or None) -> (weights
    [T, k] fp32, ids [T, k] int64), as moe_route(F.linear(x, weight, bias), top_k, renormalize).
    `counters`: int32 zeros, >= T elements, on x's device (left zero).
    `norm`: the RMSNorm (with the residual add) that comes before the router, done here: x is its
    input and the router reads rms_norm(x, norm.weight, norm.eps, norm.residual); returns
    (weights, ids, normed [T, H], x + residual or None) then, as the router and rms_norm would."""
    check_tensor("moe_gate", "x", x, (None, None), FLOAT_DTYPES)
    t, h = x.shape
    check_tensor("moe_gate", "weight", weight, (None, h), FLOAT_DTYPES)
    e = weight.shape[0]
    if bias is not None:
        check_tensor("moe_gate", "bias", bias, (e,), FLOAT_DTYPES)
    check_tensor("moe_gate", "counters", counters, (None,), (torch.int32,))
    check_devices("moe_gate", x=x, weight=weight, counters=counters, **({} if bias is None else {"bias": bias}))
    if not 1 <= top_k <= e:
        raise ValueError(f"moe_gate: top_k must be in [1, {e}], got {top_k}")
    if t > MAX_TOKENS or counters.numel() < t:
        raise ValueError(f"moe_gate: {t} tokens need t <= {MAX_TOKENS} and >= t counters (got {counters.numel()})")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("moe_gate: x and weight need contiguous rows")
    normed = new_res = None
    if norm is not None:
        check_rms_norm_args("moe_gate", x, norm.weight, norm.eps, norm.residual)
        if h > NORM_MAX_HIDDEN:
            raise ValueError(f"moe_gate: the norm holds a row in one warp's registers: hidden <= {NORM_MAX_HIDDEN}, "
                             f"got {h}")
        if norm.weight.dtype != x.dtype:
            raise ValueError(f"moe_gate: the norm's weight must be of x's dtype {x.dtype}, got {norm.weight.dtype}")
        normed = torch.empty_like(x)
        new_res = torch.empty_like(x) if norm.residual is not None else None
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=x.device)
    if t:
        split = triton.cdiv(h, BLOCK_K)
        part = torch.empty((t, split, e), dtype=torch.float32, device=x.device)
        res = norm.residual if norm is not None and norm.residual is not None else x
        _moe_gate_kernel[(t, triton.cdiv(e, BLOCK_E), split)](
            x, weight, weight if bias is None else bias, part, weights, ids, counters, h, e, x.stride(0),
            weight.stride(0), res, x if norm is None else norm.weight, x if normed is None else normed,
            x if new_res is None else new_res, 0.0 if norm is None else float(norm.eps), res.stride(0),
            0 if normed is None else normed.stride(0), 0 if new_res is None else new_res.stride(0),
            TOP_K=top_k, K_TILE=triton.next_power_of_2(top_k), E_TILE=triton.next_power_of_2(e),
            BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K, SPLIT=split, HAS_BIAS=bias is not None, RENORMALIZE=renormalize,
            ROUND=_ROUND[x.dtype], NORM=norm is not None, HAS_RESIDUAL=new_res is not None,
            BLOCK_H=triton.next_power_of_2(h) if norm is not None else 1, num_warps=1,
            **pdl_args(x.device))
    if norm is None:
        return weights, ids
    return weights, ids, normed, new_res
