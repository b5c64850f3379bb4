"""MoE top-k routing in one kernel: softmax over E, the k largest, renormalised (optional).

The torch version (reference.moe_route_ref) is four launches per MoE layer (softmax, topk, sum,
divide); at decode batch sizes each costs about what the layer's router GEMV does, so the
Triton path does it in one program per token: one pass of k arg-max rounds, one warp for up to
256 experts. Ties pick the lowest expert id (torch.topk's order
on ties is unspecified; routing ties between distinct logits do not happen in practice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor
from pdserve.kernels.pdl import pdl_args, pdl_enter


# One warp up to this many experts: the 2k reductions of a token's logits are then register
# shuffles, with no shared-memory round trip and barrier each (4 warps at E = 128 took ~5 us a
# layer in the H200 profile). bench/moe.py sets it to 64 (the earlier rule) for its "before" rows.
ONE_WARP_MAX_EXPERTS = 256


@triton.jit
def _moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                      TOP_K: tl.constexpr, K_TILE: tl.constexpr, E_TILE: tl.constexpr, RENORMALIZE: tl.constexpr,
                      PDL: tl.constexpr = False):
    # Grid (T,): one token's E logits in registers, routed by _route_one.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_TILE)
    x = tl.load(logits_ptr + t * stride_t + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    best_w, best_id = _route_one(x, num_experts, TOP_K, K_TILE, E_TILE, RENORMALIZE)
    slot = tl.arange(0, K_TILE)
    tl.store(weights_ptr + t * TOP_K + slot, best_w, mask=slot < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slot, best_id, mask=slot < TOP_K)


@triton.jit
def _route_one(x, num_experts, TOP_K: tl.constexpr, K_TILE: tl.constexpr, E_TILE: tl.constexpr,
               RENORMALIZE: tl.constexpr):
    # One token's [E_TILE] fp32 logits (-inf past E) -> ([K_TILE] weights, [K_TILE] int64 ids):
    # k rounds of arg-max, each masking its winner. One pass: the winners collect in a [K_TILE]
    # vector and are divided by their sum at the end (an earlier version ran the k rounds twice,
    # once for the sum). The sum adds the winners in the same order, so the weights are the same bits.
    e = tl.arange(0, E_TILE)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < num_experts, p, -1.0)
    slot = tl.arange(0, K_TILE)
    best_w = tl.zeros([K_TILE], dtype=tl.float32)
    best_id = tl.zeros([K_TILE], dtype=tl.int64)
    total = 0.0
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        total += best
        # min(.., E - 1): NaN logits match no lane; an id past the experts would be read out of bounds.
        idx = tl.minimum(tl.min(tl.where(p == best, e, E_TILE), axis=0), num_experts - 1)
        best_w = tl.where(slot == j, best, best_w)
        best_id = tl.where(slot == j, idx.to(tl.int64), best_id)
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:  # a division, as transformers does
        best_w = best_w / total
    return best_w, best_id


@triton.jit
def _route_rows(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_t,
                TOP_K: tl.constexpr, K_TILE: tl.constexpr, RENORMALIZE: tl.constexpr,
                T_TILE: tl.constexpr, E_TILE: tl.constexpr):
    # _moe_route_kernel's arithmetic for all T tokens in one program ([T, E] at once): the routing
    # half of kernels/fused_moe.py's moe_route_align.
    t = tl.arange(0, T_TILE)
    e = tl.arange(0, E_TILE)
    t_ok = t < num_tokens
    e_ok = e < num_experts
    x = tl.load(logits_ptr + t[:, None].to(tl.int64) * stride_t + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                other=0.0).to(tl.float32)
    x = tl.where(e_ok[None, :], x, float("-inf"))  # rows past T stay finite (never stored)
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(e_ok[None, :], p, -1.0)
    slot = tl.arange(0, K_TILE)
    best_w = tl.zeros([T_TILE, K_TILE], dtype=tl.float32)
    best_id = tl.zeros([T_TILE, K_TILE], dtype=tl.int64)
    total = tl.zeros([T_TILE], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        total += best
        idx = tl.minimum(tl.min(tl.where(p == best[:, None], e[None, :], E_TILE), axis=1), num_experts - 1)
        best_w = tl.where(slot[None, :] == j, best[:, None], best_w)
        best_id = tl.where(slot[None, :] == j, idx[:, None].to(tl.int64), best_id)
        p = tl.where(e[None, :] == idx[:, None], -1.0, p)
    if RENORMALIZE:
        best_w = best_w / total[:, None]
    out = t[:, None].to(tl.int64) * TOP_K + slot[None, :]
    mask = t_ok[:, None] & (slot < TOP_K)[None, :]
    tl.store(weights_ptr + out, best_w, mask=mask)
    tl.store(ids_ptr + out, best_id, mask=mask)


def check_route_args(fn: str, router_logits: torch.Tensor, top_k: int) -> tuple[int, int]:
    """moe_route's argument checks (shared with fused_moe.moe_route_align) -> (T, E)."""
    check_tensor(fn, "router_logits", router_logits, (None, None), FLOAT_DTYPES)
    check_devices(fn, router_logits=router_logits)
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"{fn}: top_k must be in [1, {e}], got {top_k}")
    if router_logits.stride(-1) != 1:
        raise ValueError(f"{fn}: router_logits must be contiguous in its last dimension")
    return t, e


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of reference.moe_route_ref: [T, E] -> (weights [T, k] fp32, ids [T, k] int64)."""
    t, e = check_route_args("moe_route", router_logits, top_k)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=router_logits.device)
    if t:
        _moe_route_kernel[(t,)](router_logits, weights, ids, e, router_logits.stride(0), TOP_K=top_k,
                                K_TILE=triton.next_power_of_2(top_k), E_TILE=triton.next_power_of_2(e),
                                RENORMALIZE=renormalize, num_warps=1 if e <= ONE_WARP_MAX_EXPERTS else 4,
                                **pdl_args(router_logits.device))
    return weights, ids
