"""moe_grouped_route: DeepSeekMoE's group-limited top-k in one kernel against transformers'
arithmetic (reference.moe_grouped_route_ref)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.moe_grouped_route import moe_grouped_route
from pdserve.kernels.reference import moe_grouped_route_ref
from tests.kernels.kernel_inputs import DEVICE

# (T, E, k, scoring, n_group, topk_group, group_score, bias, renormalize, scaling)
CASES = [
    (3, 256, 8, "sigmoid", 8, 4, "top2_sum", True, True, 2.5),  # DeepSeek-V3 / R1 / Kimi-K2's router
    (2, 64, 6, "softmax", 8, 3, "max", False, False, 1.0),  # DeepSeek-V2-like (softmax, group max)
    (2, 160, 6, "softmax", 8, 3, "max", False, False, 16.0),  # V2's 160 experts: groups of 20
    (4, 64, 4, "sigmoid", 1, 1, "top2_sum", True, True, 1.0),  # no group limit
    (2, 384, 8, "sigmoid", 1, 1, "top2_sum", True, True, 2.827),  # Kimi-K2's 384 experts: 4 warps
    (1, 48, 3, "sigmoid", 4, 2, "top2_sum", False, True, 1.0),  # E not a power of two
    (5, 32, 8, "sigmoid", 4, 1, "top2_sum", True, False, 1.0),  # k = a whole group
]


def _logits(t: int, e: int, seed: int) -> torch.Tensor:
    # Distinct values (a permutation, scaled): no ties between experts, nor between groups' sums
    # (ties may order either way: the kernel takes the lowest index, torch.topk on the GPU another).
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).float().sub(e / 2).div(e / 4)


@pytest.mark.parametrize("case", CASES, ids=[f"E{c[1]}-k{c[2]}-{c[3]}-g{c[4]}x{c[5]}" for c in CASES])
def test_matches_reference(case):
    t, e, k, scoring, n_group, topk_group, group_score, has_bias, renormalize, scaling = case
    logits = _logits(t, e, e).to(DEVICE)
    # A bias on a coarser grid than the logits' steps keeps the biased choices distinct.
    bias = (torch.randperm(e, generator=torch.Generator().manual_seed(1)).float() / (8 * e)).to(DEVICE) \
        if has_bias else None
    args = (k, scoring, n_group, topk_group, group_score, bias, renormalize, scaling)
    w, ids = moe_grouped_route(logits, *args)
    w_ref, ids_ref = moe_grouped_route_ref(logits, *args)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (t, k) == w.shape
    # The same experts (the reference's order is torch.topk's unsorted one): compare as sets, each
    # with its weight.
    order, order_ref = ids.argsort(dim=1), ids_ref.argsort(dim=1)
    assert torch.equal(ids.gather(1, order).cpu(), ids_ref.gather(1, order_ref).cpu())
    torch.testing.assert_close(w.gather(1, order).cpu(), w_ref.gather(1, order_ref).cpu(), rtol=1e-6, atol=1e-7)
    # Descending by the biased score, as the docstring says.
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(-1)
    chosen = (scores + (bias if bias is not None else 0)).gather(1, ids)
    assert bool((chosen[:, :-1] >= chosen[:, 1:]).all())


def test_bf16_logits_and_no_tokens():
    logits = _logits(2, 256, 3).to(DEVICE)
    w, ids = moe_grouped_route(logits.bfloat16(), 8, "sigmoid", 8, 4)
    w_ref, ids_ref = moe_grouped_route_ref(logits.bfloat16(), 8, "sigmoid", 8, 4)
    assert torch.equal(ids.sort(1)[0].cpu(), ids_ref.sort(1)[0].cpu())
    w, ids = moe_grouped_route(torch.empty(0, 256, device=DEVICE), 8, "sigmoid", 8, 4)
    assert w.shape == ids.shape == (0, 8)


def test_rejects_bad_arguments():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="n_group must divide"):
        moe_grouped_route(x, 4, "sigmoid", 7, 2)
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_grouped_route(x, 17, "sigmoid", 8, 2)  # 2 groups of 8 kept: 16 experts at most
    with pytest.raises(ValueError, match="scoring must be one of"):
        moe_grouped_route(x, 4, "tanh", 8, 2)
    with pytest.raises(ValueError, match="correction_bias has shape"):
        moe_grouped_route(x, 4, "sigmoid", 8, 2, correction_bias=torch.zeros(63, device=DEVICE))
