"""moe_route: top-k routing in one kernel against transformers' arithmetic (reference.moe_route_ref)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.moe_route import moe_route
from pdserve.kernels.reference import moe_route_ref
from tests.kernels.kernel_inputs import DEVICE


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    "t,e,k,dtype",
    [(1, 8, 2, torch.float32), (5, 60, 4, torch.float32), (3, 128, 8, torch.bfloat16), (4, 16, 6, torch.float32)],
)
def test_matches_reference(t, e, k, dtype, renormalize):
    # Distinct eighths, exact in bf16 too: random bf16 logits have ties, and a tie may put either
    # expert first (the kernel and torch.topk on the GPU differ), so these inputs have none.
    g = torch.Generator().manual_seed(e)
    logits = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).sub(e / 2).div(8)
    logits = logits.to(dtype=dtype, device=DEVICE)
    w, ids = moe_route(logits, k, renormalize)
    w_ref, ids_ref = moe_route_ref(logits, k, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (t, k)
    assert torch.equal(ids.cpu(), ids_ref.cpu())  # random logits: no ties, the same experts in the same order
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=1e-6, atol=1e-7)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_route(torch.randn(2, 4, device=DEVICE), 5, True)
    with pytest.raises(ValueError, match="router_logits has shape"):
        moe_route(torch.randn(2, 4, 1, device=DEVICE), 2, True)
