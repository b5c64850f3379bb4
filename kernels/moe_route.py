"""MoE top-k routing in one kernel: softmax over E, the k largest, renormalised (optional).

The torch version (reference.moe_route_ref) is four launches per MoE layer (softmax, topk, sum,
divide); at decode batch sizes each costs about what the layer's router GEMV does, so the
Triton path does it in one program per token. Ties pick the lowest expert id (torch.topk's order
on ties is unspecified; routing ties between distinct logits do not happen in practice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor


@triton.jit
def _moe_route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                      TOP_K: tl.constexpr, E_TILE: tl.constexpr, RENORMALIZE: tl.constexpr):
    # Grid (T,): one token's E logits in registers; k rounds of arg-max, each masking its winner.
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_TILE)
    x = tl.load(logits_ptr + t * stride_t + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < num_experts, p, -1.0)
    total = 1.0
    if RENORMALIZE:  # a first pass for the sum of the k winners (a division, as transformers does)
        q = p
        total = 0.0
        for j in tl.static_range(TOP_K):
            best = tl.max(q, axis=0)
            total += best
            q = tl.where(e == tl.min(tl.where(q == best, e, E_TILE), axis=0), -1.0, q)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        # min(.., E - 1): NaN logits match no lane; an id past the experts would be read out of bounds.
        idx = tl.minimum(tl.min(tl.where(p == best, e, E_TILE), axis=0), num_experts - 1)
        tl.store(weights_ptr + t * TOP_K + j, best / total)
        tl.store(ids_ptr + t * TOP_K + j, idx.to(tl.int64))
        p = tl.where(e == idx, -1.0, p)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of reference.moe_route_ref: [T, E] -> (weights [T, k] fp32, ids [T, k] int64)."""
    fn = "moe_route"
    check_tensor(fn, "router_logits", router_logits, (None, None), FLOAT_DTYPES)
    check_devices(fn, router_logits=router_logits)
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"{fn}: top_k must be in [1, {e}], got {top_k}")
    if router_logits.stride(-1) != 1:
        raise ValueError(f"{fn}: router_logits must be contiguous in its last dimension")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=router_logits.device)
    if t:
        _moe_route_kernel[(t,)](router_logits, weights, ids, e, router_logits.stride(0), TOP_K=top_k,
                                E_TILE=triton.next_power_of_2(e), RENORMALIZE=renormalize, num_warps=1 if e <= 64 else 4)
    return weights, ids
