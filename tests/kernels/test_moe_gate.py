"""moe_gate: the router's linear layer and top-k routing in one launch, against
moe_route_ref(F.linear(x, weight, bias)) (under TRITON_INTERPRET=1 on CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.moe_gate import MAX_TOKENS, GateNorm, moe_gate
from pdserve.kernels.reference import moe_route_ref, rms_norm_ref
from tests.kernels.kernel_inputs import DEVICE


def exact_inputs(t: int, e: int, h: int, dtype: torch.dtype, bias: bool):
    """Logits that are distinct eighths (plus a bias under 1/16), exact in fp32 whatever the order
    of the sum and rounded alike to bf16: token t's two ones sit in two different K shares, and
    the weight's columns there hold half its logits each; every other product is zero."""
    g = torch.Generator().manual_seed(e * 31 + t)
    x = torch.zeros(t, h)
    w = torch.randn(e, h, generator=g)
    for i in range(t):
        target = (torch.randperm(e, generator=g).float() - e / 2) / 8
        x[i, i] = x[i, h - 1 - i] = 1.0
        w[:, i] = w[:, h - 1 - i] = target / 2
    b = torch.randperm(e, generator=g).float() / (16 * e) if bias else None
    cast = lambda v: None if v is None else v.to(dtype=dtype, device=DEVICE)  # noqa: E731
    return cast(x), cast(w), cast(b)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("t,e,k,h,dtype", [
    (1, 128, 4, 2880, torch.bfloat16),   # gpt-oss's router (its bias), one token
    (3, 60, 4, 320, torch.float32),      # Qwen2-MoE's 60 experts: no power of two
    (16, 8, 2, 200, torch.bfloat16),     # Mixtral's 8, a whole decode batch, K not a multiple of the tile
])
def test_matches_reference_exactly(t, e, k, h, dtype, bias, renormalize):
    x, w, b = exact_inputs(t, e, h, dtype, bias)
    counters = torch.zeros(32, dtype=torch.int32, device=DEVICE)
    weights, ids = moe_gate(x, w, b, k, renormalize, counters)
    w_ref, ids_ref = moe_route_ref(F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype), k,
                                   renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (t, k)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    torch.testing.assert_close(weights.cpu(), w_ref.cpu(), rtol=1e-6, atol=1e-7)
    assert not counters.any()  # left zero for the next layer's launch


def test_random_router_fp32():
    # A real-looking fp32 router: the fixed-order split-K sum is not torch's, but no logit lies
    # within its rounding of a tie for this seed, so the experts and their order are the same.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 512, generator=g).to(DEVICE)
    w = (torch.randn(64, 512, generator=g) / 512**0.5).to(DEVICE)
    b = torch.randn(64, generator=g).to(DEVICE)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    weights, ids = moe_gate(x, w, b, 6, True, counters)
    w_ref, ids_ref = moe_route_ref(F.linear(x, w, b), 6, True)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    torch.testing.assert_close(weights.cpu(), w_ref.cpu(), rtol=1e-5, atol=1e-6)
    weights2, ids2 = moe_gate(x, w, b, 6, True, counters)  # the counters work again as they were left
    assert torch.equal(ids2, ids) and torch.equal(weights2, weights)


def test_rejects_bad_arguments():
    x, w = torch.randn(2, 64, device=DEVICE), torch.randn(8, 64, device=DEVICE)
    counters = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="top_k must be in"):
        moe_gate(x, w, None, 9, True, counters)
    with pytest.raises(ValueError, match="tokens need"):
        moe_gate(torch.randn(MAX_TOKENS + 1, 64, device=DEVICE), w, None, 2, True,
                 torch.zeros(64, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="tokens need"):
        moe_gate(torch.randn(5, 64, device=DEVICE), w, None, 2, True, counters)
    with pytest.raises(ValueError, match="weight has shape"):
        moe_gate(x, torch.randn(8, 32, device=DEVICE), None, 2, True, counters)


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("t,e,k,h,dtype", [(1, 128, 8, 2048, torch.bfloat16), (3, 60, 4, 200, torch.float32)])
def test_norm_in_the_launch(t, e, k, h, dtype, residual):
    # The add + RMSNorm before the router, in the launch: its normed row and residual are
    # rms_norm_ref's (to a rounding of rstd), and the routing is exactly moe_gate's on that row.
    g = torch.Generator().manual_seed(h + t)
    x = torch.randn(t, h, generator=g).to(dtype=dtype, device=DEVICE)
    res = torch.randn(t, h, generator=g).to(dtype=dtype, device=DEVICE) if residual else None
    nw = (1 + torch.randn(h, generator=g) / 4).to(dtype=dtype, device=DEVICE)
    w = (torch.randn(e, h, generator=g) / h**0.5).to(dtype=dtype, device=DEVICE)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    weights, ids, normed, new_res = moe_gate(x, w, None, k, True, counters, GateNorm(nw, 1e-6, res))
    want, want_res = rms_norm_ref(x, nw, 1e-6, res)
    tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(normed.cpu(), want.cpu(), **tol)
    if residual:
        # The sum rounded to nearest-even, as a GPU's cast does (the interpreter's cast truncates).
        assert torch.equal(new_res.cpu(), (x.double() + res.double()).to(dtype).cpu())
    else:
        assert new_res is None
    plain_w, plain_ids = moe_gate(normed, w, None, k, True, counters)
    assert torch.equal(ids, plain_ids) and torch.equal(weights, plain_w)
    assert not counters.any()


def test_norm_rejects_bad_arguments():
    x, w = torch.randn(2, 64, device=DEVICE), torch.randn(8, 64, device=DEVICE)
    counters = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="residual has shape"):
        moe_gate(x, w, None, 2, True, counters, GateNorm(torch.ones(64, device=DEVICE), 1e-6,
                                                         torch.randn(2, 32, device=DEVICE)))
    with pytest.raises(ValueError, match="norm's weight must be of x's dtype"):
        moe_gate(x, w, None, 2, True, counters, GateNorm(torch.ones(64, device=DEVICE, dtype=torch.bfloat16), 1e-6,
                                                         None))
