"""lora_shrink_sgmv / lora_expand_sgmv (segments of tokens sharing one adapter): the Triton
kernels against their references and against BGMV's references on the same tokens (one math,
two layouts), segments of several adapters, of the base (-1), empty ones and ones longer than a
row tile."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.lora_sgmv import K_PER_SPLIT, lora_expand_sgmv, lora_shrink_sgmv, lora_shrink_sgmv_partials
from pdserve.kernels.reference import lora_expand_ref, lora_expand_sgmv_ref, lora_shrink_ref, lora_shrink_sgmv_ref
from tests.kernels.kernel_inputs import DEVICE, ON_GPU, lora_packed, lora_unfused


def segments(lengths: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts = torch.tensor([0] + lengths).cumsum(0)
    per_token = torch.tensor([s for n, s in zip(lengths, slots) for _ in range(n)])
    return starts.to(DEVICE), torch.tensor(slots).to(DEVICE), per_token.to(DEVICE)


@pytest.mark.parametrize("dtype,k,r,n", [(torch.float32, 48, 8, 40), (torch.bfloat16, 80, 24, 72)])
def test_sgmv_equals_its_reference_and_bgmv(dtype, k, r, n):
    g = torch.Generator().manual_seed(0)
    lengths, slots_of = [19, 3, 0, 7, 1, 17], [2, -1, 1, 0, 2, 1]  # 19 and 17 span two row tiles
    starts, seg_slots, per_token = segments(lengths, slots_of)
    t = sum(lengths)
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    a = torch.randn(3, k, r, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(3, r, n, generator=g).to(dtype).to(DEVICE)

    u = lora_shrink_sgmv(x, a, starts, seg_slots, max(lengths))
    u_ref = lora_shrink_sgmv_ref(x, a, starts, seg_slots)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.1)
    torch.testing.assert_close(u, u_ref, **tol)
    torch.testing.assert_close(u_ref, lora_shrink_ref(x, a, per_token), rtol=1e-5, atol=1e-4)
    assert torch.all(u[per_token < 0] == 0)

    y0 = torch.randn(t, n, generator=g).to(dtype).to(DEVICE)
    y, y_ref, y_bgmv = y0.clone(), y0.clone(), y0.clone()
    lora_expand_sgmv(y, u_ref, b, starts, seg_slots, max(lengths))
    lora_expand_sgmv_ref(y_ref, u_ref, b, starts, seg_slots)
    lora_expand_ref(y_bgmv, u_ref, b, per_token)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=0.5)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(y_ref, y_bgmv, **tol)
    assert torch.equal(y[per_token < 0], y0[per_token < 0])  # the base model's rows are untouched


def test_split_shrink_partials_feed_the_expand():
    """What the LoRA layers run: K_PER_SPLIT + 40 columns make two K slices, whose partials go
    straight into the expand, which sums them."""
    g = torch.Generator().manual_seed(2)
    lengths, slots_of = [17, 4], [1, -1]
    starts, seg_slots, per_token = segments(lengths, slots_of)
    t, k, r, n = sum(lengths), K_PER_SPLIT + 40, 8, 16
    x = torch.randn(t, k, generator=g).to(DEVICE)
    a = torch.randn(2, k, r, generator=g).to(DEVICE)
    b = torch.randn(2, r, n, generator=g).to(DEVICE)
    parts = lora_shrink_sgmv_partials(x, a, starts, seg_slots, max(lengths))
    assert parts.shape == (2, t, r)
    u_ref = lora_shrink_sgmv_ref(x, a, starts, seg_slots)
    torch.testing.assert_close(parts.sum(0), u_ref, rtol=1e-4, atol=1e-3)
    y0 = torch.randn(t, n, generator=g).to(DEVICE)
    y = lora_expand_sgmv(y0.clone(), parts, b, starts, seg_slots, max(lengths))
    torch.testing.assert_close(y, lora_expand_sgmv_ref(y0.clone(), u_ref, b, starts, seg_slots), rtol=1e-4, atol=1e-3)
    assert torch.equal(y[per_token < 0], y0[per_token < 0])


def test_packed_parts_by_segment():
    """SGMV's one expand for all parts of a packed linear (q | k | v of GQA widths, adapters of
    ranks below the slots' width): each part's columns get its own x @ A @ B, as BGMV's (fp32:
    the tolerance is tight; bf16 runs the same code at another dot precision)."""
    dtype = torch.float32
    g = torch.Generator().manual_seed(4)
    widths, k, max_rank, ranks = [48, 16, 24], K_PER_SPLIT + 40, 16, [16, 4, 7]
    a, b, ends, per_part = lora_packed(widths, ranks, max_rank, k, dtype, g)
    lengths, slots_of = [18, 5, 0, 9], [2, -1, 1, 0]
    starts, seg_slots, per_token = segments(lengths, slots_of)
    t = sum(lengths)
    x = torch.randn(t, k, generator=g).to(dtype).to(DEVICE)
    y0 = torch.randn(t, ends[-1], generator=g).to(dtype).to(DEVICE)
    parts = lora_shrink_sgmv_partials(x, a, starts, seg_slots, max(lengths))
    y = lora_expand_sgmv(y0.clone(), parts, b, starts, seg_slots, max(lengths), ends)
    u_ref = lora_shrink_sgmv_ref(x, a, starts, seg_slots)
    y_ref = lora_expand_sgmv_ref(y0.clone(), u_ref, b, starts, seg_slots, ends=ends)
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else dict(rtol=2e-2, atol=1.0)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(y_ref, lora_expand_ref(y0.clone(), u_ref, b, per_token, ends), **tol)
    torch.testing.assert_close(y.float(), lora_unfused(x, y0, per_token.tolist(), ends, per_part), **tol)
    assert torch.equal(y[per_token < 0], y0[per_token < 0])


def test_the_launchers_check_the_segments():
    x, a = torch.zeros(4, 16, device=DEVICE), torch.zeros(2, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="starts has shape"):
        lora_shrink_sgmv(x, a, torch.tensor([0, 4], device=DEVICE), torch.tensor([0, 1], device=DEVICE), 4)


@pytest.mark.skipif(not ON_GPU, reason="real sizes need a CUDA GPU (tier 4)")
def test_llama_8b_prefill_sizes_on_the_gpu():
    """Llama-3.1-8B's qkv_proj (three parts of rank 16), bf16, a 2k-token step of four prompts."""
    g = torch.Generator(device="cuda").manual_seed(0)
    k, r, n, s = 4096, 48, 6144, 4
    lengths, slots_of = [900, 600, 400, 148], [0, 3, -1, 1]
    starts, seg_slots, per_token = segments(lengths, slots_of)
    t = sum(lengths)
    x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
    a = torch.randn(s, k, r, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    b = torch.randn(s, r // 3, n, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    u = lora_shrink_sgmv(x, a, starts, seg_slots, max(lengths))
    torch.testing.assert_close(u, lora_shrink_ref(x, a, per_token), rtol=1e-3, atol=1e-3)
    y0 = torch.randn(t, n, device="cuda", dtype=torch.bfloat16, generator=g)
    ends = [4096, 5120, 6144]  # q | k | v (8 KV heads of 128)
    torch.testing.assert_close(lora_expand_sgmv(y0.clone(), u, b, starts, seg_slots, max(lengths), ends),
                               lora_expand_ref(y0.clone(), u, b, per_token, ends), rtol=1e-2, atol=1e-2)
