"""DeepSeekMoE's group-limited top-k routing in one kernel (reference.moe_grouped_route_ref).

The torch version is about fifteen launches per MoE layer (sigmoid, bias add, two top-k, a
scatter, the mask's expand and fill, the gather, the sum and the division), each a few
microseconds at decode batch sizes while the arithmetic is a few hundred values per token. With
this kernel (5.4 us a call) DeepSeek-V3's 8-layer bs=1 step went from 3.26 to 2.94 ms on an H200
(7 MoE layers, ~45 us each; consecutive calls, docs/results/deepseek). Here one program takes one token's
E router logits in registers: scores (sigmoid or softmax), the biased choice, each group's score
(its best, or its two best summed), the `topk_group` best groups by arg-max rounds, then the k best
experts of the kept groups by arg-max rounds, weighted by their unbiased scores, renormalised
and scaled.

Ties pick the lowest index (group or expert); torch.topk's order on ties is unspecified, and
between distinct fp32 router logits they do not happen in practice. The k experts come in
descending order of their biased score (torch.topk(sorted=False) returns them in an unspecified
order), so the renormalising sum adds them in that order: equal to the reference's weights within
fp32 rounding, the same experts. Groups need not be a power of two wide (DeepSeek-V2: 160 experts
in 8 groups of 20): a lane's group is its index // (E / n_group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor
from pdserve.kernels.moe_route import ONE_WARP_MAX_EXPERTS, check_route_args
from pdserve.kernels.pdl import pdl_args, pdl_enter


SCORINGS = ("sigmoid", "softmax")
GROUP_SCORES = ("top2_sum", "max")


@triton.jit
def _moe_grouped_route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, stride_t,
                              scaling, TOP_K: tl.constexpr, K_TILE: tl.constexpr, E_TILE: tl.constexpr,
                              N_GROUP: tl.constexpr, G_TILE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                              SIGMOID: tl.constexpr, TOP2_SUM: tl.constexpr, HAS_BIAS: tl.constexpr,
                              RENORMALIZE: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (T,). Values at or below -inf mark what can no longer be chosen; `valid` keeps lanes
    # past E out of every reduction.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_TILE)
    valid = e < num_experts
    x = tl.load(logits_ptr + t * stride_t + e, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        scores = tl.sigmoid(x)
    else:
        z = tl.exp(tl.where(valid, x, float("-inf")) - tl.max(tl.where(valid, x, float("-inf")), axis=0))
        scores = z / tl.sum(z, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:
        group = e // group_size
        g = tl.arange(0, G_TILE)
        gs = tl.full([G_TILE], float("-inf"), tl.float32)
        for j in tl.static_range(N_GROUP):
            mine = valid & (group == j)
            first = tl.max(tl.where(mine, choice, float("-inf")), axis=0)
            score = first
            if TOP2_SUM:  # the group's two best: its best lane masked, then the best again
                at = tl.min(tl.where(mine & (choice == first), e, E_TILE), axis=0)
                score = first + tl.max(tl.where(mine & (e != at), choice, float("-inf")), axis=0)
            gs = tl.where(g == j, score, gs)
        keep = g < 0  # no group kept yet
        for _ in tl.static_range(TOPK_GROUP):
            cand = tl.where(keep | (g >= N_GROUP), float("-inf"), gs)
            best = tl.max(cand, axis=0)
            at = tl.min(tl.where(~keep & (g < N_GROUP) & (cand == best), g, G_TILE), axis=0)
            keep = keep | (g == at)
        kept = tl.max(tl.where((g[None, :] == group[:, None]) & keep[None, :], 1, 0), axis=1) > 0
        # The reference's fill: -inf with V3's group score, 0 with V2's (its scores are positive).
        if TOP2_SUM:
            choice = tl.where(kept | ~valid, choice, float("-inf"))
        else:
            choice = tl.where(kept | ~valid, choice, 0.0)
    slot = tl.arange(0, K_TILE)
    best_w = tl.zeros([K_TILE], dtype=tl.float32)
    best_id = tl.zeros([K_TILE], dtype=tl.int64)
    taken = ~valid
    total = 0.0
    for j in tl.static_range(TOP_K):
        cand = tl.where(taken, float("-inf"), choice)
        best = tl.max(cand, axis=0)
        # min(.., E - 1): a NaN logit matches no lane; an id past the experts would be read out of bounds.
        idx = tl.minimum(tl.min(tl.where(~taken & (cand == best), e, E_TILE), axis=0), num_experts - 1)
        w = tl.sum(tl.where(e == idx, scores, 0.0), axis=0)
        total += w
        best_w = tl.where(slot == j, w, best_w)
        best_id = tl.where(slot == j, idx.to(tl.int64), best_id)
        taken = taken | (e == idx)
    if RENORMALIZE:  # as transformers: a division by the sum + 1e-20
        best_w = best_w / (total + 1e-20)
    tl.store(weights_ptr + t * TOP_K + slot, best_w * scaling, mask=slot < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slot, best_id, mask=slot < TOP_K)


def moe_grouped_route(router_logits: torch.Tensor, top_k: int, scoring: str, n_group: int = 1, topk_group: int = 1,
                      group_score: str = "top2_sum", correction_bias: torch.Tensor | None = None,
                      renormalize: bool = False, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.moe_grouped_route_ref's function in one launch: router_logits [T, E] (fp32 as
    DeepSeek's router makes them, or fp16/bf16) -> (weights [T, k] fp32, expert ids [T, k] int64),
    the ids in descending order of their biased score. Shapes only on the host: graph capturable."""
    fn = "moe_grouped_route"
    t, e = check_route_args(fn, router_logits, top_k)
    if scoring not in SCORINGS or group_score not in GROUP_SCORES:
        raise ValueError(f"{fn}: scoring must be one of {SCORINGS} and group_score one of {GROUP_SCORES}, got "
                         f"{scoring!r}, {group_score!r}")
    if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"{fn}: n_group must divide the {e} experts and topk_group be in [1, n_group], got "
                         f"n_group={n_group}, topk_group={topk_group}")
    if not 1 <= top_k <= (e // n_group) * topk_group:
        raise ValueError(f"{fn}: top_k must be in [1, {(e // n_group) * topk_group}] (the kept groups' experts), "
                         f"got {top_k}")
    if group_score == "top2_sum" and n_group > 1 and e // n_group < 2:
        raise ValueError(f"{fn}: group_score 'top2_sum' needs groups of two experts or more")
    if correction_bias is not None:
        check_tensor(fn, "correction_bias", correction_bias, (e,), FLOAT_DTYPES)
        check_devices(fn, router_logits=router_logits, correction_bias=correction_bias)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=router_logits.device)
    if t:
        _moe_grouped_route_kernel[(t,)](
            router_logits, correction_bias if correction_bias is not None else router_logits, weights, ids, e,
            e // n_group, router_logits.stride(0), float(scaling), TOP_K=top_k, K_TILE=triton.next_power_of_2(top_k),
            E_TILE=triton.next_power_of_2(e), N_GROUP=n_group, G_TILE=triton.next_power_of_2(n_group),
            TOPK_GROUP=topk_group, SIGMOID=scoring == "sigmoid", TOP2_SUM=group_score == "top2_sum",
            HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize,
            num_warps=1 if e <= ONE_WARP_MAX_EXPERTS else 4, **pdl_args(router_logits.device))
    return weights, ids
