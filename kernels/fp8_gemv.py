"""FP8 weights times unquantized activations for decode-sized M (<= 64 rows): out = x @ (W8 * S)^T.

Why a second FP8 GEMM: at M = 1..16 a linear layer is a pass over its weight, and the FP8
weight is half the bytes of bf16. But the W8A8 paths (dynamic activation quantization, then
torch._scaled_mm or fp8_block_gemm) measured slower than bf16 there on an H200 (Llama-3.1-8B
shapes, M = 1: qkv 31.8 / 48.7 us against bf16's 23.8; docs/fp8-gpu-results.md): an extra launch
for the quantization, and cuBLASLt's row-wise-scaled FP8 kernels are built for large tiles. Here
the weight is read once, converted to the activation dtype in registers, and multiplied with
the activations as they are (no activation quantization: closer to the fp32 reference than W8A8,
and the same values the CPU's dequantizing path computes).

Grid (cdiv(N, BLOCK_N), SPLIT_K): a program streams BLOCK_N rows of W over one K range. With
few rows (N = 4096 at 32 rows is 128 programs on a 132-SM card) one pass per row block leaves
the memory system idle between loads, so K is split and the fp32 partial sums are added in a
fixed order (the same bits on every run): by a second small kernel, or, with REDUCE_IN_KERNEL, by
each strip's last slice program (a per-strip arrival counter, as kernels/fused_gemv.py; at bs=1
the second launch costs about what a slice's reads do). M = 1 multiplies
and sums in registers; M > 1 pads M to 16, 32 or 64 rows for a tensor-core dot (compute is free
here; the loads are what count). Scales: per output channel ([N] or [1, N]: applied once at the end), or
128-column groups ([ceil(N / scale_rows), ceil(K / 128)]: per K step, BLOCK_K dividing 128; or, at
one row with each strip inside one row of scales, K steps of several whole groups, each column of x
scaled by its group's scale: the per-channel path's long K steps, which group scales otherwise
forbid).
Tiles per shape: a measured table (fp8_gemv_configs.py, written by bench/fp8_gemv_tune.py) where it
has the card and shape, else the rule in `default_config`. CUDA-graph capturable: no host sync,
only outputs allocated. Reference: reference.fp8_gemv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.arrivals import MAX_COUNTERS, last_arrival, reset_arrivals, strip_counters
from pdserve.kernels.fused_gemv import PROLOGUES, norm_rstd, prologue_operands, prologue_tile
from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor, dot_in_f32, dot_precision, num_sms
from pdserve.kernels.pdl import pdl_args, pdl_enter


FP8 = torch.float8_e4m3fn
# The kernel's row limit: a batch of up to 64 rows is still a pass over the weight (Llama-3.1-8B's
# layers at M = 64: 2 x 64 FLOP a weight byte, below the card's ~300 FLOP/B); where the engine
# switches to the W8A8 GEMMs is worker/quantization/fp8_linear.fp8_gemm_path.
MAX_M = 64
GROUP_K = 128


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, final_ptr, counter_ptr, res_ptr, g_ptr, new_res_ptr,
                     M, N, K, K_SPLIT, SPLITS, eps, stride_xm,
                     stride_wn, stride_sn, stride_os, stride_om, stride_fm, stride_rm, stride_nm,
                     REDUCE_HERE: tl.constexpr, BLOCKED: tl.constexpr, SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr,
                     DOT_F32: tl.constexpr, PRECISION: tl.constexpr, ONE_ROW: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EARLY_W: tl.constexpr = False, WIDE: tl.constexpr = False, PDL: tl.constexpr = False,
                     PROLOGUE: tl.constexpr = 0, HAS_RESIDUAL: tl.constexpr = False):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    k_begin = pid_s * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    # The activation rows (one, or BLOCK_M padded), for the prologue helpers of kernels/fused_gemv.py.
    rows = tl.arange(0, 1 if ONE_ROW else BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]: k is contiguous
    if WIDE:  # the strip lies in one row of group scales: that row's scales, one per 128 columns
        s_ptr += (pid_n * BLOCK_N // SCALE_ROWS) * stride_sn
    if EARLY_W:
        # One row: the program's first weight tile is loaded before the PDL wait (kernels/pdl.py's
        # one exception: no kernel of a step writes a weight, so the read cannot be stale), so the
        # load overlaps the previous kernel's tail; its product is taken after the wait, and the
        # loop goes on from the second tile.
        k = k_begin + offs_k
        w_first = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & (k < k_end)[None, :], other=0.0)
    pdl_enter(PDL)
    rstd = tl.zeros((1 if ONE_ROW else BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 1:  # rms_norm, two-pass: 1 / rms over the whole row first (x + residual written by (0, 0))
        rstd = norm_rstd(x_rows, res_ptr, new_res_ptr, rows, row_ok, (pid_n == 0) & (pid_s == 0), M, K, eps,
                         stride_rm, stride_nm, HAS_RESIDUAL, 1 if ONE_ROW else BLOCK_M, BLOCK_K)
    if EARLY_W:
        x = _row_x(x_ptr, x_rows, res_ptr, g_ptr, new_res_ptr, rows, row_ok, pid_n, M, K, k_begin, k_end, offs_k,
                   stride_rm, stride_nm, rstd, PROLOGUE, HAS_RESIDUAL, BLOCK_K)
        acc = _one_row_step(tl.zeros((BLOCK_N,), dtype=tl.float32), w_first, x, s_ptr, offs_n, mask_n, k_begin,
                            k_end, offs_k, stride_sn, BLOCKED, SCALE_ROWS, GROUP, WIDE)
        k_first = k_begin + BLOCK_K
    else:
        k_first = k_begin
        if ONE_ROW:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        else:
            offs_m = tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, k_end, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < k_end
        w = tl.load(w_rows + k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if ONE_ROW:
            x = _row_x(x_ptr, x_rows, res_ptr, g_ptr, new_res_ptr, rows, row_ok, pid_n, M, K, k0, k_end, offs_k,
                       stride_rm, stride_nm, rstd, PROLOGUE, HAS_RESIDUAL, BLOCK_K)
            acc = _one_row_step(acc, w, x, s_ptr, offs_n, mask_n, k0, k_end, offs_k, stride_sn, BLOCKED,
                                SCALE_ROWS, GROUP, WIDE)
        else:
            if PROLOGUE == 0:
                x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                            mask=(offs_m < M)[:, None] & mask_k[None, :], other=0.0)
            else:
                x, _ = prologue_tile(rstd, k0, x_rows, res_ptr, g_ptr, new_res_ptr, rows, row_ok, pid_n, M, K,
                                     stride_rm, stride_nm, rstd, PROLOGUE, HAS_RESIDUAL, True, BLOCK_K)
            wt = tl.trans(w.to(x.dtype))
            if DOT_F32:  # the interpreter's bf16 dot is wrong (launch.dot_in_f32)
                x, wt = x.to(tl.float32), wt.to(tl.float32)
            part = tl.dot(x, wt, input_precision=PRECISION, out_dtype=tl.float32)
            if BLOCKED:
                s = tl.load(s_ptr + (offs_n // SCALE_ROWS) * stride_sn + k0 // GROUP, mask=mask_n, other=0.0)
                acc += part * s[None, :]
            else:
                acc += part
    if not BLOCKED:
        s = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
        if ONE_ROW:
            acc *= s
        else:
            acc *= s[None, :]
    out = out_ptr + pid_s * stride_os
    if ONE_ROW:
        tl.store(out + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & mask_n[None, :])
    if REDUCE_HERE:
        # The strip's last slice to arrive sums the partials in slice order (_sum_splits_kernel's
        # bits) into final_ptr and zeroes the counter (kernels/arrivals.py).
        if last_arrival(counter_ptr, pid_n, SPLITS):
            if ONE_ROW:
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for s_i in range(SPLITS):
                    total += tl.load(out_ptr + s_i * stride_os + offs_n, mask=mask_n, other=0.0, cache_modifier=".cg")
                tl.store(final_ptr + offs_n, total.to(final_ptr.dtype.element_ty), mask=mask_n)
            else:
                parts = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
                ok = (offs_m < M)[:, None] & mask_n[None, :]
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s_i in range(SPLITS):
                    total += tl.load(parts + s_i * stride_os, mask=ok, other=0.0, cache_modifier=".cg")
                tl.store(final_ptr + offs_m[:, None] * stride_fm + offs_n[None, :],
                         total.to(final_ptr.dtype.element_ty), mask=ok)
            reset_arrivals(counter_ptr, pid_n)


@triton.jit
def _row_x(x_ptr, x_rows, res_ptr, g_ptr, new_res_ptr, rows, row_ok, pid_n, M, K, k0, k_end, offs_k, stride_rm,
           stride_nm, rstd, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
    # One row's activations at columns k0.. in fp32 [BLOCK_K]: x itself, or the prologue's output
    # (kernels/fused_gemv.py's tile, rounded to x's dtype as the unfused kernels round).
    if PROLOGUE == 0:
        k = k0 + offs_k
        x = tl.load(x_ptr + k, mask=k < k_end, other=0.0).to(tl.float32)
    else:
        a, _ = prologue_tile(rstd, k0, x_rows, res_ptr, g_ptr, new_res_ptr, rows, row_ok, pid_n, M, K, stride_rm,
                             stride_nm, rstd, PROLOGUE, HAS_RESIDUAL, True, BLOCK_K)
        x = tl.reshape(a.to(tl.float32), (BLOCK_K,))
    return x


@triton.jit
def _one_row_step(acc, w, x, s_ptr, offs_n, mask_n, k0, k_end, offs_k, stride_sn, BLOCKED: tl.constexpr,
                  SCALE_ROWS: tl.constexpr, GROUP: tl.constexpr, WIDE: tl.constexpr):
    # acc [BLOCK_N] + the weight tile w [BLOCK_N, BLOCK_K] at columns k0.. times x [BLOCK_K] (fp32), in registers.
    k = k0 + offs_k
    if WIDE:
        # A step spanning several scale groups: every row of the strip shares its group scales
        # (s_ptr is the strip's row of them), so each column of x takes its group's scale before
        # the product, one multiply a column rather than one a weight.
        x *= tl.load(s_ptr + k // GROUP, mask=k < k_end, other=0.0)
    part = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if BLOCKED and not WIDE:
        return acc + part * tl.load(s_ptr + (offs_n // SCALE_ROWS) * stride_sn + k0 // GROUP, mask=mask_n, other=0.0)
    return acc + part


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, SIZE, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # out = sum over the splits, in split order, of the fp32 partials [SPLITS, SIZE].
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < SIZE
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * SIZE + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def default_config(n: int, k: int, blocked: bool, m: int, sms: int = 132) -> dict:
    """Tiles by rule when the table has no measurement, from what its measured tiles share.
    Per-channel scales: 32-row blocks (best of 16/32/64/128 rows on an H200, Llama-3.1-8B shapes),
    256 columns a step, K split until about two programs per SM. Group scales (H200, Llama-3.1-8B
    and DeepSeek-V3 shapes): 32-row blocks, 64 from 7168 rows up, 128 columns a step (one group),
    K split until about seven programs per SM (most bests hold 500-1800 programs on 132 SMs: enough
    loads in flight to cover the memory latency) while each split keeps two steps."""
    split = 1
    if blocked:
        bn, bk = (64 if n >= 7168 else 32), 128
        while triton.cdiv(n, bn) * split * 2 <= 8 * sms and k // (split * 2) >= 2 * bk:
            split *= 2
    else:
        # Past 16 rows the activation tile grows to 32-64 rows: 128-column steps keep the
        # pipeline's shared memory (3 stages of x and W tiles) inside ~100 KB.
        bn, bk = 32, (256 if m <= 16 else 128)
        while triton.cdiv(n, bn) * split < 2 * sms and k // (split * 2) >= 4 * bk:
            split *= 2
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=3)


_TABLE: dict = {}


def use_configs(table: dict) -> None:
    """Measured tiles, {card name: {config_key: config}} (bench/fp8_gemv_tune.py writes
    it; fp8_gemv_configs.py holds the ones committed). Replaces what was loaded before."""
    _TABLE.clear()
    _TABLE.update(table)


def _load_committed() -> None:
    from pdserve.kernels.fp8_gemv_configs import CONFIGS

    use_configs(CONFIGS)


def _card_table(device: torch.device) -> dict:
    """The measured tiles of `device`'s card ({} for a card the table does not name)."""
    if not _TABLE:
        _load_committed()
    return _TABLE.get(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", {})


def measured_batch_rows(device: torch.device, n: int, k: int, blocked: bool) -> int:
    """MAX_M if the card's table holds a tile for batches of 17-64 rows at this shape, else 0.
    bench/fp8_gemv_tune.py writes one only where the GEMV took at most 0.9x the time of the W8A8
    GEMM the engine runs there (its W8A8_MARGIN), so the engine takes the GEMV to 64 rows just for
    those layers (worker/quantization/fp8_linear.fp8_gemm_path)."""
    return MAX_M if config_key(n, k, blocked, MAX_M) in _card_table(device) else 0


def wide_fits(block_k: int, block_n: int, m: int, scale_rows: int) -> bool:
    """Whether group scales can take K steps of more than one group (several scale columns a step):
    one row only, whole groups a step, and each strip inside one row of scales."""
    return m == 1 and block_k % GROUP_K == 0 and scale_rows % block_n == 0


def config_key(n: int, k: int, blocked: bool, m: int) -> str:
    # The last field: 1 for one row, 0 for 2-16 rows (the tables' first buckets), 64 for 17-64.
    return f"{n},{k},{int(blocked)},{1 if m == 1 else 0 if m <= 16 else 64}"


def choose_config(x: torch.Tensor, n: int, k: int, blocked: bool) -> dict:
    m = x.shape[0]
    found = _card_table(x.device).get(config_key(n, k, blocked, m))
    return dict(found) if found else default_config(n, k, blocked, m, num_sms(x.device))


def fp8_gemv(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, scale_rows: int | None = None,
             config: dict | None = None) -> torch.Tensor:
    """x [M <= 64, K] (fp16/bf16/fp32) times e4m3 w8 [N, K] -> [M, N] in x's dtype.
    w_scale: per output channel ([N] or [1, N]) when scale_rows is None; else 128-column group
    scales [ceil(N / scale_rows), ceil(K / 128)] (the block format, scale_rows 128 or 1).
    `config`: BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, and optionally REDUCE_IN_KERNEL (with
    SPLIT_K > 1: the strip's last slice adds the partials, no second launch) and EARLY_W (one row: the
    first weight tile loaded before the PDL wait) (default: choose_config)."""
    return fp8_prologue_gemv(x, w8, w_scale, scale_rows, config=config)[0]


def fp8_prologue_gemv(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, scale_rows: int | None = None,
                      prologue: str = "none", *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                      residual: torch.Tensor | None = None, config: dict | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp8_gemv of prologue(x) -> (out [M, N], new residual or None), the element-wise op before the
    linear done in its K loop (kernels/fused_gemv.py's prologues: no launch of its own, no round trip
    of its output through memory). "rms_norm": x [M, K], norm_weight [K], eps, an optional residual
    [M, K] (then x + residual is normalised and returned second); two-pass: every program reads the
    row's x first for its 1 / rms, then normalises each K tile as kernels/rms_norm.py rounds.
    "silu_mul": x [M, 2K] = [gate | up], SiLU(gate) * up rounded to x's dtype as
    kernels/silu_and_mul.py does. Weight, scales and config as fp8_gemv's."""
    fn = "fp8_gemv"
    if prologue not in PROLOGUES:
        raise ValueError(f"{fn}: prologue must be one of {', '.join(PROLOGUES)}, got {prologue!r}")
    check_tensor(fn, "x", x, (None, None), FLOAT_DTYPES)
    m = x.shape[0]
    if m > MAX_M:
        raise ValueError(f"{fn}: at most {MAX_M} rows (decode batches), got {m}")
    check_tensor(fn, "w8", w8, (None, None), (FP8,))
    n, k = w8.shape
    check_tensor(fn, "x", x, (None, 2 * k if prologue == "silu_mul" else k), FLOAT_DTYPES)
    blocked = scale_rows is not None
    if blocked:
        check_tensor(fn, "w_scale", w_scale, (triton.cdiv(n, scale_rows), triton.cdiv(k, GROUP_K)), (torch.float32,))
    else:
        if w_scale.numel() != n or w_scale.dtype != torch.float32:
            raise ValueError(f"{fn}: w_scale must hold {n} float32 per-channel scales, got {tuple(w_scale.shape)} "
                             f"{w_scale.dtype}")
        w_scale = w_scale.reshape(-1)
    tensors = {"x": x, "w8": w8, "w_scale": w_scale}
    tensors |= prologue_operands(fn, prologue, m, k, x.dtype, norm_weight, eps, residual)
    check_devices(fn, **tensors)
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, got strides {t.stride()}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    new_res = torch.empty((m, k), dtype=x.dtype, device=x.device) if residual is not None else None
    if m == 0 or n == 0:
        if new_res is not None and m:  # no program runs to write the sum
            new_res.copy_((x.float() + residual.float()).to(x.dtype))
        return out, new_res
    cfg = dict(config or choose_config(x, n, k, blocked))
    if blocked and cfg["BLOCK_K"] > GROUP_K and not wide_fits(cfg["BLOCK_K"], cfg["BLOCK_N"], m, scale_rows):
        if config is not None:
            raise ValueError(f"{fn}: a BLOCK_K of {cfg['BLOCK_K']} spans several scale groups: it needs one row "
                             f"(got {m}), a multiple of {GROUP_K} and a row block dividing the scale's "
                             f"{scale_rows} rows (got {cfg['BLOCK_N']})")
        cfg = default_config(n, k, blocked, m, num_sms(x.device))  # the table's tile was measured at other scale rows
    bn, bk, split = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K"), cfg.pop("SPLIT_K", 1)
    reduce_in_kernel = cfg.pop("REDUCE_IN_KERNEL", False)
    early_w = cfg.pop("EARLY_W", False) and m == 1
    wide = blocked and bk > GROUP_K
    if blocked and not wide and GROUP_K % bk:
        raise ValueError(f"{fn}: BLOCK_K must divide {GROUP_K} for group scales, got {bk}")
    # Each split covers a whole number of BLOCK_K steps, so a step never straddles a scale group (or,
    # wide, covers whole groups).
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)
    strips = triton.cdiv(n, bn)
    reduce_here = split > 1 and reduce_in_kernel and strips <= MAX_COUNTERS
    dst = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    counters = strip_counters(x.device) if reduce_here else dst
    res = residual if residual is not None else x
    _fp8_gemv_kernel[(strips, split)](
        x, w8, w_scale, dst, out, counters, res, norm_weight if norm_weight is not None else x,
        new_res if new_res is not None else x, m, n, k, k_split, split, eps, x.stride(0), w8.stride(0),
        w_scale.stride(0) if blocked else 0, dst.stride(0) if split > 1 else 0, dst.stride(-2), out.stride(0),
        res.stride(0), new_res.stride(0) if new_res is not None else 0,
        REDUCE_HERE=reduce_here, BLOCKED=blocked, SCALE_ROWS=scale_rows or 1, GROUP=GROUP_K,
        DOT_F32=dot_in_f32(x.dtype), PRECISION=dot_precision(x.dtype), ONE_ROW=m == 1,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk, EARLY_W=early_w, WIDE=wide,
        PROLOGUE=PROLOGUES.index(prologue), HAS_RESIDUAL=residual is not None, **cfg, **pdl_args(x.device))
    if split > 1 and not reduce_here:
        size = m * n
        _sum_splits_kernel[(triton.cdiv(size, 1024),)](dst, out, size, SPLITS=split, BLOCK=1024, **pdl_args(dst.device))
    return out, new_res
