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
2. gate|up GEMM with the activation (SiLU-and-mul) in its epilogue: a program computes BLOCK_N columns of both
   halves for BLOCK_M rows of one expert, and writes silu(gate) * up, rounded once, to the
   assignment's row of the intermediate [M, I].
3. down GEMM, each row scaled by its router weight, to the assignment's row of [M, H]; a sum over
   k gives the layer's output (`_moe_sum_kernel`: fp32, slot order). Assignments to experts this
   rank does not hold (id -1: expert parallelism) are sorted into no block, their rows are never
   written, and the sum skips them (no memset of [M, H] first).
Both GEMMs are the one kernel below (`GATED` picks the epilogue). fp32 accumulation throughout.

Decode batches (T <= decode_max_tokens()) take a second path with no sort at all: two GEMV launches,
the router weight applied in the gate|up epilogue and the top-k sum done inside the down pass
(section "Decode sizes" below). `fused_moe(path=...)` picks one explicitly (the bench's before/after).

FP8 weights (W8A16: FP8 MoE checkpoints, docs/quantization.md): w13 / w2 in e4m3 with fp32 scales,
activations in the compute dtype, fp32 accumulation, half the weight bytes. The grouped GEMM's
tiles go fp8 -> fp32 * scale -> compute dtype for the dot (the same bf16 weight values the
dequantize-at-load path computes); the decode GEMVs convert their tiles to fp32 as for bf16 and
scale each K step's partial sums (a step lies in one scale group), not every weight: scaling
every weight made them slower than bf16 (0.6x at 1 token on an H200, 1.65-2.03x faster now). Scales, one
layout for the three checkpoint formats, per expert [E, rows, groups]:
- `block` (bn, bk) = (128, 128): one scale per bn rows x bk columns, as published; w13's gate and
  up halves each start a new block row (gate's ceil(I / bn) rows, then up's), so I need not be a
  multiple of bn. A K step must not straddle a column group: BLOCK_K divides bk.
- `block` None: one scale per row, [E, rows, 1] (per-channel; per-tensor written into every row of
  its tensor, exact: gate, up and down keep their own scales), read at every K step (stride 0
  along K: the same cached [BLOCK_N] vector; one code path rather than an epilogue variant).
In the GEMM, scaling the tile before the dot rather than the partial products after it keeps one
accumulator and the bf16 dot; a constexpr `FP8` switch leaves bf16 weights' code exactly as it was.

MXFP4 weights (W4A16: gpt-oss as published, kernels/mxfp4.py's layout): w13 / w2 uint8, two e2m1
values a byte (even input in the low nibble), one E8M0 exponent byte per row and 32 inputs. The
kernels read the packed bytes as int32 words (a view: rows are 16-byte multiples, so each row's
4 words of an exponent group are one 16-byte load) and decode in registers: nibble J of a word
is input 8w + J, turned into an fp32 with 3 integer operations (_e2m1_word: sign and the 3
magnitude bits moved into fp32's fields, the value times 2^-126, exact, subnormal 0.5 included)
and 2^(s - 127) by writing s into an fp32 exponent field (s = 0 reads as 0, not 2^-127). Nothing
is interleaved: the activations' inputs 8w + J are loaded with a stride of 8, and
- the GEMVs (decode path) read activations already in fp32 times 2^64 (so that the products stay
  normal; `mx_activations` writes x so once per layer, the gate|up pass its intermediate rows,
  rounded to x's dtype first: no convert and no multiply a value in the K loops), sum nibble
  position J's products in place ([rows, groups, 4]), scale each step's sums by their group's
  exponent into [rows, groups, 4] accumulators kept over the whole K loop, and reduce those once
  after it (times 2^62); whole K steps load unmasked (_mxfp4_step), the partial last one masked.
  Per K step of gpt-oss-120b's default tiles the sm_90 SASS is 295-300 instructions for gate|up
  (4.6-4.7 a weight; 409-424 before) and 158 for the split down pass (4.9; 262-268), Triton 3.6
  and 3.9, counted by tools/sass_loop.py (docs/results/gpt-oss/2026-12-03-cpu-mxfp4-sass.md);
- the grouped GEMM (sorted path) with bf16 / fp16 activations hands each step's packed bytes and
  exponents to tl.dot_scaled (MX_DOT_SCALED, on in the default tiles: Triton decodes them for the
  tensor cores; 1.2-1.4x the 8 dots below at 64-512 tokens on an H200). Otherwise (fp32, or the knob
  off) it does 8 dots of K = BLOCK_K / 8 a step (a permutation of the sum
  over K), each on the decoded tile of one nibble position times 2^126 and its group's exponent,
  in the activations' dtype (exact in bf16). BLOCK_K is a multiple of 128 there. A sorted
  config's `MX_ONE_DOT: True` joins the 8 tiles into one operand in input order and does one dot
  a step on A's contiguous inputs (SASS for sm_90 at 16x64x128: 6 barriers a step instead of 34,
  A by 16-byte cp.async instead of 2-byte loads, 178 registers instead of 128): opt-in, not
  timed on a GPU yet (tools/gpu/mxfp4_kernel.sh SWEEP=1 compares it). Likewise a decode config's
  `GU_PREFETCH: True`: the gate|up GEMV loads the next K step's words before this step's FMAs
  (register double buffering against the load latency the GEMVs are bound by; 125 registers
  instead of 96; ptxas issues those loads late in the step, so the overlap is partial).
K steps cover whole exponent groups; the last one is masked (gpt-oss's H = I = 2880 is 90 groups).
More memory-level parallelism at small T, as decode config knobs (default off: the lead picks from
tools/gpu/mxfp4_decode.sh's sweep): `DOWN_SPLIT_K` s >= 1 runs the down pass as programs per
(token, column strip, expert slot, s-th BLOCK_K-aligned share of I) -- k x s the programs of the
one-program-per-strip GEMV, whose ~180 programs at T = 1 walk all of I serially -- each writing an
fp32 partial, summed in slot-then-share order by a small finish launch (no float atomics: the
same bits every run; CUDA-graph safe, buffers sized by shapes); it runs on bf16 and FP8 weights too,
the default for bf16 at one token (BF16_ONE_TOKEN_DOWN); `DOWN_REDUCE_HERE: True` sums the partials
in the same order inside that launch instead, by its last program of a (token, strip) to arrive
(kernels/arrivals.py; off: Qwen3-30B-A3B's bs=1 step measured 1-2% slower with it on an H100 and an
H200, docs/results/moe/2026-12-06-h200-moe-launches.md). `GU_SPLIT_K` s > 1 does the same
for gate|up (partials of gate and up; the finish adds the bias, activates, weights and stores in
nibble-major order). `GU_X_NM` has mx_activations write x in nibble-major order (the same launch)
so the gate|up GEMV's x loads are 16-byte vectors, as the down pass's are.
MXFP4 runs the decode path up to MXFP4_DECODE_MAX_TOKENS (16) tokens and has its own sorted tiles
(moe_block_config(mxfp4=True)); on an H200 this is 1.3-2.0x the previous MXFP4 kernels but still
below bf16 (docs/results/gpt-oss/2026-12-02-h200-mxfp4-kernel.md; tools/gpu/mxfp4_kernel.sh
measures, SWEEP=1 with alternative tiles).

gpt-oss's experts also add biases (w13_bias to gate|up before the activation, w2_bias to the down
output before the router weight, as reference.fused_moe_ref) and use its clamped SwiGLU
(kernels/moe_activation.py's SwigluOAI) in the gate|up epilogue; the decode path, whose
intermediate rows already carry the router weight, adds weight * w2_bias in the down pass.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from pdserve.kernels.arrivals import MAX_COUNTERS, last_arrival, reset_arrivals, strip_counters
from pdserve.kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_tensor, dot_in_f32, dot_precision
from pdserve.kernels.moe_activation import SILU_AND_MUL, MoeActivation, SwigluOAI, check_activation
from pdserve.kernels.moe_route import _route_rows
from pdserve.kernels.mxfp4 import BLOCK as MXFP4_GROUP
from pdserve.kernels.pdl import pdl_args, pdl_enter


# One program holds an [M, E] one-hot tile, and its running count takes 4 bytes of shared memory
# per element: 2^16 elements (256 KiB) failed to launch on an H200 (227 KiB per block), 2^15 fits
# Hopper and Ampere. M = T*k <= 256 at 128 experts: decode batches up to 32 sequences at k = 8
# (more experts per rank under expert parallelism: fewer); past it the torch version runs.
ALIGN_KERNEL_MAX_ELEMENTS = 1 << 15
FP8 = torch.float8_e4m3fn
MXFP4 = torch.uint8  # two e2m1 values a byte (kernels/mxfp4.py)


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
        **_align_tiles(m, num_experts, block_m), num_warps=4 if tile <= 1 << 13 else 8,
        **pdl_args(ids.device),
    )
    return sorted_ids, expert_ids, num_padded


@triton.jit
def _align_rows(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, m, num_experts, expert_offset, cap,
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


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, m, num_experts, expert_offset, cap,
                      num_blocks,
                      BLOCK_M: tl.constexpr, M_TILE: tl.constexpr, E_TILE: tl.constexpr, B_TILE: tl.constexpr,
                      FILL: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    _align_rows(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, m, num_experts, expert_offset, cap,
                num_blocks, BLOCK_M, M_TILE, E_TILE, B_TILE, FILL)


# num_tokens unspecialized: Triton would otherwise key a variant on T == 1 / T % 16 == 0 on top
# of the power-of-two tiles (tests/kernels/test_specialization.py: no compiles mid-traffic).
@triton.jit(do_not_specialize=["num_tokens"])
def _moe_route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                            num_tokens, router_experts, stride_t, num_experts, expert_offset, cap, num_blocks,
                            TOP_K: tl.constexpr, K_TILE: tl.constexpr, RENORMALIZE: tl.constexpr,
                            T_TILE: tl.constexpr, R_TILE: tl.constexpr,
                            BLOCK_M: tl.constexpr, M_TILE: tl.constexpr, E_TILE: tl.constexpr, B_TILE: tl.constexpr,
                            FILL: tl.constexpr, PDL: tl.constexpr = False):
    # One program: every token's routing (moe_route's arithmetic, rows at once), then the sort of
    # the ids it just wrote (read back after a block barrier: the same program's global writes).
    pdl_enter(PDL)
    _route_rows(logits_ptr, weights_ptr, ids_ptr, num_tokens, router_experts, stride_t,
                TOP_K, K_TILE, RENORMALIZE, T_TILE, R_TILE)
    tl.debug_barrier()
    _align_rows(ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_tokens * TOP_K, num_experts,
                expert_offset, cap, num_blocks, BLOCK_M, M_TILE, E_TILE, B_TILE, FILL)


def _align_tiles(m: int, num_experts: int, block_m: int) -> dict:
    cap = _align_capacity(m, num_experts, block_m)
    return dict(BLOCK_M=block_m, M_TILE=triton.next_power_of_2(m), E_TILE=triton.next_power_of_2(num_experts),
                B_TILE=triton.next_power_of_2(cap // block_m), FILL=min(1024, triton.next_power_of_2(cap)))


def route_align_fits(num_tokens: int, top_k: int, router_experts: int, num_experts: int) -> bool:
    """Whether moe_route_align runs as its one program (else it is moe_route + moe_align)."""
    m = num_tokens * top_k
    return (
        0 < m
        and triton.next_power_of_2(m) * triton.next_power_of_2(num_experts) <= ALIGN_KERNEL_MAX_ELEMENTS
        and triton.next_power_of_2(num_tokens) * triton.next_power_of_2(router_experts) <= ALIGN_KERNEL_MAX_ELEMENTS
    )


def moe_route_align(router_logits: torch.Tensor, top_k: int, renormalize: bool, num_experts: int, block_m: int,
                    expert_offset: int = 0):
    """moe_route then moe_align in one launch (decode batch sizes; larger ones: the two calls):
    router_logits [T, E_router] -> (weights [T, k] fp32, ids [T, k] int64, sorted_ids,
    expert_ids, num_padded) with moe_route's and moe_align's meanings and the same values."""
    from pdserve.kernels.moe_route import check_route_args

    t, router_experts = check_route_args("moe_route_align", router_logits, top_k)
    if not route_align_fits(t, top_k, router_experts, num_experts):
        from pdserve.kernels.moe_route import moe_route

        weights, ids = moe_route(router_logits, top_k, renormalize)
        return (weights, ids, *moe_align(ids, num_experts, block_m, expert_offset))
    dev = router_logits.device
    m = t * top_k
    tiles = _align_tiles(m, num_experts, block_m)
    cap = _align_capacity(m, num_experts, block_m)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=dev)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(cap // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    onehot = tiles["M_TILE"] * tiles["E_TILE"]
    _moe_route_align_kernel[(1,)](
        router_logits, weights, ids, sorted_ids, expert_ids, num_padded, t, router_experts, router_logits.stride(0),
        num_experts, expert_offset, cap, cap // block_m,
        TOP_K=top_k, K_TILE=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        T_TILE=triton.next_power_of_2(t), R_TILE=triton.next_power_of_2(router_experts), **tiles,
        num_warps=4 if onehot <= 1 << 13 else 8,
        **pdl_args(router_logits.device),
    )
    return weights, ids, sorted_ids, expert_ids, num_padded


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
def _e2m1_pair(q):
    # Packed bytes (int32) -> the e2m1 values of their low and high nibbles, fp32 (MXFP4 above).
    return _e2m1(q & 15), _e2m1(q >> 4)


@triton.jit
def _e2m1(code):
    # Sign bit 3, exponent bits 2-1, mantissa bit 0, written straight into fp32's bit fields
    # (integer ops only, no table, no conversion): magnitude codes 2-7 are 2^(e - 1) (1 + m / 2),
    # their e and m shifted into the exponent's low bits and the mantissa's top bit on top of
    # 0.5's pattern (0x3F000000: exponent 126); codes 0 and 1 (zero, the subnormal 0.5) are that
    # pattern times the code.
    v = code & 7
    half = 0x3F000000
    bits = tl.where(v < 2, v * half, (v << 22) + half) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(s):
    # An E8M0 exponent byte (int32) -> 2^(s - 127) as fp32: s is the float's exponent field.
    return (s << 23).to(tl.float32, bitcast=True)


# Powers of two that keep the word decoder's products in fp32's normal range (_e2m1_word): its
# values are the e2m1 value times 2^-126, the activations the GEMVs read are fp32 times 2^64
# (_mx_activations: exact), and the accumulated sums are scaled by 2^62 once (_mxfp4_total).
MX_X_SCALE = tl.constexpr(18446744073709551616.0)  # 2^64
MX_SUM_SCALE = tl.constexpr(4611686018427387904.0)  # 2^62
MX_UNSCALE = tl.constexpr(85070591730234615865843651857942052864.0)  # 2^126


@triton.jit
def _e2m1_word(words, J: tl.constexpr):
    # Nibble J (input 8w + J) of each int32 word w of packed bytes (little-endian: byte J // 2,
    # low nibble for even J) as an fp32 equal to its e2m1 value times 2^-126: the sign bit moved
    # to bit 31 and the 3 magnitude bits (2 exponent, 1 mantissa) to bits 24-22, fp32's low
    # exponent bits and top mantissa bit. e2m1 and fp32 share IEEE's structure, so the subnormal
    # code 0.5 lands on fp32's subnormal 2^-127 and every code is exact: 3 integer operations a
    # value, no select, no table, where _e2m1 takes ~8: the nibble shifted to the top (sign on
    # bit 31), an arithmetic shift right by 6 (magnitude on bits 24-22, the sign copied down over
    # bits 30-25: the words are int32, so >> is arithmetic) and one mask keeping bits 31 and 24-22
    # (0x81C00000) -- shift, shift, and, where moving sign and magnitude separately took two
    # shifts, two masks and an or. The GPU keeps fp32 subnormals in multiplies (Triton flushes
    # none outside libdevice).
    if J < 7:
        words = words << (28 - 4 * J)
    return ((words >> 6) & -2118123520).to(tl.float32, bitcast=True)  # 0x81C00000 as int32


@triton.jit
def _mx_activations(v, ROUND: tl.constexpr):
    # fp32 activations -> what the MXFP4 GEMVs read: rounded to ROUND first (the activation dtype:
    # the values a tensor of that dtype holds, so the result is the bits a bf16 / fp16 row gives;
    # None: fp32 as it is), times 2^64 (exact). Written once per row, so the K loops load fp32 with
    # no conversion and no multiply a value.
    if ROUND is not None:
        v = v.to(ROUND).to(tl.float32)
    return v * MX_X_SCALE


@triton.jit
def _mx_activations_kernel(x_ptr, out_ptr, K, stride_xm, stride_om, NIBBLE_MAJOR: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (T, cdiv(K, BLOCK)): x [T, K] (any float dtype, exact in fp32) -> out [T, K] fp32 times
    # 2^64, in nibble-major order (_mxfp4_nibble_major) or in input order.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < K
    v = tl.load(x_ptr + t * stride_xm + cols, mask=ok, other=0.0).to(tl.float32)
    dest = _mxfp4_nibble_major(cols) if NIBBLE_MAJOR else cols
    tl.store(out_ptr + t * stride_om + dest, _mx_activations(v, None), mask=ok)


@triton.jit
def _mxfp4_dots(q, x_ptrs, x_mask, X_J: tl.constexpr):
    # One K step of a [rows, groups, 4] word tile: nibble J of each word times the activations'
    # inputs 8w + J (x_ptrs + J * X_J: [1, groups, 4] fp32, _mx_activations' 2^64 already in; x_mask
    # None: all of them, else [1, groups, 1]), the
    # 8 nibble positions summed in place (an FMA a value). X_J = 1: inputs in their order (a
    # stride of 8 between words); X_J = 4: nibble-major order (_mxfp4_nibble_major: a group's 4
    # words' nibble J side by side, one 16-byte load).
    p = _e2m1_word(q, 0) * _mx_load(x_ptrs, x_mask)
    for j in tl.static_range(1, 8):
        p += _e2m1_word(q, j) * _mx_load(x_ptrs + j * X_J, x_mask)
    return p


@triton.jit
def _mx_load(ptrs, mask):
    # Activations of a K step: unmasked for a whole step (mask None), else zero past the end.
    if mask is None:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _mxfp4_exponent_groups(gs):
    # A [rows, groups, 4] word tile's exponent columns as [1, groups, 1], written (4g) // 4: Triton's
    # axis analysis then sees no contiguity along groups, as in the word tile (4 words apart), so
    # the exponents' load takes the words' thread layout instead of one that a shared-memory
    # conversion of the products undoes every step (Triton 3.6 for sm_90: 2 a gate|up step, 17
    # instructions of its 332).
    return (gs * 4 // 4)[None, :, None]


@triton.jit
def _mxfp4_word_exponents(s_ptrs, mask):
    # The E8M0 exponent bytes of a [rows, groups, 4] word tile as [rows, groups, 1] (one byte a
    # thread's 4 words, broadcast over them where the products are scaled: in the words' own layout,
    # no shuffle), as the fp32 2^(s - 127) (s = 0 reads as 0, not 2^-127).
    s = tl.load(s_ptrs, mask=mask, other=0).to(tl.int32)
    return (s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_scaled(acc, p, f):
    # acc [rows, groups, 4] + a step's products (_mxfp4_dots) times their group's 2^(s - 127) (f
    # [rows, groups, 1]: _mxfp4_word_exponents), one FMA a word: the accumulator keeps its shape
    # over the K loop and is reduced once after it (_mxfp4_total).
    return acc + p * f


@triton.jit
def _mxfp4_step(acc, q_ptrs, s_ptrs, x_ptrs, col_ok, g_ok, X_J: tl.constexpr):
    # One K step of a [rows, groups, 4] word tile into its accumulator: words, exponents, the 8
    # nibble positions' FMAs (_mxfp4_dots), scaled by the exponents (_mxfp4_scaled). g_ok None: a
    # whole step, masked by rows only, the activations unmasked, and the words of rows past the
    # end left undefined (any int32 decodes to a finite value, and those rows are never stored):
    # no predicate and no register zeroing a load, 26 of 184 instructions of a down step (sm_90).
    # g_ok [groups]: the partial last step, groups past K masked to zero.
    if g_ok is None:
        mask = col_ok[:, None, None]
        q = tl.load(q_ptrs, mask=mask)
        x_mask = None
    else:
        mask = col_ok[:, None, None] & g_ok[None, :, None]
        q = tl.load(q_ptrs, mask=mask, other=0)
        x_mask = g_ok[None, :, None]
    return _mxfp4_scaled(acc, _mxfp4_dots(q, x_ptrs, x_mask, X_J), _mxfp4_word_exponents(s_ptrs, mask))


@triton.jit
def _mxfp4_total(acc):
    # [rows, groups, 4] accumulator -> [rows]: its words and groups summed (a fixed tree: a row's
    # result does not depend on the batch), then 2^62 (the decoder's 2^-126 against x's 2^64).
    return tl.sum(tl.sum(acc, axis=2), axis=1) * MX_SUM_SCALE


@triton.jit
def _mxfp4_strip_loads(q_ptrs, s_ptrs, up_q, up_s, col_ok, g_ok):
    # One K step's loads of a gate|up strip (PREFETCH: issued a step ahead): gate's and up's
    # [rows, groups, 4] words and their exponents (_mxfp4_word_exponents; up's rows N further),
    # masked to the step's groups.
    mask = col_ok[:, None, None] & g_ok[None, :, None]
    return (tl.load(q_ptrs, mask=mask, other=0), tl.load(q_ptrs + up_q, mask=mask, other=0),
            _mxfp4_word_exponents(s_ptrs, mask), _mxfp4_word_exponents(s_ptrs + up_s, mask))


@triton.jit
def _mxfp4_nibble_major(cols):
    # Input c = 32g + 8w + J of an exponent group -> its place 32g + 4J + w: where the decode path's
    # gate|up pass writes its output for the down pass, whose [rows, groups, 4]-word tiles then
    # read the inputs of nibble J of a group's 4 words as 4 neighbours (an 8-byte load shared by
    # the thread's row, where input order needs 4 scalar loads: one load a weight value).
    return (cols // 32) * 32 + (cols % 8) * 4 + (cols % 32) // 8


@triton.jit
def _activate(gate, up, SWIGLU: tl.constexpr, alpha, limit):
    # The expert activation on fp32 gate / up (kernels/moe_activation.py): SiLU-and-mul, or
    # gpt-oss's clamped SwiGLU.
    if SWIGLU:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        h = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    else:
        h = gate / (1.0 + tl.exp(-gate)) * up
    return h


@triton.jit
def _mxfp4_tile(q, f, J: tl.constexpr, a):
    # Nibble J of each word of a [words, BLOCK_N] tile, times its group's 2^(s - 127) (f, fp32),
    # in A's dtype (exact in bf16: an e2m1 value times a power of two): the B operand of one of
    # the step's 8 dots (_moe_gemm_kernel).
    return (_e2m1_word(q, J) * MX_UNSCALE * f).to(a.dtype)


@triton.jit
def _mxfp4_operand(q, f, a):
    # The 8 nibble tiles of a [W, BLOCK_N] word tile joined into one [8W, BLOCK_N] operand in input
    # order (row 8w + J: nibble J of word w), so a K step is one dot against A's contiguous inputs
    # (MX_ONE_DOT) rather than 8 dots, each with its own trip through shared memory.
    d0 = _mxfp4_tile(q, f, 0, a)
    d1 = _mxfp4_tile(q, f, 1, a)
    d2 = _mxfp4_tile(q, f, 2, a)
    d3 = _mxfp4_tile(q, f, 3, a)
    d4 = _mxfp4_tile(q, f, 4, a)
    d5 = _mxfp4_tile(q, f, 5, a)
    d6 = _mxfp4_tile(q, f, 6, a)
    d7 = _mxfp4_tile(q, f, 7, a)
    # join's new last axis: J's bit 0, then bit 1, then bit 2 -> [W, N, b0, b1, b2]
    t = tl.join(tl.join(tl.join(d0, d1), tl.join(d2, d3)), tl.join(tl.join(d4, d5), tl.join(d6, d7)))
    t = tl.permute(t, (0, 4, 3, 2, 1))  # [W, b2, b1, b0, N]: row 8w + 4 b2 + 2 b1 + b0 = 8w + J
    return tl.reshape(t, (8 * q.shape[0], q.shape[1]))


@triton.jit
def _mx_dot_ptrs(w_ptr, s_ptr, e, cols, stride_we, stride_wn, stride_se, stride_sn, stride_sk, BLOCK_K: tl.constexpr):
    # An MXFP4 weight's first K step for tl.dot_scaled: [BLOCK_N, BLOCK_K / 2] byte pointers (w_ptr:
    # the int32 words of _mxfp4_words, strides in 16-byte units) and [BLOCK_N, BLOCK_K / 32] exponents.
    w8 = w_ptr.to(tl.pointer_type(tl.uint8))
    rows = cols[:, None].to(tl.int64)
    q_ptrs = w8 + e * (stride_we * 16) + rows * (stride_wn * 16) + tl.arange(0, BLOCK_K // 2)[None, :]
    s_ptrs = s_ptr + e * stride_se + rows * stride_sn + tl.arange(0, BLOCK_K // 32)[None, :] * stride_sk
    return q_ptrs, s_ptrs


@triton.jit
def _mx_dot_step(acc, a, q_ptrs, s_ptrs, col_ok, k_left, stride_sk, A_FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    # acc + a [M, BLOCK_K] (bf16 / fp16) x the step's MXFP4 columns: Triton's scaled dot decodes the
    # packed e2m1 bytes and applies each 32-input exponent on the way to the tensor cores (on sm_90 an
    # upcast to A's format, then mma), where the GEMV paths decode with integer ops on the FP32 lanes.
    # Masked bytes read 0 (e2m1 zero) under any exponent; k_left: inputs left from this step on.
    kb = tl.arange(0, BLOCK_K // 2)
    gk = tl.arange(0, BLOCK_K // 32)
    q = tl.load(q_ptrs, mask=col_ok[:, None] & (kb < k_left // 2)[None, :], other=0)
    s = tl.load(s_ptrs, mask=col_ok[:, None] & (gk < k_left // 32)[None, :], other=127)
    return tl.dot_scaled(a, None, A_FMT, tl.trans(q), s, "e2m1", acc)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weight_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, s_ptr, bias_ptr,
    num_rows, N, K,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_se, stride_sn, stride_sk, up_scale_rows, stride_bias_e, alpha, limit,
    A_ROW_DIV: tl.constexpr,  # assignment -> A row: its token (t = i // k) for gate|up, itself for down
    GATED: tl.constexpr,  # B holds [gate; up] (2N rows): C = act(A Bg^T, A Bu^T)
    APPLY_WEIGHT: tl.constexpr,  # C rows scaled by the assignment's router weight
    FP8: tl.constexpr,  # B is e4m3 with scales at s_ptr ("FP8 weights" above); else s_ptr is never read
    MXFP4: tl.constexpr,  # B is packed e2m1 [E, N, K / 2] with E8M0 exponents at s_ptr ("MXFP4 weights")
    HAS_BIAS: tl.constexpr,  # bias_ptr [E, N] (GATED: [E, 2N]) added before the activation / the weight
    SWIGLU: tl.constexpr,  # GATED: gpt-oss's clamped SwiGLU (alpha, limit), else SiLU-and-mul
    SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    MX_ONE_DOT: tl.constexpr = False,  # MXFP4: one dot a step on the joined operand (_mxfp4_operand)
    MX_DOT_SCALED: tl.constexpr = None,  # MXFP4 with bf16/fp16 A: tl.dot_scaled on the packed bytes (A's format)
    PDL: tl.constexpr = False,
):
    # Grid (P / BLOCK_M, cdiv(N, BLOCK_N)): one expert's BLOCK_M sorted rows x BLOCK_N columns.
    pdl_enter(PDL)
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if MXFP4 and MX_DOT_SCALED is not None:
        # The packed [BLOCK_N, BLOCK_K / 2] bytes and their [BLOCK_N, BLOCK_K / 32] exponents handed
        # to tl.dot_scaled as they are: Triton decodes e2m1 for the tensor cores (_mx_dot_step).
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
        q_ptrs, s_ptrs = _mx_dot_ptrs(b_ptr, s_ptr, expert, cols, stride_be, stride_bn, stride_se, stride_sn,
                                      stride_sk, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(a_ptrs, mask=row_ok[:, None] & (ks < K - k0)[None, :], other=0.0)
            acc = _mx_dot_step(acc, a, q_ptrs, s_ptrs, col_ok, K - k0, stride_sk, MX_DOT_SCALED, BLOCK_K)
            if GATED:
                acc_up = _mx_dot_step(acc_up, a, q_ptrs + N * (stride_bn * 16), s_ptrs + N * stride_sn, col_ok,
                                      K - k0, stride_sk, MX_DOT_SCALED, BLOCK_K)
            a_ptrs += BLOCK_K * stride_ak
            q_ptrs += BLOCK_K // 2
            s_ptrs += (BLOCK_K // 32) * stride_sk
    elif MXFP4:
        # b_ptr: the packed bytes as int32 words, stride_be / stride_bn in 16-byte units (x4 words
        # here, so the compiler sees 16-byte aligned rows: vector loads). A step is BLOCK_K / 8
        # words of each column's row, [words, BLOCK_N], word w holding inputs k0 + 8w .. 8w + 7.
        # Nibble J of every word meets A's columns k0 + 8w + J: eight dots of K = BLOCK_K / 8 a
        # step (a permutation of the sum over K), each on a decoded tile, nothing interleaved.
        W: tl.constexpr = BLOCK_K // 8
        wk = tl.arange(0, W)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + (8 * wk)[None, :] * stride_ak
        ks = tl.arange(0, BLOCK_K)
        a_full = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak  # MX_ONE_DOT's A: in input order
        q_ptrs = b_ptr + expert * (stride_be * 4) + cols[None, :].to(tl.int64) * (stride_bn * 4) + wk[:, None]
        s_ptrs = s_ptr + expert * stride_se + cols[None, :].to(tl.int64) * stride_sn + (wk // 4)[:, None] * stride_sk
        for k0 in range(0, K, BLOCK_K):
            w_ok = wk < (K - k0) // 8  # K is a multiple of 32: whole groups, whole words
            a_mask = row_ok[:, None] & w_ok[None, :]
            b_mask = w_ok[:, None] & col_ok[None, :]
            q = tl.load(q_ptrs, mask=b_mask, other=0)
            f = _e8m0(tl.load(s_ptrs, mask=b_mask, other=127).to(tl.int32))
            if GATED:
                q_up = tl.load(q_ptrs + N * (stride_bn * 4), mask=b_mask, other=0)
                f_up = _e8m0(tl.load(s_ptrs + N * stride_sn, mask=b_mask, other=127).to(tl.int32))
            if MX_ONE_DOT:
                a = tl.load(a_full, mask=row_ok[:, None] & (ks < K - k0)[None, :], other=0.0)
                if DOT_F32:
                    a = a.to(tl.float32)
                acc = tl.dot(a, _mxfp4_operand(q, f, a), acc, input_precision=PRECISION)
                if GATED:
                    acc_up = tl.dot(a, _mxfp4_operand(q_up, f_up, a), acc_up, input_precision=PRECISION)
            else:
                for j in tl.static_range(8):
                    a = tl.load(a_ptrs + j * stride_ak, mask=a_mask, other=0.0)
                    if DOT_F32:
                        a = a.to(tl.float32)
                    acc = tl.dot(a, _mxfp4_tile(q, f, j, a), acc, input_precision=PRECISION)
                    if GATED:
                        acc_up = tl.dot(a, _mxfp4_tile(q_up, f_up, j, a), acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            a_full += BLOCK_K * stride_ak
            q_ptrs += W
            s_ptrs += (BLOCK_K // 32) * stride_sk
    else:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None] * stride_bk
        s_ptrs = s_ptr + expert * stride_se + (cols // SCALE_ROWS) * stride_sn  # FP8 only: DCE'd otherwise
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if FP8:
                s = tl.load(s_ptrs + (k0 // GROUP_K) * stride_sk, mask=col_ok, other=0.0)
                b = (b.to(tl.float32) * s[None, :]).to(a_ptr.dtype.element_ty)
            if DOT_F32:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if FP8:
                    s_up = tl.load(s_ptrs + up_scale_rows * stride_sn + (k0 // GROUP_K) * stride_sk, mask=col_ok,
                                   other=0.0)
                    b_up = (b_up.to(tl.float32) * s_up[None, :]).to(a_ptr.dtype.element_ty)
                if DOT_F32:
                    b_up = b_up.to(tl.float32)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_bias_e
        acc += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        acc = _activate(acc, acc_up, SWIGLU, alpha, limit)
    if APPLY_WEIGHT:
        w = tl.load(weight_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_scales(fn, w13_scale, w2_scale, e, h, inter, block, config) -> None:
    if block is None:
        check_tensor(fn, "w13_scale", w13_scale, (e, 2 * inter, 1), (torch.float32,))
        check_tensor(fn, "w2_scale", w2_scale, (e, h, 1), (torch.float32,))
        return
    bn, bk = block
    check_tensor(fn, "w13_scale", w13_scale, (e, 2 * triton.cdiv(inter, bn), triton.cdiv(h, bk)), (torch.float32,))
    check_tensor(fn, "w2_scale", w2_scale, (e, triton.cdiv(h, bn), triton.cdiv(inter, bk)), (torch.float32,))
    steps = [v for key, v in (config or {}).items() if key.endswith("BLOCK_K")]
    if any(bk % v for v in steps):
        raise ValueError(f"{fn}: K tiles {steps} must divide the scales' {bk} columns (a step within one group)")


def moe_block_config(num_rows: int, num_experts: int, mxfp4: bool = False) -> dict:
    """Tile sizes by the mean rows per expert: small tiles where each expert sees a token or two
    (decode; the weights' bytes dominate), larger ones where GEMMs are real. A first guess from
    the shapes, to be tuned on the card (bench/moe.py sweeps the alternatives).
    `mxfp4`: MXFP4 weights' own tiles, on tl.dot_scaled (MX_DOT_SCALED; bf16 / fp16 activations,
    else the 8-dot integer decoders, whose BLOCK_K is a multiple of 128); every weight is decoded
    once per BLOCK_M rows, so larger batches take the larger row blocks sooner."""
    per_expert = num_rows / max(1, num_experts)
    if mxfp4:
        return dict(MXFP4_TILES[0 if per_expert <= 16 else 1], **MXFP4_ENV_SORTED_KNOBS)
    if per_expert <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


# moe_block_config's MXFP4 tiles: (decode batches, larger ones). tl.dot_scaled against the 8-dot
# integer decoders on one H200, gpt-oss-120b's layer (docs/results/gpt-oss/2026-12-03-h200-mxfp4-dot.md):
# 2.70 vs 3.87 ms at 512 tokens (bf16 2.20), 1.43 vs 1.71 at 64 (bf16 1.33); the decode GEMVs keep
# T <= 16, where dot_scaled's 16-row dot lost (0.64 vs 0.47 ms at 16 tokens in CUDA graphs).
MXFP4_TILES = (dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, MX_DOT_SCALED=True),
               dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, MX_DOT_SCALED=True))


def _mxfp4_words(q: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Packed MXFP4 bytes [E, N, K / 2] -> (the same memory as int32 words, expert and row strides
    in 16-byte units): the kernels load whole words and, knowing rows start 16-byte aligned, 16
    bytes at a time. A view, no copy: K / 2 bytes a row is a multiple of 16 (K of 32)."""
    if q.stride(-1) != 1 or q.stride(0) % 16 or q.stride(1) % 16 or q.storage_offset() % 16:
        raise ValueError(f"fused_moe: MXFP4 weights need rows starting at 16-byte multiples, contiguous within a "
                         f"row; got strides {q.stride()} at offset {q.storage_offset()}")
    return q.view(torch.int32), q.stride(0) // 16, q.stride(1) // 16


def _gemm(a, b, c, weights, sorted_ids, expert_ids, num_padded, num_rows, n, k, a_row_div, gated, apply_weight,
          cfg, scale=None, block=None, bias=None, activation: MoeActivation = SILU_AND_MUL) -> None:
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    grid = (sorted_ids.numel() // bm, triton.cdiv(n, bn))
    mxfp4 = b.dtype == MXFP4
    strides = (b.stride(0), b.stride(1), b.stride(2))
    if mxfp4:
        b, *rows = _mxfp4_words(b)
        strides = (*rows, 1)
    _moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, expert_ids, num_padded, b if scale is None else scale,
        b if bias is None else bias, num_rows, n, k,
        a.stride(0), a.stride(1), *strides, c.stride(0), c.stride(1),
        *_scale_args(scale, block, mxfp4), *_epilogue_args(bias, activation),
        A_ROW_DIV=a_row_div, GATED=gated, APPLY_WEIGHT=apply_weight, FP8=scale is not None and not mxfp4,
        MXFP4=mxfp4, HAS_BIAS=bias is not None, SWIGLU=isinstance(activation, SwigluOAI),
        SCALE_ROWS=block[0] if block else 1, GROUP_K=block[1] if block else 1,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"],
        DOT_F32=dot_in_f32(a.dtype), PRECISION=dot_precision(a.dtype), MX_ONE_DOT=cfg.get("MX_ONE_DOT", False),
        MX_DOT_SCALED=_mx_dot_format(cfg, "MX_DOT_SCALED", mxfp4, a.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl_args(a.device),
    )


def _epilogue_args(bias: torch.Tensor | None, activation: MoeActivation) -> tuple[int, float, float]:
    """(bias expert stride, alpha, limit) for a launch; zeros where unused (never read)."""
    alpha, limit = (activation.alpha, activation.limit) if isinstance(activation, SwigluOAI) else (0.0, 0.0)
    return (0 if bias is None else bias.stride(0)), float(alpha), float(limit)


# --- Decode sizes (T <= decode_max_tokens()): no sort, no [T*k, H] buffer, no separate sum -------
# At one token the sorted path is five launches around 75 MB of weights (align, memset, gate|up,
# down, the sum over k), and its 16-row tiles give the 8 experts' gate|up only 8 x 12 programs:
# fewer than the SMs (bench/moe.py's profile: ~32 us a layer for ~18 us of bytes). Here:
# 1. gate|up, one program per (assignment, BLOCK_N strip of I): a register GEMV of x's row
#    against the strip's gate and up rows (no 16-row padding: one real row per expert at T = 1),
#    epilogue silu(gate) * up times the router weight, rounded once, to the assignment's row.
#    The weight moves here from the down epilogue so that the down pass below is a plain sum.
#    Assignments of the same strip are neighbours in launch order, so two tokens that chose one
#    expert read its strip from DRAM once and from L2 the second time.
# 2. down, one program per (token, BLOCK_N strip of H): the token's k experts' [BLOCK_N, BLOCK_K]
#    tiles loaded as one [k, BLOCK_N, BLOCK_K] block per step (k times the bytes in flight of a
#    one-expert GEMV: these loads are not pipelined through shared memory, so this is what keeps
#    HBM busy), products summed over K, then over the k experts in registers: the top-k sum
#    happens inside the GEMM, in a fixed order, with no atomics, so results are bit-stable.
# Two launches, both sized by shapes alone (CUDA-graph capturable), nothing to zero first.

# Past this many tokens the sorted path runs: a first guess (at 8 tokens the sorted path already
# streams at ~75% of copy bandwidth on an H200, and the per-assignment GEMV reads an expert chosen
# by several tokens once per token, from L2 at best); bench/moe.py's decode table measures both.
DECODE_MAX_TOKENS = 4
# MXFP4 weights take the decode path further: their sorted GEMM decodes every weight once per
# 16-row block and its 8 dots a step convert each decoded tile for the tensor cores, the GEMVs
# decode straight into FMAs (reading an expert again per token, from L2). gpt-oss-120b's layer on
# an H200 in CUDA graphs: 0.359 vs 0.467 ms at 8 tokens, 0.695 vs 0.758 at 16
# (docs/results/gpt-oss/2026-12-02-h200-mxfp4-kernel.md).
MXFP4_DECODE_MAX_TOKENS = 16


def decode_max_tokens(mxfp4: bool) -> int:
    """The largest batch the "auto" path runs as decode GEMVs, by weight format."""
    return MXFP4_DECODE_MAX_TOKENS if mxfp4 else DECODE_MAX_TOKENS
# The sorted path's sum over k: False = _moe_sum_kernel (one launch), True = a memset of [T*k, H]
# first and torch's sum after (what ran before; bench/moe.py sets it for its "before" rows).
SUM_IN_TORCH = False
# fused_moe_routed: route and sort in one launch where it fits (False: moe_route, then the sort
# inside fused_moe, as before; bench/moe.py's "before" rows).
FUSE_ROUTE_ALIGN = True
MOE_PATHS = ("auto", "sorted", "decode")


# MXFP4 decode knobs by batch size (the module doc's split / nibble-major knobs): (largest T, knobs)
# in increasing T, the first entry that fits a batch joins moe_decode_config's tiles; empty = the
# base config at every size. The H200 sweep (tools/gpu/mxfp4_decode.sh) found one config within
# 5% of the best at 1, 4 and 16 tokens (now the base), so no entry is needed yet.
MXFP4_DECODE_KNOBS: tuple[tuple[int, dict], ...] = ()


def _env_knobs(name: str) -> dict:
    """Config knobs from a JSON object in the environment, for A/B runs of a whole engine on one
    card (tools/gpu/gpt_oss.sh): e.g. PDSERVE_MXFP4_SORTED_KNOBS='{"MX_DOT_SCALED": false}'. Checked by
    fused_moe like any config."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return {}
    try:
        knobs = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} must be a JSON object of config knobs, got {raw!r} ({e})") from None
    if not isinstance(knobs, dict):
        raise ValueError(f"{name} must be a JSON object of config knobs, got {raw!r}")
    return knobs


# Every MXFP4 batch's decode / sorted config gains these (after MXFP4_DECODE_KNOBS).
MXFP4_ENV_DECODE_KNOBS = _env_knobs("PDSERVE_MXFP4_DECODE_KNOBS")
MXFP4_ENV_SORTED_KNOBS = _env_knobs("PDSERVE_MXFP4_SORTED_KNOBS")
# And every bf16 / FP8 batch's decode config (after its own): PDSERVE_MOE_DECODE_KNOBS.
MOE_ENV_DECODE_KNOBS = _env_knobs("PDSERVE_MOE_DECODE_KNOBS")


# bf16 experts at one token: the down pass as programs per (column strip of 32, expert slot) over all
# of I (DOWN_SPLIT_K 1: k x the programs, fp32 partials summed in slot order by a finish launch)
# rather than one program per strip of 8 walking every slot's I: Qwen3-30B-A3B's step on an H200,
# same call, 3.35 -> 3.20 ms (the down pass 13.2 -> 8.5 + 1.2 us a layer); at 2 tokens the split
# was 3% slower in the layer, so only one token takes it
# (docs/results/moe/2026-12-04-h200-qwen3-moe-gate.md; tools/gpu/moe_down_split.sh).
BF16_ONE_TOKEN_DOWN = dict(DOWN_SPLIT_K=1, DOWN_BLOCK_N=32, DOWN_BLOCK_K=128, DOWN_WARPS=8)


def moe_decode_config(top_k: int, inter: int, group_k: int | None = None, fp8: bool = False,
                      mxfp4: bool = False, tokens: int | None = None) -> dict:
    """Decode tiles: gate|up strips of 16 rows (x 2 halves) by 256 of K, 4x the programs of the
    sorted path's 64-wide tiles at T = 1 (Qwen3-30B-A3B: 8 x 48 = 384 programs for 132 SMs);
    down blocks of ~64 weight rows ([k, BLOCK_N]) by 256 of I (128 where I is no multiple of
    256: no half-masked last step), 32 KB of bf16 per step, 256 programs. First guesses from the
    H200's measured GEMVs (kernels/fused_gemv.py: 16-32 row strips and 256-wide K were its best
    at M = 1), not measured on this kernel: `pdserve bench moe decode` sweeps alternatives.
    `group_k`: FP8 block scales' columns (128): K steps within one group, so at most 128 wide.
    `fp8` with per-row scales: gate|up steps of 512 (the bytes of bf16's 256): 15.2 -> 13.0 us at
    1 token for Qwen3-30B-A3B's layer in a CUDA graph on an H200 (bf16: 28.3; at 4 tokens the best
    tiles also stepped 512: 40.1 vs 43.2). The rest of that sweep (row strips 8-32, down K 128-512,
    4 or 8 warps; block scales' tiles) moved the time by about 1 us: left as they are. One layer
    replayed ten times a graph: its 38 MB of FP8 experts may sit partly in L2, so read the ranking,
    not the bandwidth.
    `mxfp4`: bf16's row strips, gate|up and down steps of 256 inputs, 4 warps each, x in
    nibble-major order (GU_X_NM) and the down pass split in 2 over K (DOWN_SPLIT_K, partials summed
    in a fixed order): the best or within 5% of it at 1, 4 and 16 tokens of 21 configs swept on an
    H200 for gpt-oss-120b's layer in CUDA graphs: 0.048 / 0.134 / 0.468 ms against 0.075 / 0.187 /
    0.621 for the plain GEMVs of 512-input gate|up steps, bf16 0.065 / 0.192 / 0.573
    (docs/results/gpt-oss/2026-12-02-h200-mxfp4-decode.md). Other MXFP4-only knobs (absent = off):
    GU_SPLIT_K, GU_PREFETCH (the module doc's MXFP4 section); with `tokens`, MXFP4_DECODE_KNOBS'
    entry for that batch size. bf16 experts at `tokens` = 1: the split down pass (BF16_ONE_TOKEN_DOWN)."""
    k_tile = triton.next_power_of_2(top_k)
    if mxfp4:
        cfg = dict(GU_BLOCK_N=16, GU_BLOCK_K=256, GU_WARPS=4, DOWN_BLOCK_N=max(8, 64 // k_tile), DOWN_BLOCK_K=256,
                   DOWN_WARPS=4, GU_X_NM=True, DOWN_SPLIT_K=2)
        if tokens is not None:
            cfg.update(next((knobs for most, knobs in MXFP4_DECODE_KNOBS if tokens <= most), {}))
        cfg.update(MXFP4_ENV_DECODE_KNOBS)
        return cfg
    cap = group_k or 256
    gu_k = 512 if fp8 and group_k is None else min(256, cap)
    cfg = dict(GU_BLOCK_N=16, GU_BLOCK_K=gu_k, GU_WARPS=4, DOWN_BLOCK_N=max(8, 64 // k_tile),
               DOWN_BLOCK_K=min(256 if inter % 256 == 0 else 128, cap), DOWN_WARPS=8)
    if tokens == 1 and not fp8:
        cfg.update(BF16_ONE_TOKEN_DOWN)
    cfg.update(MOE_ENV_DECODE_KNOBS)
    return cfg


@triton.jit
def _moe_decode_gate_up_kernel(x_ptr, w13_ptr, inter_ptr, ids_ptr, weight_ptr, s_ptr, bias_ptr, N, K, num_experts,
                               expert_offset, stride_xm, stride_we, stride_wn, stride_im,
                               stride_se, stride_sn, stride_sk, up_scale_rows, stride_bias_e, alpha, limit,
                               TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               FP8: tl.constexpr, MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
                               SWIGLU: tl.constexpr, SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr,
                               PREFETCH: tl.constexpr = False, X_NM: tl.constexpr = False,
                               SPLIT: tl.constexpr = 1, part_ptr=None, ROUND: tl.constexpr = None,
                               PDL: tl.constexpr = False):
    # Grid (T*k, cdiv(I, BLOCK_N)[, SPLIT]): assignment a = t*k + j, columns [n*BLOCK_N, +BLOCK_N) of I.
    # PREFETCH (MXFP4): the next K step's words loaded before this step's FMAs (register double
    # buffering: two steps' loads in flight, where each step otherwise waits for its own).
    # MXFP4: x_ptr is fp32 times 2^64 (_mx_activations, by the caller) and the intermediate rows go
    # out the same way (fp32 times 2^64, rounded to ROUND first: the down pass's activations).
    # X_NM (MXFP4): x already in nibble-major order (_mxfp4_nibble_major, by the caller): nibble J's
    # inputs of a group's 4 words are 4 neighbours (one 16-byte load) instead of 4 loads 32 bytes apart.
    # SPLIT > 1 (MXFP4): program (.., .., s) sums only its share of the K steps and writes its fp32
    # gate and up partial sums to part_ptr [SPLIT, T*k, 2, N]; _moe_decode_gate_up_finish sums
    # them in split order and applies the epilogue (SPLIT x the programs, each 1/SPLIT of the steps).
    pdl_enter(PDL)
    a = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + a).to(tl.int64) - expert_offset
    if (e < 0) | (e >= num_experts):  # held by another rank (or -1): the down pass skips the row
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    x_row = x_ptr + (a // TOP_K).to(tl.int64) * stride_xm
    k_begin = 0
    k_end = K
    if SPLIT > 1:  # this program's steps: a BLOCK_K-aligned share, so groups never straddle splits
        per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
        k_begin = tl.program_id(2) * per
        k_end = tl.maximum(tl.minimum(K, k_begin + per), k_begin)  # a share past K: empty, not negative
    acc_gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    if MXFP4:
        # w13_ptr: the packed bytes as int32 words, stride_we / stride_wn in 16-byte units. A
        # step's words as a [BLOCK_N, groups, 4] tile: a row's 4 words of one exponent group are
        # 16 contiguous bytes (one vector load), word w holding inputs 8w .. 8w + 7. Each nibble
        # position J is a pass of FMAs against x's inputs 8w + J (_mxfp4_dots); each step's
        # products are scaled by their group's exponent into [BLOCK_N, groups, 4] accumulators
        # reduced once after the loop (_mxfp4_total).
        gs = tl.arange(0, BLOCK_K // 32)
        word = gs[:, None] * 4 + tl.arange(0, 4)[None, :]
        q_ptrs = (w13_ptr + e * (stride_we * 4) + cols[:, None, None].to(tl.int64) * (stride_wn * 4)
                  + (k_begin // BLOCK_K) * (BLOCK_K // 8) + word[None, :, :])
        s_ptrs = (s_ptr + e * stride_se + cols[:, None, None].to(tl.int64) * stride_sn
                  + (k_begin // 32 + _mxfp4_exponent_groups(gs)) * stride_sk)
        if X_NM:
            x_ptrs = x_row + (32 * gs[:, None] + tl.arange(0, 4)[None, :])[None, :, :]
        else:
            x_ptrs = x_row + 8 * word[None, :, :]
        up_q, up_s = N * (stride_wn * 4), N * stride_sn
        mx_gate = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], dtype=tl.float32)
        mx_up = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], dtype=tl.float32)
        x_j = 4 if X_NM else 1
        if PREFETCH:  # step 0's words now; each step then loads the next one's before its FMAs
            q_gate, q_up, s_gate, s_up = _mxfp4_strip_loads(q_ptrs, s_ptrs, up_q, up_s, col_ok,
                                                            gs < (k_end - k_begin) // 32)
            for k0 in range(k_begin, k_end, BLOCK_K):
                x_mask = (gs < (k_end - k0) // 32)[None, :, None]
                q_ptrs += BLOCK_K // 8
                s_ptrs += (BLOCK_K // 32) * stride_sk
                n_gate, n_up, ns_gate, ns_up = _mxfp4_strip_loads(q_ptrs, s_ptrs, up_q, up_s, col_ok,
                                                                  gs < (k_end - k0 - BLOCK_K) // 32)
                mx_gate = _mxfp4_scaled(mx_gate, _mxfp4_dots(q_gate, x_ptrs + k0, x_mask, x_j), s_gate)
                mx_up = _mxfp4_scaled(mx_up, _mxfp4_dots(q_up, x_ptrs + k0, x_mask, x_j), s_up)
                q_gate, q_up, s_gate, s_up = n_gate, n_up, ns_gate, ns_up
        else:  # whole steps without group masks, then the partial last one (_mxfp4_step)
            whole_end = k_begin + (k_end - k_begin) // BLOCK_K * BLOCK_K
            for k0 in range(k_begin, whole_end, BLOCK_K):
                mx_gate = _mxfp4_step(mx_gate, q_ptrs, s_ptrs, x_ptrs + k0, col_ok, None, x_j)
                mx_up = _mxfp4_step(mx_up, q_ptrs + up_q, s_ptrs + up_s, x_ptrs + k0, col_ok, None, x_j)
                q_ptrs += BLOCK_K // 8
                s_ptrs += (BLOCK_K // 32) * stride_sk
            if whole_end < k_end:
                g_ok = gs < (k_end - whole_end) // 32
                mx_gate = _mxfp4_step(mx_gate, q_ptrs, s_ptrs, x_ptrs + whole_end, col_ok, g_ok, x_j)
                mx_up = _mxfp4_step(mx_up, q_ptrs + up_q, s_ptrs + up_s, x_ptrs + whole_end, col_ok, g_ok, x_j)
        acc_gate = _mxfp4_total(mx_gate)
        acc_up = _mxfp4_total(mx_up)
        if SPLIT > 1:  # partial sums out; the finish kernel adds the bias and activates
            part = part_ptr + ((tl.program_id(2) * tl.num_programs(0) + a).to(tl.int64) * 2) * N + cols
            tl.store(part, acc_gate, mask=col_ok)
            tl.store(part + N, acc_up, mask=col_ok)
            return
    else:
        ks = tl.arange(0, BLOCK_K)
        gate_ptrs = w13_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
        s_ptrs = s_ptr + e * stride_se + (cols // SCALE_ROWS) * stride_sn  # FP8 only: DCE'd otherwise
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            # x loaded as a [1, BLOCK_K] tile, in the weight tile's layout (no conversion per step).
            xk = tl.load(x_row + k0 + ks[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
            mask = col_ok[:, None] & k_ok[None, :]
            g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(gate_ptrs + N * stride_wn, mask=mask, other=0.0).to(tl.float32)
            if FP8:  # a step lies in one scale group: scale its [BLOCK_N] partial sums, not the tile
                s_k = s_ptrs + (k0 // GROUP_K) * stride_sk
                acc_gate += tl.sum(g * xk, axis=1) * tl.load(s_k, mask=col_ok, other=0.0)
                acc_up += tl.sum(u * xk, axis=1) * tl.load(s_k + up_scale_rows * stride_sn, mask=col_ok, other=0.0)
            else:
                acc_gate += tl.sum(g * xk, axis=1)
                acc_up += tl.sum(u * xk, axis=1)
            gate_ptrs += BLOCK_K
    if HAS_BIAS:
        bias_row = bias_ptr + e * stride_bias_e
        acc_gate += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc_up += tl.load(bias_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + a).to(tl.float32)
    h = _activate(acc_gate, acc_up, SWIGLU, alpha, limit) * w
    if MXFP4:  # the order and scale the down pass reads
        tl.store(inter_ptr + a.to(tl.int64) * stride_im + _mxfp4_nibble_major(cols), _mx_activations(h, ROUND),
                 mask=col_ok)
    else:
        tl.store(inter_ptr + a.to(tl.int64) * stride_im + cols, h.to(inter_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _moe_decode_down_kernel(inter_ptr, w2_ptr, out_ptr, ids_ptr, weight_ptr, s_ptr, bias_ptr, N, K, num_experts,
                            expert_offset, stride_im, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_sk,
                            stride_bias_e,
                            TOP_K: tl.constexpr, K_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            FP8: tl.constexpr, MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr,
                            SCALE_ROWS: tl.constexpr, GROUP_K: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (T, cdiv(H, BLOCK_N)): token t's output columns [n*BLOCK_N, +BLOCK_N), all k experts.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    js = tl.arange(0, K_TILE)
    e = tl.load(ids_ptr + t * TOP_K + js, mask=js < TOP_K, other=-1).to(tl.int64) - expert_offset
    held = (js < TOP_K) & (e >= 0) & (e < num_experts)  # not held: its row was never written, never read
    e = tl.where(held, e, 0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if MXFP4:
        # The gate|up kernel's [BLOCK_N, groups, 4]-word tiles, one per expert of the token
        # (unrolled: the k experts' loads are independent, so k tiles are in flight a step),
        # scaled into one [BLOCK_N, groups, 4] accumulator in slot order and reduced once after
        # the loop: the top-k sum inside the GEMV, as below.
        gs = tl.arange(0, BLOCK_K // 32)
        word = gs[:, None] * 4 + tl.arange(0, 4)[None, :]
        mx = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            for j in tl.static_range(TOP_K):
                e_j = tl.load(ids_ptr + t * TOP_K + j).to(tl.int64) - expert_offset
                held_j = (e_j >= 0) & (e_j < num_experts)
                e_j = tl.where(held_j, e_j, 0)
                g_ok = gs < tl.where(held_j, (K - k0) // 32, 0)  # not held: no group of it is read
                # The step's first word as (k0 / BLOCK_K) * (BLOCK_K / 8): visibly a multiple of 4 words.
                q_ptrs = (w2_ptr + e_j * (stride_we * 4) + cols[:, None, None].to(tl.int64) * (stride_wn * 4)
                          + (k0 // BLOCK_K) * (BLOCK_K // 8) + word[None, :, :])
                s_ptrs = (s_ptr + e_j * stride_se + cols[:, None, None].to(tl.int64) * stride_sn
                          + (k0 // 32 + _mxfp4_exponent_groups(gs)) * stride_sk)
                mask = col_ok[:, None, None] & g_ok[None, :, None]
                q = tl.load(q_ptrs, mask=mask, other=0)
                # The intermediate row in nibble-major order, fp32 times 2^64 (the gate|up pass
                # wrote it so): nibble n of word w of group g meets element 32g + 4n + w.
                a_ptrs = (inter_ptr + (t * TOP_K + j) * stride_im + (k0 // BLOCK_K) * BLOCK_K
                          + (32 * gs[:, None] + tl.arange(0, 4)[None, :])[None, :, :])
                mx = _mxfp4_scaled(mx, _mxfp4_dots(q, a_ptrs, g_ok[None, :, None], 4),
                                   _mxfp4_word_exponents(s_ptrs, mask))
        out = _mxfp4_total(mx)
    else:
        ks = tl.arange(0, BLOCK_K)
        # The intermediate rows as a [k, 1, BLOCK_K] block: broadcast against the weights' block as loaded.
        a_ptrs = inter_ptr + (t * TOP_K + js)[:, None, None] * stride_im + ks[None, None, :]
        w_ptrs = (w2_ptr + e[:, None, None] * stride_we + cols[None, :, None].to(tl.int64) * stride_wn
                  + ks[None, None, :])
        s_ptrs = s_ptr + e[:, None] * stride_se + (cols // SCALE_ROWS)[None, :] * stride_sn  # [k, BLOCK_N]; FP8 only
        acc = tl.zeros([K_TILE, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=held[:, None, None] & k_ok[None, None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=held[:, None, None] & col_ok[None, :, None] & k_ok[None, None, :],
                        other=0.0).to(tl.float32)
            if FP8:  # one scale group a step: scale the [k, BLOCK_N] partial sums
                s = tl.load(s_ptrs + (k0 // GROUP_K) * stride_sk, mask=held[:, None] & col_ok[None, :], other=0.0)
                acc += tl.sum(w * a, axis=2) * s
            else:
                acc += tl.sum(w * a, axis=2)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out = tl.sum(acc, axis=0)  # the top-k sum: over the k experts, in registers
    if HAS_BIAS:  # weight * (down + bias): the intermediate row already carries the weight, the bias does not
        wj = tl.load(weight_ptr + t * TOP_K + js, mask=held, other=0.0).to(tl.float32)
        b = tl.load(bias_ptr + e[:, None] * stride_bias_e + cols[None, :], mask=held[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
        out += tl.sum(b * wj[:, None], axis=0)
    tl.store(out_ptr + t * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _moe_decode_gate_up_finish(part_ptr, inter_ptr, ids_ptr, weight_ptr, bias_ptr, N, num_experts, expert_offset,
                               stride_im, stride_bias_e, alpha, limit, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                               HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, ROUND: tl.constexpr,
                               PDL: tl.constexpr = False):
    # Grid (T*k, cdiv(I, BLOCK_N)): the gate|up kernel's SPLIT partial sums of assignment a, summed
    # in split order (fixed: the same bits every run), then its epilogue (bias, activation, router
    # weight) and the nibble-major, pre-scaled store the down pass reads (_mx_activations).
    pdl_enter(PDL)
    a = tl.program_id(0)
    e = tl.load(ids_ptr + a).to(tl.int64) - expert_offset
    if (e < 0) | (e >= num_experts):
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.num_programs(0)
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        part = part_ptr + ((s * rows + a).to(tl.int64) * 2) * N + cols
        gate += tl.load(part, mask=col_ok, other=0.0)
        up += tl.load(part + N, mask=col_ok, other=0.0)
    if HAS_BIAS:
        bias_row = bias_ptr + e * stride_bias_e
        gate += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        up += tl.load(bias_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    h = _activate(gate, up, SWIGLU, alpha, limit) * tl.load(weight_ptr + a).to(tl.float32)
    tl.store(inter_ptr + a.to(tl.int64) * stride_im + _mxfp4_nibble_major(cols), _mx_activations(h, ROUND),
             mask=col_ok)


@triton.jit
def _moe_decode_down_split_kernel(inter_ptr, w2_ptr, part_ptr, ids_ptr, weight_ptr, s_ptr, bias_ptr, N, K,
                                  num_experts, expert_offset, stride_im, stride_we, stride_wn, stride_se, stride_sn,
                                  stride_sk, stride_bias_e, out_ptr, counter_ptr, stride_om, TOP_K: tl.constexpr,
                                  SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                  HAS_BIAS: tl.constexpr, FP8: tl.constexpr = False, MXFP4: tl.constexpr = True,
                                  SCALE_ROWS: tl.constexpr = 1, GROUP_K: tl.constexpr = 1,
                                  REDUCE_HERE: tl.constexpr = False, PDL: tl.constexpr = False):
    # The down pass with k x SPLIT times the programs of _moe_decode_down_kernel: grid
    # (T, cdiv(H, BLOCK_N), k * SPLIT), program (t, n, j * SPLIT + s) = token t's expert slot j,
    # columns [n*BLOCK_N, +BLOCK_N), the s-th BLOCK_K-aligned share of I's steps. Its fp32 sum
    # (plus weight * bias in share 0) goes to part_ptr [k * SPLIT, T, H]; _moe_decode_down_finish
    # adds the k * SPLIT partials in that fixed order (no float atomics: the same bits every run),
    # or with REDUCE_HERE the (token, strip)'s last program to arrive does, in the same order
    # (kernels/arrivals.py; counter_ptr: int32 zeros, one per token and strip, left zero).
    # A slot whose expert is held elsewhere writes zeros (its intermediate row is never read).
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    pid_p = tl.program_id(2)
    j = pid_p // SPLIT
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    k_begin = (pid_p % SPLIT) * per
    k_end = tl.maximum(tl.minimum(K, k_begin + per), k_begin)  # a share past K: empty, not negative
    e = tl.load(ids_ptr + t * TOP_K + j).to(tl.int64) - expert_offset
    held = (e >= 0) & (e < num_experts)
    e = tl.where(held, e, 0)
    k_end = tl.where(held, k_end, k_begin)  # not held: no step, no byte of it read
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if MXFP4:
        gs = tl.arange(0, BLOCK_K // 32)
        word = gs[:, None] * 4 + tl.arange(0, 4)[None, :]
        q_row = (w2_ptr + e * (stride_we * 4) + cols[:, None, None].to(tl.int64) * (stride_wn * 4)
                 + word[None, :, :])
        s_row = (s_ptr + e * stride_se + cols[:, None, None].to(tl.int64) * stride_sn
                 + _mxfp4_exponent_groups(gs) * stride_sk)
        # The intermediate row in nibble-major order, fp32 times 2^64, as _moe_decode_down_kernel reads it.
        a_ptrs = (inter_ptr + (t * TOP_K + j) * stride_im
                  + (32 * gs[:, None] + tl.arange(0, 4)[None, :])[None, :, :])
        mx = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], dtype=tl.float32)
        # Whole steps without group masks, then the partial last one (_mxfp4_step). A step's first
        # word as (k0 / BLOCK_K) * (BLOCK_K / 8): visibly a multiple of 4 words (16-byte loads).
        whole_end = k_begin + (k_end - k_begin) // BLOCK_K * BLOCK_K
        for k0 in range(k_begin, whole_end, BLOCK_K):
            mx = _mxfp4_step(mx, q_row + (k0 // BLOCK_K) * (BLOCK_K // 8), s_row + (k0 // 32) * stride_sk,
                             a_ptrs + (k0 // BLOCK_K) * BLOCK_K, col_ok, None, 4)
        if whole_end < k_end:
            mx = _mxfp4_step(mx, q_row + (whole_end // BLOCK_K) * (BLOCK_K // 8),
                             s_row + (whole_end // 32) * stride_sk, a_ptrs + (whole_end // BLOCK_K) * BLOCK_K, col_ok,
                             gs < (k_end - whole_end) // 32, 4)
        out = _mxfp4_total(mx)
    else:
        # bf16 / FP8 rows: [BLOCK_N, BLOCK_K] weight tiles against the slot's intermediate row (in
        # input order, the activations' dtype), FP8's scale group applied to each step's sums as in
        # _moe_decode_down_kernel (a step lies in one group: BLOCK_K divides GROUP_K).
        ks = tl.arange(0, BLOCK_K)
        w_ptrs = w2_ptr + e * stride_we + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
        a_row = inter_ptr + (t * TOP_K + j) * stride_im + ks
        s_row = s_ptr + e * stride_se + (cols // SCALE_ROWS) * stride_sn  # FP8 only: DCE'd otherwise
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            k_ok = ks < k_end - k0
            a = tl.load(a_row + k0, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + k0, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            if FP8:
                acc += tl.sum(w * a[None, :], axis=1) * tl.load(s_row + (k0 // GROUP_K) * stride_sk, mask=col_ok,
                                                                other=0.0)
            else:
                acc += tl.sum(w * a[None, :], axis=1)
        out = acc
    if HAS_BIAS:  # weight * bias, once per slot (share 0); the intermediate row already carries the weight
        first = held & (pid_p % SPLIT == 0)
        wj = tl.where(first, tl.load(weight_ptr + t * TOP_K + j).to(tl.float32), 0.0)
        b = tl.load(bias_ptr + e * stride_bias_e + cols, mask=col_ok, other=0.0).to(tl.float32)
        out += wj * b
    tl.store(part_ptr + (pid_p * tl.num_programs(0) + t) * N + cols, out, mask=col_ok)
    if REDUCE_HERE:
        group = t * tl.num_programs(1) + pid_n
        if last_arrival(counter_ptr, group, TOP_K * SPLIT):
            _sum_parts(part_ptr, out_ptr, t, tl.num_programs(0), N, stride_om, cols, col_ok, TOP_K * SPLIT, ".cg")
            reset_arrivals(counter_ptr, group)


@triton.jit
def _sum_parts(part_ptr, out_ptr, t, num_tokens, N, stride_om, cols, col_ok, PARTS: tl.constexpr,
               CACHE: tl.constexpr):
    # Token t's PARTS fp32 partials of `cols` summed in slot-then-share order, cast once, stored.
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for p in tl.static_range(PARTS):
        acc += tl.load(part_ptr + (p * num_tokens + t) * N + cols, mask=col_ok, other=0.0, cache_modifier=CACHE)
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _moe_decode_down_finish(part_ptr, out_ptr, N, stride_om, PARTS: tl.constexpr, BLOCK_N: tl.constexpr,
                            PDL: tl.constexpr = False):
    # Grid (T, cdiv(H, BLOCK_N)): token t's PARTS fp32 partials summed in slot-then-share order, cast once.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _sum_parts(part_ptr, out_ptr, t, tl.num_programs(0), N, stride_om, cols, cols < N, PARTS, "")


def _scale_args(scale: torch.Tensor | None, block: tuple[int, int] | None,
                mxfp4: bool = False) -> tuple[int, int, int, int]:
    """(expert, row, K-group strides, up half's first scale row) of a quantized weight's scales;
    zeros for bf16 weights (never read). FP8 per-row scales: K stride 0, the one column at every
    step. MXFP4: one exponent per row and 32 inputs, [E, rows, K / 32]."""
    if scale is None:
        return 0, 0, 0, 0
    return scale.stride(0), scale.stride(1), scale.stride(2) if block or mxfp4 else 0, scale.shape[1] // 2


# The finish kernels' column blocks (a sum of a few fp32 rows: any width streams).
FINISH_BLOCK_N = 256


def _decode_weights(w, scale, block):
    """(quant constexprs, the weight as the kernels read it, its expert and row strides): MXFP4 as
    int32 words with strides in 16-byte units (_mxfp4_words)."""
    mxfp4 = w.dtype == MXFP4
    quant = dict(FP8=scale is not None and not mxfp4, MXFP4=mxfp4, SCALE_ROWS=block[0] if block else 1,
                 GROUP_K=block[1] if block else 1)
    if mxfp4:
        w, *rows = _mxfp4_words(w)
        return quant, w, rows
    return quant, w, (w.stride(0), w.stride(1))


# tl.dot_scaled's name for the activations' format; MXFP4 with other activations (fp32) keeps the
# integer decoders whatever a config asks. The decode GEMVs have no scaled-dot form: a 16-row dot
# with one real row measured 2-5x slower than their integer decoders on an H200 at 1-64 tokens
# (docs/results/gpt-oss/2026-12-03-h200-mxfp4-dot.md).
_DOT_SCALED_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _mx_dot_format(cfg: dict, key: str, mxfp4: bool, dtype: torch.dtype) -> str | None:
    """A's format for tl.dot_scaled where `cfg[key]` asks for the tensor-core MXFP4 path and it can
    run, else None."""
    return _DOT_SCALED_FORMATS.get(dtype) if mxfp4 and cfg.get(key, False) else None


# mx_activations' columns a program (a row of gpt-oss is 2880: 3 programs a token).
MX_ACTIVATIONS_BLOCK = 1024
# The activation dtype the MXFP4 GEMVs' intermediate rows are rounded to before their 2^64 (the
# values a row of x's dtype holds, as the sorted path's and the reference's intermediate).
_MX_ROUND = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: None}


def mx_activations(x: torch.Tensor, nibble_major: bool) -> torch.Tensor:
    """x [T, K] (float) -> [T, K] fp32 times 2^64, what the MXFP4 decode GEMVs read (_mx_activations),
    in nibble-major order (_mxfp4_nibble_major) or input order: one small launch per layer."""
    t, k = x.shape
    out = torch.empty((t, k), dtype=torch.float32, device=x.device)
    _mx_activations_kernel[(t, triton.cdiv(k, MX_ACTIVATIONS_BLOCK))](
        x, out, k, x.stride(0), out.stride(0), NIBBLE_MAJOR=nibble_major, BLOCK=MX_ACTIVATIONS_BLOCK, num_warps=4,
        **pdl_args(x.device))
    return out


def _decode_gate_up(x, w13, weights, topk_ids, expert_offset, cfg, w13_scale=None, block=None, w13_bias=None,
                    activation: MoeActivation = SILU_AND_MUL) -> torch.Tensor:
    """Decode pass 1: [T*k, I] intermediate rows (router weight applied). MXFP4: fp32 rows rounded
    to x's dtype then times 2^64 (_mx_activations), in nibble-major order; x goes through
    mx_activations first. MXFP4 config knobs: GU_PREFETCH, GU_X_NM (x in nibble-major order, from
    the same launch), GU_SPLIT_K (> 1: K split over that many programs per strip, fp32 partials, a
    finish launch)."""
    t, h = x.shape
    e, two_i = w13.shape[:2]
    inter, top_k = two_i // 2, topk_ids.shape[1]
    mxfp4 = w13.dtype == MXFP4
    ids = topk_ids.reshape(-1)
    quant, w13, w13_rows = _decode_weights(w13, w13_scale, block)
    split = cfg.get("GU_SPLIT_K", 1) if mxfp4 else 1
    x_nm = mxfp4 and cfg.get("GU_X_NM", False)
    round_to = _MX_ROUND[x.dtype] if mxfp4 else None
    if mxfp4:
        x = mx_activations(x, x_nm)
    # Rows of assignments held elsewhere are never written and never read (masked in the down pass).
    inter_out = torch.empty((t * top_k, inter), dtype=torch.float32 if mxfp4 else x.dtype, device=x.device)
    part = torch.empty((split, t * top_k, 2, inter), dtype=torch.float32, device=x.device) if split > 1 else None
    bias_stride, alpha, limit = _epilogue_args(w13_bias, activation)
    grid = (t * top_k, triton.cdiv(inter, cfg["GU_BLOCK_N"])) + ((split,) if split > 1 else ())
    swiglu = isinstance(activation, SwigluOAI)
    _moe_decode_gate_up_kernel[grid](
        x, w13, inter_out, ids, weights, w13 if w13_scale is None else w13_scale,
        w13 if w13_bias is None else w13_bias, inter, h, e, expert_offset,
        x.stride(0), *w13_rows, inter_out.stride(0), *_scale_args(w13_scale, block, mxfp4),
        bias_stride, alpha, limit,
        TOP_K=top_k, BLOCK_N=cfg["GU_BLOCK_N"], BLOCK_K=cfg["GU_BLOCK_K"], HAS_BIAS=w13_bias is not None,
        SWIGLU=swiglu, **quant, num_warps=cfg["GU_WARPS"],
        PREFETCH=mxfp4 and cfg.get("GU_PREFETCH", False), X_NM=x_nm, SPLIT=split, part_ptr=part, ROUND=round_to,
        **pdl_args(x.device),
    )
    if split > 1:
        _moe_decode_gate_up_finish[(t * top_k, triton.cdiv(inter, FINISH_BLOCK_N))](
            part, inter_out, ids, weights, w13 if w13_bias is None else w13_bias, inter, e, expert_offset,
            inter_out.stride(0), bias_stride, alpha, limit, SPLIT=split, BLOCK_N=FINISH_BLOCK_N,
            HAS_BIAS=w13_bias is not None, SWIGLU=swiglu, ROUND=round_to, num_warps=4, **pdl_args(part.device))
    return inter_out


def _decode_down(inter_out, w2, weights, topk_ids, expert_offset, cfg, w2_scale=None, block=None, w2_bias=None,
                 activation: MoeActivation = SILU_AND_MUL, out_dtype=None) -> torch.Tensor:
    """Decode pass 2: [T, H] in out_dtype (default the intermediate's dtype: MXFP4's is fp32 times
    2^64, so its callers name the activations'), the top-k sum inside. Knob DOWN_SPLIT_K (any weight format): 0 =
    one program per (token, column strip) over all k experts and all of I; s >= 1 = programs per (token, strip,
    expert slot, s-th share of I) writing fp32 partials, summed in a fixed order by a finish launch, or
    with DOWN_REDUCE_HERE by the last of them to arrive (the same sum, one launch fewer)."""
    t, top_k = topk_ids.shape
    e, h, inter = w2.shape[0], w2.shape[1], inter_out.shape[1]
    mxfp4 = w2.dtype == MXFP4
    ids = topk_ids.reshape(-1)
    quant, w2, w2_rows = _decode_weights(w2, w2_scale, block)
    out = torch.empty((t, h), dtype=out_dtype or inter_out.dtype, device=inter_out.device)
    split = cfg.get("DOWN_SPLIT_K", 0)
    bias_stride = _epilogue_args(w2_bias, activation)[0]
    if split:
        part = torch.empty((top_k * split, t, h), dtype=torch.float32, device=out.device)
        strips = triton.cdiv(h, cfg["DOWN_BLOCK_N"])
        # The finish in the same launch where the counters cover every (token, strip).
        here = cfg.get("DOWN_REDUCE_HERE", False) and t * strips <= MAX_COUNTERS
        _moe_decode_down_split_kernel[(t, strips, top_k * split)](
            inter_out, w2, part, ids, weights, w2 if w2_scale is None else w2_scale,
            w2 if w2_bias is None else w2_bias, h, inter, e, expert_offset, inter_out.stride(0), *w2_rows,
            *_scale_args(w2_scale, block, mxfp4)[:3], bias_stride, out,
            strip_counters(out.device) if here else part, out.stride(0),
            TOP_K=top_k, SPLIT=split, BLOCK_N=cfg["DOWN_BLOCK_N"], BLOCK_K=cfg["DOWN_BLOCK_K"],
            HAS_BIAS=w2_bias is not None, **quant, REDUCE_HERE=here, num_warps=cfg["DOWN_WARPS"],
            **pdl_args(inter_out.device))
        if not here:
            _moe_decode_down_finish[(t, triton.cdiv(h, FINISH_BLOCK_N))](
                part, out, h, out.stride(0), PARTS=top_k * split, BLOCK_N=FINISH_BLOCK_N, num_warps=4,
                **pdl_args(part.device))
        return out
    _moe_decode_down_kernel[(t, triton.cdiv(h, cfg["DOWN_BLOCK_N"]))](
        inter_out, w2, out, ids, weights, w2 if w2_scale is None else w2_scale, w2 if w2_bias is None else w2_bias,
        h, inter, e, expert_offset, inter_out.stride(0), *w2_rows, out.stride(0),
        *_scale_args(w2_scale, block, mxfp4)[:3], bias_stride,
        TOP_K=top_k, K_TILE=triton.next_power_of_2(top_k), BLOCK_N=cfg["DOWN_BLOCK_N"],
        BLOCK_K=cfg["DOWN_BLOCK_K"], HAS_BIAS=w2_bias is not None, **quant, num_warps=cfg["DOWN_WARPS"],
        **pdl_args(inter_out.device),
    )
    return out


def _fused_moe_decode(x, w13, w2, weights, topk_ids, expert_offset, cfg, w13_scale=None, w2_scale=None,
                      block=None, w13_bias=None, w2_bias=None,
                      activation: MoeActivation = SILU_AND_MUL) -> torch.Tensor:
    inter_out = _decode_gate_up(x, w13, weights, topk_ids, expert_offset, cfg, w13_scale, block, w13_bias,
                                activation)
    return _decode_down(inter_out, w2, weights, topk_ids, expert_offset, cfg, w2_scale, block, w2_bias, activation,
                        out_dtype=x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None, expert_offset: int = 0,
              path: str = "auto", align: tuple | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              activation: MoeActivation = SILU_AND_MUL) -> torch.Tensor:
    """Triton version of reference.fused_moe_ref: x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights [T, k] float, topk_ids [T, k] int -> [T, H] in x's dtype. w13[i] / w2[i] are
    expert expert_offset + i; assignments to experts not held (or -1) contribute zero.
    `path`: "sorted" (align + grouped GEMMs + sum), "decode" (two GEMV launches, the sum inside
    the down pass), "auto" = decode up to decode_max_tokens() tokens (a shape test: a CUDA graph
    replays the path it captured). `config`: tile sizes of the path that runs (default
    moe_block_config's / moe_decode_config's); a sorted-path config (BLOCK_M) makes "auto" sorted.
    `align`: moe_align's (sorted_ids, expert_ids, num_padded) for these ids at the config's BLOCK_M,
    already made (moe_route_align: routing and sort in one launch); implies the sorted path.
    FP8 weights: w13 / w2 in e4m3 with fp32 `w13_scale` [E, 2 ceil(I / bn), ceil(H / bk)] and
    `w2_scale` [E, ceil(H / bn), ceil(K / bk)] for `block` (bn, bk), or one per row ([E, 2I, 1],
    [E, H, 1]) for `block` None (the module doc's "FP8 weights").
    MXFP4 weights: w13 / w2 uint8 [E, 2I, H / 2], [E, H, I / 2] with uint8 exponents `w13_scale`
    [E, 2I, H / 32], `w2_scale` [E, H, I / 32] (kernels/mxfp4.py's layout; H, I multiples of 32).
    `w13_bias` [E, 2I] (gate | up), `w2_bias` [E, H]: added to the expert's gate|up before the
    activation and to its down output before the router weight multiplies. `activation`:
    SiluAndMul() or gpt-oss's SwigluOAI(alpha, limit) (kernels/moe_activation.py)."""
    fn = "fused_moe"
    check_tensor(fn, "x", x, (None, None), FLOAT_DTYPES)
    t, h = x.shape
    fp8, mxfp4 = w13.dtype == FP8, w13.dtype == MXFP4
    e, inter = _check_weights(fn, x, w13, w2, w13_scale, w2_scale, block, config)
    check_activation(fn, activation)
    if w13_bias is not None:
        check_tensor(fn, "w13_bias", w13_bias, (e, 2 * inter), FLOAT_DTYPES)
    if w2_bias is not None:
        check_tensor(fn, "w2_bias", w2_bias, (e, h), FLOAT_DTYPES)
    check_tensor(fn, "topk_ids", topk_ids, (t, None), INDEX_DTYPES)
    top_k = topk_ids.shape[1]
    check_tensor(fn, "topk_weights", topk_weights, (t, top_k), FLOAT_DTYPES)
    biases = {name: v for name, v in (("w13_bias", w13_bias), ("w2_bias", w2_bias)) if v is not None}
    check_devices(fn, x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, **biases)
    if any(v.stride(-1) != 1 for v in biases.values()):
        raise ValueError(f"{fn}: w13_bias and w2_bias must be contiguous in their last dimension")
    if path not in MOE_PATHS:
        raise ValueError(f"{fn}: path must be one of {', '.join(MOE_PATHS)}, got {path!r}")
    if t == 0:
        return torch.empty_like(x)
    weights = topk_weights.reshape(-1).contiguous()
    # The decode kernels index the last dimension with unit stride (model parameters always are).
    unit = all(v.stride(-1) == 1 for v in (x, w13, w2))
    if path == "decode" and not unit:
        raise ValueError(f"{fn}: the decode path needs x, w13 and w2 contiguous in their last dimension")
    sorted_cfg = config is not None and "BLOCK_M" in config
    if align is not None:
        if path == "decode" or not sorted_cfg:
            raise ValueError(f"{fn}: align is for the sorted path, with the config (BLOCK_M) it was made for")
        cap = _align_capacity(t * top_k, e, config["BLOCK_M"])
        if len(align) != 3 or align[0].shape != (cap,) or align[1].shape != (cap // config["BLOCK_M"],):
            raise ValueError(f"{fn}: align does not match {t * top_k} assignments, {e} experts and BLOCK_M "
                             f"{config['BLOCK_M']} (sorted_ids of {cap} rows expected)")
        path = "sorted"
    epilogue = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=activation)
    if path == "decode" or (path == "auto" and unit and not sorted_cfg and t <= decode_max_tokens(mxfp4)):
        cfg = config if config is not None and not sorted_cfg else moe_decode_config(
            top_k, inter, block[1] if fp8 and block else None, fp8=fp8, mxfp4=mxfp4, tokens=t)
        return _fused_moe_decode(x, w13, w2, weights, topk_ids, expert_offset, cfg, w13_scale, w2_scale, block,
                                 **epilogue)
    m = t * top_k
    cfg = config if sorted_cfg else moe_block_config(m, e, mxfp4)
    sorted_ids, expert_ids, num_padded = align or moe_align(topk_ids, e, cfg["BLOCK_M"], expert_offset)
    inter_out = torch.empty((m, inter), dtype=x.dtype, device=x.device)  # padding rows never read
    _gemm(x, w13, inter_out, weights, sorted_ids, expert_ids, num_padded, m, inter, h, top_k, True, False, cfg,
          w13_scale, block, w13_bias, activation)
    if SUM_IN_TORCH:  # as before _moe_sum_kernel (bench/moe.py's "before" rows)
        out = torch.zeros((m, h), dtype=x.dtype, device=x.device)
        _gemm(inter_out, w2, out, weights, sorted_ids, expert_ids, num_padded, m, h, inter, 1, False, True, cfg,
              w2_scale, block, w2_bias)
        return out.view(t, top_k, h).sum(dim=1)
    out = torch.empty((m, h), dtype=x.dtype, device=x.device)  # rows of experts not held: never written, never read
    _gemm(inter_out, w2, out, weights, sorted_ids, expert_ids, num_padded, m, h, inter, 1, False, True, cfg,
          w2_scale, block, w2_bias)
    return _sum_over_k(out, topk_ids, e, expert_offset)


def _check_weights(fn, x, w13, w2, w13_scale, w2_scale, block, config) -> tuple[int, int]:
    """The experts' weights and scales against x: (E, I). bf16-like weights in x's dtype, e4m3
    with fp32 scales, or MXFP4 (uint8) with uint8 exponents; the format is w13's dtype."""
    h = x.shape[1]
    fp8, mxfp4 = w13.dtype == FP8, w13.dtype == MXFP4
    if mxfp4 and h % MXFP4_GROUP:
        raise ValueError(f"{fn}: MXFP4 weights need H a multiple of {MXFP4_GROUP}, got {h}")
    k13 = h // 2 if mxfp4 else h
    check_tensor(fn, "w13", w13, (None, None, k13), (w13.dtype,) if fp8 or mxfp4 else (x.dtype,))
    e, two_i, _ = w13.shape
    if two_i % 2:
        raise ValueError(f"{fn}: w13's rows must be [gate; up] (even), got {two_i}")
    inter = two_i // 2
    if mxfp4 and inter % MXFP4_GROUP:
        raise ValueError(f"{fn}: MXFP4 weights need I a multiple of {MXFP4_GROUP}, got {inter}")
    check_tensor(fn, "w2", w2, (e, h, inter // 2 if mxfp4 else inter), (w13.dtype,))
    quantized = fp8 or mxfp4
    if quantized != (w13_scale is not None) or quantized != (w2_scale is not None):
        raise ValueError(f"{fn}: e4m3 weights take w13_scale and w2_scale (as uint8 MXFP4 weights do), other "
                         f"weights neither; got {w13.dtype} weights")
    if fp8:
        _check_scales(fn, w13_scale, w2_scale, e, h, inter, block, config)
    if mxfp4:
        if block is not None:
            raise ValueError(f"{fn}: MXFP4 weights have one exponent per 32 inputs; block is for FP8, got {block}")
        check_tensor(fn, "w13_scale", w13_scale, (e, two_i, h // MXFP4_GROUP), (torch.uint8,))
        check_tensor(fn, "w2_scale", w2_scale, (e, h, inter // MXFP4_GROUP), (torch.uint8,))
        steps = [v for key, v in (config or {}).items() if key.endswith("BLOCK_K")]
        eight_dots = not (config or {}).get("MX_DOT_SCALED", False) or x.dtype not in _DOT_SCALED_FORMATS
        if any(v % MXFP4_GROUP for v in steps) or (eight_dots and (config or {}).get("BLOCK_K", 128) % 128):
            raise ValueError(f"{fn}: K tiles {steps} must be multiples of {MXFP4_GROUP} for MXFP4 weights "
                             f"(a step covers whole exponent groups), the sorted path's BLOCK_K of 128 unless "
                             f"MX_DOT_SCALED runs (bf16 / fp16 x; the 8 dots a step have K = BLOCK_K / 8, "
                             f"at least 16)")
    for key in ("MX_DOT_SCALED", "MX_ONE_DOT", "GU_X_NM", "GU_PREFETCH", "DOWN_REDUCE_HERE"):
        if not isinstance((config or {}).get(key, False), bool):
            raise ValueError(f"{fn}: config {key} must be True or False, got {config[key]!r}")
    for key, least in (("GU_SPLIT_K", 1), ("DOWN_SPLIT_K", 0)):
        v = (config or {}).get(key, least)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"{fn}: config {key} must be an int >= {least}, got {v!r}")
    if quantized:
        check_devices(fn, x=x, w13_scale=w13_scale, w2_scale=w2_scale)
    return e, inter


@triton.jit
def _moe_sum_kernel(rows_ptr, ids_ptr, out_ptr, N, num_experts, expert_offset, stride_rm, stride_om,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (T, cdiv(H, BLOCK)): token t's k rows summed in fp32 in slot order (the same bits every
    # run), rounded once; rows of experts not held here are skipped, so nothing has to zero them.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + j).to(tl.int64) - expert_offset
        limit = tl.where((e >= 0) & (e < num_experts), N, 0)  # not held: a column limit of 0
        acc += tl.load(rows_ptr + (t * TOP_K + j) * stride_rm + cols, mask=cols < limit, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _sum_over_k(rows: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, expert_offset: int) -> torch.Tensor:
    """[T*k, H] weighted expert outputs -> [T, H]: one launch where torch needed two (the memset of
    the rows of experts not held, then the sum)."""
    t, top_k = topk_ids.shape
    h = rows.shape[1]
    out = torch.empty((t, h), dtype=rows.dtype, device=rows.device)
    block = min(1024, triton.next_power_of_2(h))
    _moe_sum_kernel[(t, triton.cdiv(h, block))](rows, topk_ids.reshape(-1), out, h, num_experts, expert_offset,
                                                rows.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block,
                                                num_warps=4, **pdl_args(rows.device))
    return out


def fused_moe_routed(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                     renormalize: bool, expert_offset: int = 0, *, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                     w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                     activation: MoeActivation = SILU_AND_MUL) -> torch.Tensor:
    """The MoE layer from the router's logits: moe_route then fused_moe (reference.fused_moe_routed_ref),
    with the fewest launches per batch size: up to decode_max_tokens() the routing kernel and the
    decode path; above it, while the one-program sort fits (decode batches up to ~32 at E = 128),
    routing and sort as one launch (moe_route_align) and the sorted path; past that the separate
    routing kernel and the torch sort. The keywords are fused_moe's (FP8 / MXFP4 weights, biases,
    the activation)."""
    from pdserve.kernels.moe_route import moe_route

    kw = dict(w13_scale=w13_scale, w2_scale=w2_scale, block=block, w13_bias=w13_bias, w2_bias=w2_bias,
              activation=activation)
    t, e = x.shape[0], w13.shape[0]
    above = t > decode_max_tokens(w13.dtype == MXFP4)
    if FUSE_ROUTE_ALIGN and above and route_align_fits(t, top_k, router_logits.shape[-1], e):
        cfg = moe_block_config(t * top_k, e, w13.dtype == MXFP4)
        weights, ids, *align = moe_route_align(router_logits, top_k, renormalize, e, cfg["BLOCK_M"], expert_offset)
        return fused_moe(x, w13, w2, weights, ids, config=cfg, expert_offset=expert_offset, align=tuple(align), **kw)
    weights, ids = moe_route(router_logits, top_k, renormalize)
    return fused_moe(x, w13, w2, weights, ids, expert_offset=expert_offset, **kw)
