"""Fused mixture-of-experts: the T*k (token, expert) assignments sorted by expert, then two grouped
GEMMs over the experts' stacked weights. reference.fused_moe_ref is the same function in torch.

1. `moe_align` (on the device, no host sync, so CUDA graphs can capture it): every
   assignment gets a row in a buffer where each expert's assignments are contiguous and padded to
   a multiple of BLOCK_M; `expert_ids[b]` names the expert of row block b. Its size is a static
   bound (M + min(M, E) * (BLOCK_M - 1)), the real length lives on the device (`num_padded`):
   blocks past it exit at once, so one grid serves every routing of the same batch size.
   Decode sizes run it as one Triton program (`_moe_align_kernel`); the torch version's dozen
   small kernels per layer would cost more than the layer's GEMMs at batch 1. Large batches
   (prefill, where those launches are noise) use the torch version (`moe_align_torch`).
2. gate|up GEMM with SiLU-and-mul in its epilogue: a program computes BLOCK_N columns of both
   halves for BLOCK_M rows of one expert, and writes silu(gate) * up, rounded once, to the
   assignment's row of the intermediate [M, I].
3. down GEMM, each row scaled by its router weight, to the assignment's row of [M, H]; a sum over
   k gives the layer's output. Assignments to experts this rank does not hold (id -1: expert
   parallelism) are sorted into no block and their rows stay zero.
Both GEMMs are the one kernel below (`GATED` picks the epilogue). fp32 accumulation throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_tensor, dot_in_f32, dot_precision


# One program holds an [M, E] one-hot tile, and its running count takes 4 bytes of shared memory
# per element: 2^16 elements (256 KiB) failed to launch on an H200 (227 KiB per block), 2^15 fits
# Hopper and Ampere. M = T*k <= 256 at 128 experts: decode batches up to 32 sequences at k = 8
# (more experts per rank under expert parallelism: fewer); past it the torch version runs.
ALIGN_KERNEL_MAX_ELEMENTS = 1 << 15


def _align_capacity(m: int, num_experts: int, block_m: int) -> int:
    """Rows the padded buffer can need: each held expert's run rounds up by < block_m rows."""
    return -(-(m + min(m, num_experts) * (block_m - 1)) // block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_ids [P] int32: assignment index t*k+j per row, M = padding;
    expert_ids [P / block_m] int32 local expert ids, -1 past the end; num_padded [1]). Experts
    [expert_offset, expert_offset + num_experts) are held here (expert parallelism); assignments
    to others (or -1) get no row. Within an expert, assignments keep their order (t*k+j ascending)."""
    m = topk_ids.numel()
    tile = triton.next_power_of_2(m) * triton.next_power_of_2(num_experts)
    if m == 0 or tile > ALIGN_KERNEL_MAX_ELEMENTS:
        return moe_align_torch(topk_ids, num_experts, block_m, expert_offset)
    cap = _align_capacity(m, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    _moe_align_kernel[(1,)](
        ids, sorted_ids, expert_ids, num_padded, m, num_experts, expert_offset, cap, cap // block_m,
        BLOCK_M=block_m, M_TILE=triton.next_power_of_2(m), E_TILE=triton.next_power_of_2(num_experts),
        B_TILE=triton.next_power_of_2(cap // block_m), FILL=min(1024, triton.next_power_of_2(cap)),
        num_warps=4 if tile <= 1 << 13 else 8,
    )
    return sorted_ids, expert_ids, num_padded


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, m, num_experts, expert_offset, cap,
                      num_blocks,
                      BLOCK_M: tl.constexpr, M_TILE: tl.constexpr, E_TILE: tl.constexpr, B_TILE: tl.constexpr,
                      FILL: tl.constexpr):
    # The torch version's arithmetic in one program: one-hot [M, E], its running count down
    # the assignments gives each one's rank within its expert; padded counts' prefix sums give
    # each expert's first row.
    for start in range(0, cap, FILL):  # padding rows say "no assignment" (m)
        offs = start + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + offs, tl.full((FILL,), 0, tl.int32) + m, mask=offs < cap)
    i = tl.arange(0, M_TILE)
    ids = tl.load(ids_ptr + i, mask=i < m, other=-1).to(tl.int32) - expert_offset
    held = (ids >= 0) & (ids < num_experts) & (i < m)  # not held: a row of zeros in the one-hot
    e = tl.arange(0, E_TILE)
    onehot = ((ids[:, None] == e[None, :]) & held[:, None]).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    counts = tl.sum(onehot, axis=0)
    padded = tl.where(e < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    dest = tl.sum(onehot * starts[None, :], axis=1) + rank
    tl.debug_barrier()  # the fill above lands before the scatter below
    tl.store(sorted_ids_ptr + dest, i, mask=held)
    b = tl.arange(0, B_TILE)
    # Block b belongs to the expert whose rows contain b * BLOCK_M: the count of experts that end at or before it.
    owner = tl.sum(((ends[None, :] <= (b * BLOCK_M)[:, None]) & (e < num_experts)[None, :]).to(tl.int32), axis=1)
    tl.store(expert_ids_ptr + b, tl.where(owner < num_experts, owner, -1), mask=b < num_blocks)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    expert_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align in torch ops (large batches; the single-program kernel's oracle)."""
    m = topk_ids.numel()
    dev = topk_ids.device
    ids = topk_ids.reshape(-1).long() - expert_offset
    ids = torch.where((ids < 0) | (ids >= num_experts), num_experts, ids)  # a sentinel expert, never given a block
    # Rank of each assignment within its expert, in assignment order: a running count per expert
    # ([M, E+1] compare + cumsum: no sort, no host read, deterministic).
    hits = ids[:, None] == torch.arange(num_experts + 1, device=dev)[None, :]
    running = hits.cumsum(0, dtype=torch.int32)
    counts = running[-1, :num_experts]
    rank = running.gather(1, ids[:, None]).squeeze(1) - 1
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    cap = _align_capacity(m, num_experts, block_m)
    held = ids < num_experts
    dest = torch.where(held, starts[ids.clamp(max=num_experts - 1)] + rank, cap)  # cap: a discarded slot
    sorted_ids = torch.full((cap + 1,), m, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, torch.arange(m, dtype=torch.int32, device=dev))
    block_first_row = torch.arange(0, cap, block_m, device=dev, dtype=ends.dtype)
    expert_ids = torch.searchsorted(ends, block_first_row, right=True).to(torch.int32)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_ids[:cap], expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_rows, N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr,  # assignment -> A row: its token (t = i // k) for gate|up, itself for down
    GATED: tl.constexpr,  # B holds [gate; up] (2N rows): C = silu(A Bg^T) * (A Bu^T)
    APPLY_WEIGHT: tl.constexpr,  # C rows scaled by the assignment's router weight
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    # Grid (P / BLOCK_M, cdiv(N, BLOCK_N)): one expert's BLOCK_M sorted rows x BLOCK_N columns.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < num_rows
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if DOT_F32:
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if APPLY_WEIGHT:
        w = tl.load(weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def moe_block_config(num_rows: int, num_experts: int) -> dict:
    """Tile sizes by the mean rows per expert: small tiles where each expert sees a token or two
    (decode; the weights' bytes dominate), larger ones where GEMMs are real. A first guess from
    the shapes, to be tuned on the card (bench/gpu_moe.py sweeps the alternatives)."""
    per_expert = num_rows / max(1, num_experts)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _gemm(a, b, c, weights, sorted_ids, expert_ids, num_padded, num_rows, n, k, a_row_div, gated, apply_weight,
          cfg) -> None:
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (sorted_ids.numel() // bm, triton.cdiv(n, bn))
    _moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_padded, num_rows, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        A_ROW_DIV=a_row_div, GATED=gated, APPLY_WEIGHT=apply_weight,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"],
        DOT_F32=dot_in_f32(a.dtype), PRECISION=dot_precision(a.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None, expert_offset: int = 0) -> torch.Tensor:
    """Triton version of reference.fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [T, k] float, topk_ids [T, k] int -> [T, H] in x's dtype. w13[i] / w2[i] are
    expert expert_offset + i; assignments to experts not held (or -1) contribute zero.
    `config`: tile sizes (default moe_block_config's)."""
    fn = "fused_moe"
    check_tensor(fn, "x", x, (None, None), FLOAT_DTYPES)
    t, h = x.shape
    check_tensor(fn, "w13", w13, (None, None, h), (x.dtype,))
    e, two_i, _ = w13.shape
    if two_i % 2:
        raise ValueError(f"{fn}: w13's rows must be [gate; up] (even), got {two_i}")
    inter = two_i // 2
    check_tensor(fn, "w2", w2, (e, h, inter), (x.dtype,))
    check_tensor(fn, "topk_ids", topk_ids, (t, None), INDEX_DTYPES)
    top_k = topk_ids.shape[1]
    check_tensor(fn, "topk_weights", topk_weights, (t, top_k), FLOAT_DTYPES)
    check_devices(fn, x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    if t == 0:
        return torch.empty_like(x)
    m = t * top_k
    cfg = config or moe_block_config(m, e)
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, e, cfg["BLOCK_M"], expert_offset)
    weights = topk_weights.reshape(-1).contiguous()
    inter_out = torch.empty((m, inter), dtype=x.dtype, device=x.device)  # padding rows never read
    _gemm(x, w13, inter_out, weights, sorted_ids, expert_ids, num_padded, m, inter, h, top_k, True, False, cfg)
    out = torch.zeros((m, h), dtype=x.dtype, device=x.device)  # rows of experts not held stay zero
    _gemm(inter_out, w2, out, weights, sorted_ids, expert_ids, num_padded, m, h, inter, 1, False, True, cfg)
    return out.view(t, top_k, h).sum(dim=1)
