"""lora_shrink / lora_expand: the Triton kernels against the references, tokens of several
adapters and of none (slot -1) mixed in one batch."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.lora import K_PER_SPLIT, lora_expand, lora_shrink, lora_shrink_partials
from pdserve.kernels.reference import lora_expand_ref, lora_shrink_ref
from tests.kernels.kernel_inputs import DEVICE, ON_GPU, lora_packed, lora_unfused


# 600 columns: three K slices of the split shrink (K_PER_SPLIT), the last one partial.
@pytest.mark.parametrize("dtype,k,r,n", [(torch.float32, 48, 8, 40), (torch.bfloat16, 160, 24, 200),
                                         (torch.float32, 2 * K_PER_SPLIT + 88, 16, 24)])
def test_shrink_and_expand_equal_the_references(dtype, k, r, n):
    g = torch.Generator().manual_seed(0)
    slots_n, t = 3, 11
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    a = torch.randn(slots_n, k, r, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(slots_n, r, n, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([0, -1, 2, 1, 1, -1, 0, 2, 2, -1, 1], device=DEVICE)

    u = lora_shrink(x, a, slots)
    u_ref = lora_shrink_ref(x, a, slots)
    torch.testing.assert_close(u, u_ref, rtol=1e-4, atol=1e-3)
    assert torch.all(u[slots < 0] == 0)

    y0 = torch.randn(t, n, generator=g).to(dtype).to(DEVICE)
    y, y_ref = y0.clone(), y0.clone()
    lora_expand(y, u_ref, b, slots)
    lora_expand_ref(y_ref, u_ref, b, slots)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    torch.testing.assert_close(y, y_ref, **tol)
    assert torch.equal(y[slots < 0], y0[slots < 0])  # the base model's rows are untouched
    # Each row is its own slot's product, not another's.
    for i in range(t):
        if slots[i] >= 0:
            own = x[i].float() @ a[slots[i]].float()
            torch.testing.assert_close(u[i], own, rtol=1e-4, atol=1e-3)


def test_split_shrink_partials_feed_the_expand_and_ignore_the_batch():
    """The expand sums the shrink's K partials itself (what the LoRA layers run), and a token's
    result is the same bits alone as in a batch of other adapters (the split depends on K only)."""
    g = torch.Generator().manual_seed(1)
    k, r, n, t = 2 * K_PER_SPLIT + 40, 8, 24, 5
    x = torch.randn(t, k, generator=g).to(DEVICE)
    a = torch.randn(2, k, r, generator=g).to(DEVICE)
    b = torch.randn(2, r, n, generator=g).to(DEVICE)
    slots = torch.tensor([1, -1, 0, 1, 0], device=DEVICE)
    parts = lora_shrink_partials(x, a, slots)
    assert parts.shape == (3, t, r)
    y0 = torch.randn(t, n, generator=g).to(DEVICE)
    y = lora_expand(y0.clone(), parts, b, slots)
    torch.testing.assert_close(y, lora_expand_ref(y0.clone(), lora_shrink_ref(x, a, slots), b, slots),
                               rtol=1e-4, atol=1e-3)
    assert torch.equal(y[1], y0[1])
    alone = lora_expand(y0[3:4].clone(), lora_shrink_partials(x[3:4], a, slots[3:4]), b, slots[3:4])
    assert torch.equal(alone[0], y[3])


@pytest.mark.parametrize("k_per_split", [128, 1024])
def test_the_unrolled_and_the_looped_shrink_agree(k_per_split):
    """A slice of up to UNROLL_K_TILES tiles is unrolled, a longer one loops (128: one tile a
    slice; 1024: eight): both equal the reference, slot -1 rows zero, and the partials sum to it."""
    g = torch.Generator().manual_seed(2)
    k, r, t = 1100, 16, 6  # 1100: the last slice partial in both splits
    x = torch.randn(t, k, generator=g).to(DEVICE)
    a = torch.randn(3, k, r, generator=g).to(DEVICE)
    slots = torch.tensor([2, -1, 0, 1, -1, 2], device=DEVICE)
    parts = lora_shrink_partials(x, a, slots, k_per_split=k_per_split)
    assert parts.shape == (-(-k // k_per_split), t, r)
    torch.testing.assert_close(parts.sum(0), lora_shrink_ref(x, a, slots), rtol=1e-4, atol=1e-3)
    assert torch.all(parts[:, slots < 0] == 0)


@pytest.mark.skipif(not ON_GPU, reason="real sizes need a CUDA GPU (tier 4)")
def test_llama_8b_sizes_on_the_gpu():
    """Llama-3.1-8B's qkv_proj: three parts of rank 16 (one shrink, one expand), four slots, bf16, a decode batch."""
    g = torch.Generator(device="cuda").manual_seed(0)
    t, k, r, n, s = 64, 4096, 48, 6144, 4
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    a = torch.randn(s, k, r, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(s, r // 3, n, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    slots = torch.randint(-1, s, (t,), device="cuda", generator=g)
    u = lora_shrink(x, a, slots)
    torch.testing.assert_close(u, lora_shrink_ref(x, a, slots), rtol=1e-3, atol=1e-3)
    y0 = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=g)
    ends = [4096, 5120, 6144]  # q | k | v (8 KV heads of 128)
    torch.testing.assert_close(lora_expand(y0.clone(), u, b, slots, ends),
                               lora_expand_ref(y0.clone(), u, b, slots, ends),
                               rtol=1e-2, atol=1e-2)


# q | k | v with GQA's narrower k and v (the last one not a whole expand tile), gate | up, and
# a rank-2 and a rank-3 adapter in max-rank-8 slots (zeros past their rank).
@pytest.mark.parametrize("dtype,widths", [(torch.float32, [40, 16, 16]), (torch.bfloat16, [96, 96]),
                                          (torch.float32, [24, 136, 8])])
def test_packed_parts_are_one_launch_each_and_equal_the_unfused_math(dtype, widths):
    """One shrink and one expand for all parts of a packed linear (what layer.py runs for qkv and
    gate_up): each part's columns get its own x @ A @ B, slot -1 rows are untouched, and the
    split shrink's partials feed the expand (K: three K slices)."""
    g = torch.Generator().manual_seed(3)
    k, max_rank, ranks = 2 * K_PER_SPLIT + 24, 8, [8, 2, 3]
    a, b, ends, per_part = lora_packed(widths, ranks, max_rank, k, dtype, g)
    slots_l = [1, -1, 0, 2, 2, -1, 1]
    slots, t = torch.tensor(slots_l, device=DEVICE), len(slots_l)
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    y0 = torch.randn(t, ends[-1], generator=g).to(dtype).to(DEVICE)

    parts = lora_shrink_partials(x, a, slots)
    assert parts.shape == (3, t, len(widths) * max_rank)
    y = lora_expand(y0.clone(), parts, b, slots, ends)
    y_ref = lora_expand_ref(y0.clone(), lora_shrink_ref(x, a, slots), b, slots, ends)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(y.float(), lora_unfused(x, y0, slots_l, ends, per_part), **tol)
    assert torch.equal(y[slots < 0], y0[slots < 0])
    # A token's row is the same bits alone as in the batch.
    alone = lora_expand(y0[3:4].clone(), lora_shrink_partials(x[3:4], a, slots[3:4]), b, slots[3:4], ends)
    assert torch.equal(alone[0], y[3])


def test_the_expand_checks_the_parts():
    y, b = torch.zeros(2, 48, device=DEVICE), torch.zeros(2, 4, 48, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="slice ends"):
        lora_expand(y, torch.zeros(2, 8, device=DEVICE), b, slots, [32, 40])  # the last must be N
    with pytest.raises(ValueError, match="slice ends"):
        lora_expand(y, torch.zeros(2, 16, device=DEVICE), b, slots, [8, 16, 32, 48])  # at most 3
    with pytest.raises(ValueError, match="u has shape"):
        lora_expand(y, torch.zeros(2, 8, device=DEVICE), b, slots, [32, 40, 48])  # 3 parts: 12 columns
