"""fused_moe: the grouped reference equals the per-expert loop, the Triton kernel (interpreter on
CPU) equals the reference, and the device-side sort puts every assignment in its expert's block."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fused_moe import fused_moe, moe_align, moe_align_torch
from pdserve.kernels.reference import fused_moe_loop_ref, fused_moe_ref
from tests.kernels.kernel_inputs import DEVICE, TOL, rel_error


def moe_inputs(t, h, inter, e, k, dtype=torch.float32, seed=0, drop=0.0):
    """Weights and a routing as the router makes them: k distinct experts per token, fp32 weights.
    `drop`: the share of assignments set to -1 (experts another rank holds)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k).long()
    if drop:
        ids = torch.where(torch.rand(ids.shape, generator=g) < drop, -1, ids)
    weights = torch.rand(t, k, generator=g).softmax(-1)
    to = dict(device=DEVICE)
    return (x.to(dtype=dtype, **to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to), weights.to(**to),
            ids.to(**to))


@pytest.mark.parametrize("t,e,k,drop", [(1, 8, 2, 0.0), (13, 8, 2, 0.0), (40, 4, 2, 0.0), (17, 8, 3, 0.3)])
def test_grouped_reference_equals_per_expert_loop(t, e, k, drop):
    x, w13, w2, w, ids = moe_inputs(t, 64, 32, e, k, drop=drop)
    out = fused_moe_ref(x.double(), w13.double(), w2.double(), w, ids)
    loop = fused_moe_loop_ref(x.double(), w13.double(), w2.double(), w, ids)
    assert rel_error(out, loop) < 1e-12
    if drop:  # a token whose k experts are all elsewhere gets exactly zero
        none_here = (ids < 0).all(dim=1)
        assert (out[none_here] == 0).all()


@pytest.mark.parametrize("align", [moe_align, moe_align_torch], ids=["kernel", "torch"])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("t,e,k,drop", [(1, 8, 2, 0.0), (30, 8, 2, 0.0), (9, 64, 4, 0.5), (3, 128, 8, 0.0)])
def test_align_gives_each_assignment_one_row_in_its_experts_blocks(t, e, k, drop, block_m, align):
    _, _, _, _, ids = moe_inputs(t, 8, 8, e, k, drop=drop)
    sorted_ids, expert_ids, num_padded = align(ids, e, block_m)
    n, m, flat = int(num_padded), t * k, ids.reshape(-1).cpu()
    assert (
        sorted_ids.numel() % block_m == 0
        and n <= sorted_ids.numel()
        and expert_ids.numel() * block_m == sorted_ids.numel()
    )
    rows = sorted_ids[:n].cpu()
    real = rows[rows < m]
    assert sorted(real.tolist()) == [i for i in range(m) if flat[i] >= 0]  # each held assignment once
    block_expert = expert_ids.cpu().repeat_interleave(block_m)[:n]
    assert (block_expert[rows < m] == flat[real]).all()  # in a block of its own expert
    assert (expert_ids.cpu()[n // block_m:] == -1).all()
    counts = torch.bincount(flat[flat >= 0], minlength=e)
    assert n == int(((counts + block_m - 1) // block_m * block_m).sum())


def test_align_kernel_equals_torch_align():
    # Same rows, same order within each expert, same padding: the kernel is the torch version.
    for t, e, k, drop, block_m, offset in [(7, 8, 2, 0.0, 16, 0), (16, 128, 8, 0.0, 16, 0), (11, 16, 4, 0.3, 32, 0),
                                           (13, 16, 4, 0.1, 16, 8)]:  # the last: experts 8..15 held (EP)
        _, _, _, _, ids = moe_inputs(t, 8, 8, e, k, drop=drop)
        held = e - offset
        for a, b in zip(moe_align(ids, held, block_m, offset), moe_align_torch(ids, held, block_m, offset)):
            assert torch.equal(a.cpu(), b.cpu().to(a.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,e,k,drop", [(1, 8, 2, 0.0), (21, 8, 2, 0.0), (6, 4, 2, 0.4)])
def test_kernel_matches_reference(poison_empty, dtype, t, e, k, drop):
    # inter 48: the last column tile is partial; h 64 spans two K tiles at BLOCK_K 32.
    x, w13, w2, w, ids = moe_inputs(t, 64, 48, e, k, dtype=dtype, drop=drop)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    out = fused_moe(x, w13, w2, w, ids, config=cfg)
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w, ids)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype] * (5 if dtype == torch.bfloat16 else 10)


@pytest.mark.parametrize("offset", [0, 4])
def test_expert_offset_holds_a_range_of_experts(poison_empty, offset):
    # Expert parallelism: global ids, this op holding experts [offset, offset + 4) of 8; the two
    # halves sum to the whole layer.
    x, w13, w2, w, ids = moe_inputs(7, 64, 32, 8, 2)
    whole = fused_moe_loop_ref(x.double(), w13.double(), w2.double(), w, ids)
    part = slice(offset, offset + 4)
    ref = fused_moe_ref(x.double(), w13[part].double(), w2[part].double(), w, ids, expert_offset=offset)
    assert rel_error(ref, fused_moe_loop_ref(x.double(), w13[part].double(), w2[part].double(), w, ids,
                                             expert_offset=offset)) < 1e-12
    out = fused_moe(x, w13[part].contiguous(), w2[part].contiguous(), w, ids, expert_offset=offset)
    assert rel_error(out, ref) < 1e-4
    other = slice(4 - offset, 8 - offset)
    rest = fused_moe_ref(x.double(), w13[other].double(), w2[other].double(), w, ids, expert_offset=4 - offset)
    assert rel_error(ref + rest, whole) < 1e-12


def test_kernel_with_the_torch_align_of_large_batches(poison_empty, monkeypatch):
    import pdserve.kernels.fused_moe as fm

    monkeypatch.setattr(fm, "ALIGN_KERNEL_MAX_ELEMENTS", 0)  # as a prefill batch: moe_align_torch
    x, w13, w2, w, ids = moe_inputs(9, 64, 32, 8, 2, drop=0.2)
    assert rel_error(fused_moe(x, w13, w2, w, ids), fused_moe_ref(x.double(), w13.double(), w2.double(), w, ids)) < 1e-4
    half = fused_moe(x, w13[4:].contiguous(), w2[4:].contiguous(), w, ids, expert_offset=4)
    assert rel_error(half, fused_moe_ref(x.double(), w13[4:].double(), w2[4:].double(), w, ids, expert_offset=4)) < 1e-4


def test_kernel_default_config_and_int32_ids(poison_empty):
    x, w13, w2, w, ids = moe_inputs(5, 64, 32, 4, 2)
    assert rel_error(fused_moe(x, w13, w2, w, ids.int()), fused_moe_ref(x, w13, w2, w, ids)) < 1e-4
    assert fused_moe(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, 64)


def test_rejects_bad_arguments():
    x, w13, w2, w, ids = moe_inputs(3, 64, 32, 4, 2)
    with pytest.raises(ValueError, match="w2 has shape"):
        fused_moe(x, w13, w2[:, :, :16], w, ids)
    with pytest.raises(TypeError, match="topk_ids has dtype float32"):
        fused_moe(x, w13, w2, w, ids.float())
    with pytest.raises(ValueError, match="topk_weights has shape"):
        fused_moe(x, w13, w2, w[:, :1], ids)


# --- The decode path (T <= DECODE_MAX_TOKENS): two GEMV launches, the top-k sum in the down pass.
SMALL_DECODE_TILES = dict(GU_BLOCK_N=16, GU_BLOCK_K=32, GU_WARPS=4, DOWN_BLOCK_N=16, DOWN_BLOCK_K=32, DOWN_WARPS=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "t,e,k,drop", [(1, 8, 2, 0.0), (1, 16, 8, 0.0), (3, 8, 3, 0.0), (4, 8, 2, 0.4), (6, 4, 2, 0.0)]
)
def test_decode_path_matches_reference(poison_empty, dtype, t, e, k, drop):
    # h 80 / inter 40: the last K tile and the last column strip of both passes are partial;
    # k = 3: the [k, BLOCK_N, BLOCK_K] down block has a masked fourth expert.
    x, w13, w2, w, ids = moe_inputs(t, 80, 40, e, k, dtype=dtype, drop=drop)
    out = fused_moe(x, w13, w2, w, ids, config=SMALL_DECODE_TILES, path="decode")
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w, ids)
    assert out.shape == x.shape and out.dtype == dtype
    # bf16: the interpreter truncates fp32 -> bf16 (tests/kernels/test_fused_gemv.py's 2.5e-2).
    assert rel_error(out, ref) < (2.5e-2 if dtype == torch.bfloat16 and DEVICE == "cpu" else TOL[dtype] * 10)
    if drop:  # a token whose k experts are all elsewhere gets exactly zero
        assert (out[(ids < 0).all(dim=1)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split,t,e,k,drop", [(1, 1, 8, 2, 0.0), (2, 3, 8, 3, 0.0), (3, 4, 8, 2, 0.4)])
def test_decode_down_split_matches_reference(poison_empty, dtype, split, t, e, k, drop):
    # DOWN_SPLIT_K on plain weights: programs per (token, strip, expert slot, share of I), fp32
    # partials summed in a fixed order. inter 40 at 32-wide steps: split 2 ends each share on a
    # partial step, split 3 leaves a share empty; the same bits on every run.
    x, w13, w2, w, ids = moe_inputs(t, 80, 40, e, k, dtype=dtype, drop=drop)
    cfg = dict(SMALL_DECODE_TILES, DOWN_SPLIT_K=split)
    out = fused_moe(x, w13, w2, w, ids, config=cfg, path="decode")
    ref = fused_moe_ref(x.double(), w13.double(), w2.double(), w, ids)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_error(out, ref) < (2.5e-2 if dtype == torch.bfloat16 and DEVICE == "cpu" else TOL[dtype] * 10)
    assert torch.equal(out, fused_moe(x, w13, w2, w, ids, config=cfg, path="decode"))
    if drop:  # a token whose k experts are all elsewhere gets exactly zero
        assert (out[(ids < 0).all(dim=1)] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split,t,k,drop", [(1, 1, 2, 0.0), (2, 3, 3, 0.0), (3, 4, 2, 0.4)])
def test_decode_down_reduce_here_equals_the_finish_launch(poison_empty, dtype, split, t, k, drop):
    # DOWN_REDUCE_HERE: the last program of a (token, strip) to arrive sums the partials in the
    # finish launch's order: the same bits; the arrival counters are left zero for the next launch.
    from pdserve.kernels.arrivals import strip_counters

    x, w13, w2, w, ids = moe_inputs(t, 80, 40, 8, k, dtype=dtype, drop=drop)
    cfg = dict(SMALL_DECODE_TILES, DOWN_SPLIT_K=split)
    two = fused_moe(x, w13, w2, w, ids, config=cfg, path="decode")
    one = fused_moe(x, w13, w2, w, ids, config=dict(cfg, DOWN_REDUCE_HERE=True), path="decode")
    assert torch.equal(one, two)
    assert not strip_counters(x.device).any()
    with pytest.raises(ValueError, match="DOWN_REDUCE_HERE must be True or False"):
        fused_moe(x, w13, w2, w, ids, config=dict(cfg, DOWN_REDUCE_HERE=1), path="decode")



def test_decode_config_takes_the_environment_knobs(monkeypatch):
    # PDSERVE_MOE_DECODE_KNOBS (bench/moe.py engine --down-knobs): on every bf16 / FP8 decode config.
    import pdserve.kernels.fused_moe as fm

    monkeypatch.setattr(fm, "MOE_ENV_DECODE_KNOBS", {"DOWN_REDUCE_HERE": True})
    assert fm.moe_decode_config(8, 768, tokens=1)["DOWN_REDUCE_HERE"] is True
    assert fm.moe_decode_config(8, 768, fp8=True, tokens=2)["DOWN_REDUCE_HERE"] is True
    assert "DOWN_REDUCE_HERE" not in fm.moe_decode_config(8, 768, mxfp4=True)  # its own: PDSERVE_MXFP4_DECODE_KNOBS


@pytest.mark.parametrize("offset", [0, 4])
def test_decode_path_expert_offset(poison_empty, offset):
    # Expert parallelism on the decode path: this op holds experts [offset, offset + 4) of 8.
    x, w13, w2, w, ids = moe_inputs(3, 64, 32, 8, 2)
    part = slice(offset, offset + 4)
    out = fused_moe(x, w13[part].contiguous(), w2[part].contiguous(), w, ids, expert_offset=offset,
                    config=SMALL_DECODE_TILES, path="decode")
    ref = fused_moe_loop_ref(x.double(), w13[part].double(), w2[part].double(), w, ids, expert_offset=offset)
    assert rel_error(out, ref) < 1e-4


def test_auto_path_picks_decode_by_batch_size(poison_empty, monkeypatch):
    # "auto" is a shape test: decode up to DECODE_MAX_TOKENS tokens, sorted above (spied launches).
    import pdserve.kernels.fused_moe as fm

    calls = []
    real_decode, real_align = fm._fused_moe_decode, fm.moe_align
    monkeypatch.setattr(fm, "_fused_moe_decode", lambda *a, **kw: calls.append("decode") or real_decode(*a, **kw))
    monkeypatch.setattr(fm, "moe_align", lambda *a: calls.append("sorted") or real_align(*a))
    monkeypatch.setattr(fm, "DECODE_MAX_TOKENS", 2)
    monkeypatch.setattr(fm, "moe_decode_config", lambda k, i, *a, **kw: SMALL_DECODE_TILES)
    for t in (1, 2, 3):
        x, w13, w2, w, ids = moe_inputs(t, 64, 32, 8, 2)
        out = fused_moe(x, w13, w2, w, ids)
        assert rel_error(out, fused_moe_ref(x.double(), w13.double(), w2.double(), w, ids)) < 1e-4
    assert calls == ["decode", "decode", "sorted"]
    calls.clear()
    fused_moe(x[:1], w13, w2, w[:1], ids[:1], path="sorted")  # the old path on request
    fused_moe(x[:1], w13, w2, w[:1], ids[:1], config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4,
                                                           num_stages=2))  # a sorted config: sorted
    assert calls == ["sorted", "sorted"]


def test_decode_path_is_bit_stable_and_agrees_with_sorted(poison_empty):
    # No atomics: two runs give the same bits; the two paths compute the same function.
    x, w13, w2, w, ids = moe_inputs(4, 64, 48, 8, 4, drop=0.2)
    a = fused_moe(x, w13, w2, w, ids, config=SMALL_DECODE_TILES, path="decode")
    b = fused_moe(x, w13, w2, w, ids, config=SMALL_DECODE_TILES, path="decode")
    assert torch.equal(a, b)
    assert rel_error(a, fused_moe(x, w13, w2, w, ids, path="sorted")) < 1e-4
    assert rel_error(fused_moe(x, w13, w2, w, ids, path="decode"), a) < 1e-5  # moe_decode_config's tiles


def test_decode_path_rejects_strided_weights():
    x, w13, w2, w, ids = moe_inputs(2, 64, 32, 4, 2)
    with pytest.raises(ValueError, match="path must be one of"):
        fused_moe(x, w13, w2, w, ids, path="fast")
    with pytest.raises(ValueError, match="decode path needs"):
        fused_moe(x, w13, w2.transpose(1, 2).contiguous().transpose(1, 2), w, ids, path="decode")


@pytest.mark.parametrize("sum_in_torch", [False, True])
def test_sorted_path_sum_skips_rows_of_experts_held_elsewhere(poison_empty, monkeypatch, sum_in_torch):
    # The one-launch sum never reads the (NaN-poisoned, unwritten) rows of assignments held
    # elsewhere; the old memset + torch sum (the bench's "before") gives the same result.
    import pdserve.kernels.fused_moe as fm

    monkeypatch.setattr(fm, "SUM_IN_TORCH", sum_in_torch)
    x, w13, w2, w, ids = moe_inputs(9, 64, 32, 8, 3, drop=0.5)
    ids[0] = -1  # a token with no expert held here
    out = fused_moe(x, w13[2:6].contiguous(), w2[2:6].contiguous(), w, ids, expert_offset=2, path="sorted")
    ref = fused_moe_loop_ref(x.double(), w13[2:6].double(), w2[2:6].double(), w, ids, expert_offset=2)
    assert rel_error(out, ref) < 1e-4 and (out[0] == 0).all()
    assert torch.equal(out, fused_moe(x, w13[2:6].contiguous(), w2[2:6].contiguous(), w, ids, expert_offset=2,
                                      path="sorted"))


# --- Routing and sort in one launch (moe_route_align), and the layer op from the router's logits.
@pytest.mark.parametrize("t,router_e,local_e,offset,k,renorm,block_m",
                         [(5, 8, 8, 0, 2, True, 16), (7, 16, 8, 8, 3, False, 16), (12, 128, 128, 0, 8, True, 16),
                          (3, 60, 30, 30, 4, False, 32)])
def test_route_align_equals_route_then_align(t, router_e, local_e, offset, k, renorm, block_m):
    from pdserve.kernels.fused_moe import moe_route_align
    from pdserve.kernels.moe_route import moe_route

    logits = (torch.randn(t, router_e, generator=torch.Generator().manual_seed(t)) * 3).to(DEVICE)
    got = moe_route_align(logits, k, renorm, local_e, block_m, offset)
    w, ids = moe_route(logits, k, renorm)
    assert torch.equal(got[1].cpu(), ids.cpu())
    torch.testing.assert_close(got[0].cpu(), w.cpu(), rtol=1e-6, atol=1e-7)  # the same math, rows at once
    for a, b in zip(got[2:], moe_align(ids, local_e, block_m, offset)):
        assert torch.equal(a.cpu(), b.cpu())


def test_route_align_past_the_one_program_limit_is_two_calls(monkeypatch):
    import pdserve.kernels.fused_moe as fm

    monkeypatch.setattr(fm, "ALIGN_KERNEL_MAX_ELEMENTS", 0)
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    got = fm.moe_route_align(logits, 2, True, 8, 16)
    assert not fm.route_align_fits(6, 2, 8, 8)
    for a, b in zip(got[2:], moe_align_torch(got[1], 8, 16)):
        assert torch.equal(a.cpu(), b.cpu().to(a.dtype))


@pytest.mark.parametrize("offset", [0, 4])
def test_routed_layer_op_matches_reference_at_every_batch_size(poison_empty, monkeypatch, offset):
    # fused_moe_routed: decode path (T <= 2 here), routing + sort in one launch (T 3..), and past
    # the one-program limit the two calls; all equal reference.fused_moe_routed_ref.
    import pdserve.kernels.fused_moe as fm
    from pdserve.kernels.reference import fused_moe_routed_ref

    monkeypatch.setattr(fm, "DECODE_MAX_TOKENS", 2)
    fused_calls = []
    real = fm.moe_route_align
    monkeypatch.setattr(fm, "moe_route_align", lambda *a: fused_calls.append(a[0].shape[0]) or real(*a))
    part = slice(offset, offset + 4)
    for t in (1, 2, 3, 9):
        x, w13, w2, _, _ = moe_inputs(t, 64, 32, 8, 2, seed=t)
        logits = torch.randn(t, 8, generator=torch.Generator().manual_seed(t)).to(DEVICE) * 2
        w13p, w2p = w13[part].contiguous(), w2[part].contiguous()
        out = fm.fused_moe_routed(x, w13p, w2p, logits, 2, True, expert_offset=offset)
        ref = fused_moe_routed_ref(x.double(), w13p.double(), w2p.double(), logits, 2, True, expert_offset=offset)
        # A token whose 2 experts are both held elsewhere gets exact zeros (no relative error then).
        assert (out.cpu().double() - ref.cpu()).norm() <= 1e-4 * ref.norm() and not out.isnan().any(), t
    assert fused_calls == [3, 9]
    monkeypatch.setattr(fm, "ALIGN_KERNEL_MAX_ELEMENTS", 0)  # a prefill-sized batch: moe_route + the torch sort
    out = fm.fused_moe_routed(x, w13p, w2p, logits, 2, True, expert_offset=offset)
    assert rel_error(out, fused_moe_routed_ref(x.double(), w13p.double(), w2p.double(), logits, 2, True,
                                               expert_offset=offset)) < 1e-4
    assert fused_calls == [3, 9]


def test_align_argument_is_checked():
    x, w13, w2, w, ids = moe_inputs(3, 64, 32, 4, 2)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    align = moe_align(ids, 4, 16)
    with pytest.raises(ValueError, match="align is for the sorted path"):
        fused_moe(x, w13, w2, w, ids, align=align)
    with pytest.raises(ValueError, match="align does not match"):
        fused_moe(x, w13, w2, w, ids, config=dict(cfg, BLOCK_M=32), align=align)
    assert rel_error(fused_moe(x, w13, w2, w, ids, config=cfg, align=align),
                     fused_moe_ref(x.double(), w13.double(), w2.double(), w, ids)) < 1e-4


@pytest.mark.skipif(DEVICE == "cpu", reason="real sizes compiled on a GPU (tools/gpu/moe.sh runs this file there)")
@pytest.mark.parametrize("t", [1, 4, 16, 40])
def test_qwen3_30b_a3b_layer_on_the_gpu(t):
    # The default tiles at Qwen3-30B-A3B's layer shape (E=128, k=8, H=2048, I=768), bf16, through
    # the model's op: decode path (1, 4), routing + sort in one launch (16), two launches (40).
    from pdserve.kernels.fused_moe import fused_moe_routed
    from pdserve.kernels.reference import fused_moe_routed_ref

    g = torch.Generator(device=DEVICE).manual_seed(t)
    x = torch.randn(t, 2048, device=DEVICE, generator=g).bfloat16()
    w13 = (torch.randn(128, 1536, 2048, device=DEVICE, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(128, 2048, 768, device=DEVICE, generator=g) * 0.02).bfloat16()
    logits = torch.randn(t, 128, device=DEVICE, generator=g).bfloat16()
    out = fused_moe_routed(x, w13, w2, logits, 8, True)
    ref = fused_moe_routed_ref(x.float(), w13.float(), w2.float(), logits, 8, True)
    assert rel_error(out, ref) < TOL[torch.bfloat16]
    assert torch.equal(out, fused_moe_routed(x, w13, w2, logits, 8, True))  # bit-stable
