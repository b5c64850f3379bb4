"""Small-batch matrix products (M <= 8 rows) with the element-wise stage before them fused in.

At decode batch 1-8 a linear layer is a GEMV: every weight byte is read once and used M times,
so the time is the weight's bytes over the memory bandwidth, and cuBLAS tiles made for large M
leave part of that bandwidth unused (issue 25: Llama-3.1-8B's matrix products reach 88% of copy
bandwidth at bs=1, Qwen2.5-0.5B's far less). This kernel streams W [N, K] once, each program a
BLOCK_N-row strip of it, and builds the activation tile from the layer's input on the fly:

- prologue "rms_norm": y = RMSNorm(x (+ residual)) @ W^T, so the separate norm kernel and its
  [M, K] round trip through memory disappear. The row scale rstd is one number per row, so it
  can wait: by default (one pass) the K loop multiplies (x * norm weight) tiles into the product
  and sums x^2 alongside, and rstd scales the fp32 result at the end (after the split-K sum,
  which then adds the slices' sums of squares too). Two-pass (`GemvConfig.one_pass_norm=False`;
  always for fp16, where x * weight before the scale could overflow) first reads the rows'
  whole x (M * K elements, from L2 after the first program) for rstd, then normalises each
  K-tile exactly as reference.rms_norm_ref rounds (h * rstd to x's dtype, times the weight,
  rounded again): an extra read of x per program, bit-closer to the unfused path. With a
  residual, x + residual is what gets normalised and the programs of the first strip write that
  sum out for the next layer (the fused add of kernels/rms_norm.py).
- prologue "silu_mul": y = (silu(gate) * up) @ W^T with x = [gate | up] ([M, 2K]), for the down
  projection after the fused gate/up one.
- prologue "none": y = x @ W^T (o_proj, or any plain small-M linear).

Split-K: a layer with few output rows (Qwen2.5-0.5B's down_proj: N = 896) gives too few
BLOCK_N strips to keep every SM streaming, so the K range is cut into SPLIT_K slices whose fp32
partial sums go to a [SPLIT_K, M, N] workspace and a second launch adds them (plus the bias) in
a fixed order: deterministic, no atomics, nothing to zero first. Both launches read only shapes
on the host and allocate only the output and the workspace, so they can be captured in a CUDA
graph. With `GemvConfig.reduce_in_kernel` the second launch goes: each program stores its partial
and counts itself in on its strip's counter (an acq_rel atomic, as kernels/paged_decode_attention.py's
split merge), and the strip's last arrival adds the slices in slice order (the same bits as the
reduce launch) and resets the counter. At bs=1 a launch costs what a small slice's reads do, so a
narrow layer can split K without paying a second kernel for it.

A config may also run the prologue apart (`separate_prologue`): the norm or SiLU·mul kernel, then
the plain GEMV, the unfused path's values with the GEMV's tiles in place of cuBLAS.

M = 1 multiplies and sums in registers; M = 2..8 pads the activation tile to 16 rows for a
tensor-core dot (tl.dot's minimum; rows >= M are masked, never read or written). Accumulation is fp32; the
output has W's dtype. Configs (BLOCK_N, BLOCK_K, SPLIT_K)
come from `choose_config`: a measured table (bench/gemv.py prints its rows) or a heuristic.
References: reference.rms_norm_gemv_ref, reference.silu_mul_gemv_ref.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pdserve.kernels.arrivals import MAX_COUNTERS, last_arrival, reset_arrivals, strip_counters
from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor, dot_precision, interpreting, num_sms
from pdserve.kernels.pdl import pdl_args, pdl_enter
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.silu_and_mul import silu_and_mul

MAX_ROWS = 8  # the kernel's M limit: beyond it the batch is a GEMM, cuBLAS's ground
PROLOGUES = ("none", "rms_norm", "silu_mul")
_PROLOGUE_ID = {p: i for i, p in enumerate(PROLOGUES)}


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    one_pass_norm: bool = True  # "rms_norm": scale by rstd after the product (see the docstring)
    # The prologue as its own launch (kernels/rms_norm.py, silu_and_mul.py: the unfused path's
    # values), then the plain GEMV with these tiles: for narrow strips, whose programs would each
    # redo the prologue's per-column work for their few rows.
    separate_prologue: bool = False
    # split_k > 1: the strip's last program sums the slices (per-strip counters, one launch)
    # instead of a second reduce launch.
    reduce_in_kernel: bool = False
    # The program's first weight tile loaded before the PDL wait, overlapping the kernel before
    # (weights are never written during a step); the same bits either way.
    early_weights: bool = False


# Measured per card and shape: {card name: {(prologue, N, K, M bucket 1|2|4|8): config}}, the
# best config, or None where the unfused path (separate norm / SiLU·mul, then cuBLAS) was faster.
# A card gets an entry once bench/gemv.py has run on it; the entry it prints is a drop-in here. The
# engine takes the GEMV only where its card and shape have a config here (gemv_preferred); a forced
# path (tests, benches) takes choose_config's heuristic elsewhere. A table, not a run-time
# autotuner: every start picks the same.
# NVIDIA H200: M = 1 on 2026-12-04, twice (docs/results/gemv/2026-12-04-h200-narrow-gemv.md: 2-row
# strips of 1024-wide K tiles won o_proj and the 0.5B model's norm GEMVs; then with the prologue
# apart, docs/results/gemv/2026-12-04-h200-gemv-apart.md: Llama's qkv / gate_up tie cuBLAS at 1.01x,
# its down 1.08x, the 0.5B down 1.16x), M = 2-8 on 2026-11-27 (docs/gpu-perf-results.md); Qwen3-30B-A3B's
# attention on 2026-12-06 with the early weight load (docs/results/moe/2026-12-06-h200-moe-launches.md:
# qkv 9.7 -> 8.1 us, o_proj 7.8 -> 7.5 against the entries before).
MEASURED: dict[str, dict[tuple[str, int, int, int], GemvConfig | None]] = {
    "NVIDIA H200": {
        ('rms_norm', 6144, 4096, 1): GemvConfig(2, 1024, 1, separate_prologue=True),
        ('none', 4096, 4096, 1): GemvConfig(2, 1024, 1),
        ('rms_norm', 28672, 4096, 1): GemvConfig(2, 1024, 1, separate_prologue=True),
        ('silu_mul', 4096, 14336, 1): GemvConfig(2, 1024, 1, separate_prologue=True),
        ('rms_norm', 1152, 896, 1): GemvConfig(2, 1024, 1),
        ('none', 896, 896, 1): GemvConfig(2, 1024, 1),
        ('rms_norm', 9728, 896, 1): GemvConfig(8, 1024, 1),
        ('silu_mul', 896, 4864, 1): GemvConfig(2, 1024, 1, separate_prologue=True),
        ('rms_norm', 5120, 2880, 1): GemvConfig(32, 256, 4),
        ('none', 2880, 4096, 1): GemvConfig(2, 1024, 1),
        ('none', 128, 2880, 1): GemvConfig(2, 1024, 1),
        ('rms_norm', 5120, 2048, 1): GemvConfig(8, 1024, 1, early_weights=True),
        ('none', 2048, 4096, 1): GemvConfig(2, 1024, 1, early_weights=True),
        ('none', 4096, 4096, 2): GemvConfig(32, 256, 2),
        ('none', 896, 896, 2): GemvConfig(16, 256, 1),
        ('none', 4096, 4096, 4): GemvConfig(32, 256, 2),
        ('none', 896, 896, 4): GemvConfig(16, 256, 1),
        ('none', 4096, 4096, 8): GemvConfig(32, 256, 2),
        ('none', 896, 896, 8): GemvConfig(16, 256, 1),
        ('rms_norm', 6144, 4096, 2): None,
        ('rms_norm', 28672, 4096, 2): None,
        ('silu_mul', 4096, 14336, 2): None,
        ('rms_norm', 1152, 896, 2): None,
        ('rms_norm', 9728, 896, 2): None,
        ('silu_mul', 896, 4864, 2): None,
        ('rms_norm', 6144, 4096, 4): None,
        ('rms_norm', 28672, 4096, 4): None,
        ('silu_mul', 4096, 14336, 4): None,
        ('rms_norm', 1152, 896, 4): None,
        ('rms_norm', 9728, 896, 4): None,
        ('silu_mul', 896, 4864, 4): None,
        ('rms_norm', 6144, 4096, 8): None,
        ('rms_norm', 28672, 4096, 8): None,
        ('silu_mul', 4096, 14336, 8): None,
        ('rms_norm', 1152, 896, 8): None,
        ('rms_norm', 9728, 896, 8): None,
        ('silu_mul', 896, 4864, 8): None,
    },
    # M = 1, swept again on 2026-12-06 with the early weight load and the Qwen3 / gpt-oss
    # attention shapes (docs/results/gemv/2026-12-06-h100-early-weights.md): the 0.5B model's bs=1
    # step 0.747 -> 0.680 ms against the earlier table in the same process.
    "NVIDIA H100 80GB HBM3": {
        ('rms_norm', 1152, 896, 1): GemvConfig(4, 1024, 4, reduce_in_kernel=True, early_weights=True),
        ('none', 896, 896, 1): GemvConfig(2, 1024, 4, reduce_in_kernel=True, early_weights=True),
        ('rms_norm', 9728, 896, 1): GemvConfig(16, 512, 1, early_weights=True),
        ('silu_mul', 896, 4864, 1): GemvConfig(8, 1024, 4, reduce_in_kernel=True, early_weights=True),
        ('rms_norm', 6144, 4096, 1): GemvConfig(8, 1024, 1, separate_prologue=True, early_weights=True),
        ('none', 4096, 4096, 1): GemvConfig(2, 1024, 1),
        ('rms_norm', 28672, 4096, 1): GemvConfig(2, 1024, 1, separate_prologue=True),
        ('silu_mul', 4096, 14336, 1): GemvConfig(2, 1024, 1, separate_prologue=True, early_weights=True),
        ('rms_norm', 5120, 2048, 1): GemvConfig(8, 1024, 1, early_weights=True),
        ('none', 2048, 4096, 1): GemvConfig(2, 1024, 1, early_weights=True),
        ('rms_norm', 5120, 2880, 1): GemvConfig(4, 1024, 1, early_weights=True),
        ('none', 2880, 4096, 1): GemvConfig(2, 1024, 1, early_weights=True),
        ('none', 128, 2880, 1): GemvConfig(8, 1024, 4, reduce_in_kernel=True, early_weights=True),
    },
}


def _m_bucket(m: int) -> int:
    return 1 if m <= 1 else 2 if m <= 2 else 4 if m <= 4 else 8


@functools.cache
def card_name(device: torch.device) -> str:
    """MEASURED's first key: the CUDA card's name ("cpu" under the interpreter)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _measured(prologue: str, m: int, n: int, k: int, device: torch.device):
    return MEASURED.get(card_name(device), {}).get((prologue, n, k, _m_bucket(m)), "absent")


def gemv_preferred(prologue: str, m: int, n: int, k: int, device: torch.device,
                   measured_only: bool = False) -> bool:
    """Whether the model should launch this kernel for the shape: not where MEASURED says the
    unfused path won on this card, and with `measured_only` (the engine's default) only where it
    names a winning config (an unmeasured card or shape keeps cuBLAS). Host-side lookups: no
    sync, safe inside graph capture."""
    hit = _measured(prologue, m, n, k, device)
    if m > MAX_ROWS or hit is None:
        return False
    return not (measured_only and hit == "absent")


def choose_config(prologue: str, m: int, n: int, k: int, device: torch.device) -> GemvConfig:
    """The table's config for this shape, else kernels/fp8_gemv.py's rule (32-row strips, the
    best of 16/32/64/128 for its FP8 GEMV on an H200 at Llama-3.1-8B shapes): split K while the
    grid has under two programs per SM and each slice keeps >= 4 K-tiles."""
    hit = _measured(prologue, m, n, k, device)
    if isinstance(hit, GemvConfig):
        return hit
    block_n, block_k = GemvConfig.block_n, GemvConfig.block_k
    strips = triton.cdiv(n, block_n)
    split = 1
    while strips * split < 2 * num_sms(device) and k // (2 * split) >= 4 * block_k:
        split *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split)


def prologue_operands(fn: str, prologue: str, m: int, k: int, dtype: torch.dtype, norm_weight: torch.Tensor | None,
                      eps: float, residual: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Checks the prologue's own arguments for launcher `fn` (named in the errors): "rms_norm" needs
    norm_weight [k] and eps > 0 and takes a residual [m, k], all of `dtype`; no other prologue takes
    them. Returns those tensors by name, for the launcher's device and stride checks."""
    if prologue != "rms_norm":
        if norm_weight is not None or residual is not None:
            raise ValueError(f"{fn}: norm_weight and residual are for prologue 'rms_norm', not {prologue!r}")
        return {}
    if norm_weight is None:
        raise ValueError(f"{fn}: prologue 'rms_norm' needs norm_weight")
    check_tensor(fn, "norm_weight", norm_weight, (k,), (dtype,))
    if not eps > 0:
        raise ValueError(f"{fn}: eps must be > 0, got {eps}")
    if residual is None:
        return {"norm_weight": norm_weight}
    check_tensor(fn, "residual", residual, (m, k), (dtype,))
    return {"norm_weight": norm_weight, "residual": residual}


def _apart(x, weight, prologue, bias, norm_weight, eps, residual, cfg: GemvConfig):
    """fused_gemv with the prologue as its own launch first (GemvConfig.separate_prologue)."""
    if prologue == "rms_norm":
        h, new_res = rms_norm(x, norm_weight, eps, residual)
    else:
        h, new_res = silu_and_mul(x), None
    out, _ = fused_gemv(h, weight, "none", bias=bias, config=replace(cfg, separate_prologue=False))
    return out, new_res


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, g_ptr, w_ptr, b_ptr, out_ptr, new_res_ptr, part_ptr, ss_ptr, counter_ptr,
    M, N, K, eps, K_PER_SPLIT,
    stride_xm, stride_rm, stride_wn, stride_om, stride_nm,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, REDUCE_HERE: tl.constexpr, TWO_PASS: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EARLY_W: tl.constexpr = False, PDL: tl.constexpr = False,
):
    # Grid (cdiv(N, BLOCK_N), SPLIT): program (n, s) owns output columns [n*BLOCK_N, +BLOCK_N)
    # over K slice s.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + ns[:, None].to(tl.int64) * stride_wn
    k_begin = pid_k * K_PER_SPLIT
    if EARLY_W:
        # The first weight tile is loaded before the PDL wait (kernels/pdl.py's one exception: no
        # kernel of a step writes a weight, so the read cannot be stale): it overlaps the previous
        # kernel's tail. Its product is taken after the wait, below.
        ks0 = k_begin + tl.arange(0, BLOCK_K)
        w_first = tl.load(w_rows + ks0[None, :], mask=n_ok[:, None] & (ks0 < K)[None, :], other=0.0)
    pdl_enter(PDL)
    if PROLOGUE == 1 and TWO_PASS:
        rstd = norm_rstd(x_rows, res_ptr, new_res_ptr, rows, row_ok, (pid_n == 0) & (pid_k == 0), M, K, eps,
                          stride_rm, stride_nm, HAS_RESIDUAL, BLOCK_M, BLOCK_K)
        ss = rstd  # unused
    else:
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # one pass: summed in the K loop below
        rstd = ss  # unused
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_loop = k_begin
    if EARLY_W:
        a, ss = prologue_tile(ss, k_begin, x_rows, res_ptr, g_ptr, new_res_ptr, rows, row_ok, pid_n, M, K,
                              stride_rm, stride_nm, rstd, PROLOGUE, HAS_RESIDUAL, TWO_PASS, BLOCK_K)
        acc = _accumulate(acc, a, w_first, DOT_F32, PRECISION, BLOCK_M)
        k_loop = k_begin + BLOCK_K
    for k0 in range(k_loop, k_begin + K_PER_SPLIT, BLOCK_K):
        a, ss = prologue_tile(ss, k0, x_rows, res_ptr, g_ptr, new_res_ptr, rows, row_ok, pid_n, M, K,
                              stride_rm, stride_nm, rstd, PROLOGUE, HAS_RESIDUAL, TWO_PASS, BLOCK_K)
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & (ks < K)[None, :], other=0.0)
        acc = _accumulate(acc, a, w, DOT_F32, PRECISION, BLOCK_M)
    out_mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        _gemv_epilogue(acc, ss, rows, row_ok, ns, n_ok, b_ptr, out_ptr, K, eps, stride_om,
                       PROLOGUE == 1 and not TWO_PASS, HAS_BIAS)
    else:
        part = part_ptr + (pid_k * M + rows[:, None]).to(tl.int64) * N + ns[None, :]
        tl.store(part, acc, mask=out_mask)
        if REDUCE_HERE:
            if PROLOGUE == 1 and not TWO_PASS:  # this slice's sums of squares, per strip
                tl.store(ss_ptr + (pid_n * SPLIT + pid_k) * M + rows, ss, mask=row_ok)
            if last_arrival(counter_ptr, pid_n, SPLIT):  # the strip's SPLIT partials are visible
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                total_ss = tl.zeros([BLOCK_M], dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # slice order: the reduce launch's sum, bit for bit
                    total += tl.load(part_ptr + (s * M + rows[:, None]).to(tl.int64) * N + ns[None, :],
                                     mask=out_mask, other=0.0, cache_modifier=".cg")
                    if PROLOGUE == 1 and not TWO_PASS:
                        total_ss += tl.load(ss_ptr + (pid_n * SPLIT + s) * M + rows, mask=row_ok, other=0.0,
                                            cache_modifier=".cg")
                _gemv_epilogue(total, total_ss, rows, row_ok, ns, n_ok, b_ptr, out_ptr, K, eps, stride_om,
                               PROLOGUE == 1 and not TWO_PASS, HAS_BIAS)
                reset_arrivals(counter_ptr, pid_n)
        elif PROLOGUE == 1 and not TWO_PASS:
            if pid_n == 0:  # this slice's sums of squares, for the reduce launch's rstd
                tl.store(ss_ptr + pid_k * M + rows, ss, mask=row_ok)


@triton.jit
def norm_rstd(x_rows, res_ptr, new_res_ptr, rows, row_ok, writer, M, K, eps, stride_rm, stride_nm,
              HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # Pass 1 of the two-pass rms_norm: the rows' 1 / rms over all of K; with a residual, the sum
    # x + residual rounded to x's dtype (as the reference adds), written out by the `writer` program.
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    # A row limit of 0 off the writer, not a branch: no control flow in the loop.
    writer_rows = tl.where(writer, M, 0)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (ks < K)[None, :]
        x = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_rm + ks[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(new_res_ptr + rows[:, None].to(tl.int64) * stride_nm + ks[None, :], x,
                     mask=(rows[:, None] < writer_rows) & (ks < K)[None, :])
        h = x.to(tl.float32)
        ss += tl.sum(h * h, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def prologue_tile(ss, k0, x_rows, res_ptr, g_ptr, new_res_ptr, rows, row_ok, pid_n, M, K, stride_rm, stride_nm,
                  rstd, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, TWO_PASS: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    # The activation tile at columns k0.. as the prologue makes it (the one-pass norm's sums of
    # squares added to ss; with a residual, the first strip's programs write x + residual out).
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    mask = row_ok[:, None] & k_ok[None, :]
    if PROLOGUE == 2:
        # silu_mul: x is [gate | up], K columns each.
        gate = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
        up = tl.load(x_rows + K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        gf = gate.to(tl.float32)
        a = (gf / (1.0 + tl.exp(-gf)) * up).to(gate.dtype)
    else:
        a = tl.load(x_rows + ks[None, :], mask=mask, other=0.0)
        if PROLOGUE == 1:
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_rm + ks[None, :], mask=mask, other=0.0)
                a = (a.to(tl.float32) + r.to(tl.float32)).to(a.dtype)
                if not TWO_PASS:  # each K slice's first-strip program writes its part
                    writer_rows = tl.where(pid_n == 0, M, 0)
                    tl.store(new_res_ptr + rows[:, None].to(tl.int64) * stride_nm + ks[None, :], a,
                             mask=(rows[:, None] < writer_rows) & k_ok[None, :])
            g = tl.load(g_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            if TWO_PASS:
                normed = (a.to(tl.float32) * rstd[:, None]).to(a.dtype)  # the reference's h.to(x.dtype)
                a = (normed.to(tl.float32) * g).to(a.dtype)
            else:
                h = a.to(tl.float32)
                ss += tl.sum(h * h, axis=1)
                a = (h * g).to(a.dtype)
    return a, ss


@triton.jit
def _accumulate(acc, a, w, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    # acc [BLOCK_M, BLOCK_N] + a [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T, in fp32.
    if BLOCK_M == 1:
        # One row: multiply and sum in registers (no 16-row padding; as kernels/fp8_gemv.py).
        return acc + tl.sum(w.to(tl.float32) * a.to(tl.float32), axis=1)[None, :]
    elif DOT_F32:
        return acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision=PRECISION)
    else:
        return acc + tl.dot(a.to(w.dtype), tl.trans(w), input_precision=PRECISION)


@triton.jit
def _gemv_epilogue(acc, ss, rows, row_ok, ns, n_ok, b_ptr, out_ptr, K, eps, stride_om,
                   NORM_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    # The finished fp32 product: times the one-pass norm's rstd, plus the bias, stored in out's dtype.
    if NORM_SCALE:
        acc *= (1.0 / tl.sqrt(ss / K + eps))[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + ns[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_k_reduce_kernel(part_ptr, ss_ptr, b_ptr, out_ptr, M, N, K, eps, stride_om,
                           SPLIT: tl.constexpr, NORM_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (M, cdiv(N, BLOCK)): the slices' partials summed in slice order, so runs agree bit for
    # bit; NORM_SCALE (one-pass rms_norm): times rstd from the slices' sums of squares.
    pdl_enter(PDL)
    m = tl.program_id(0)
    ns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = ns < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ss = tl.zeros([1], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + (s * M + m).to(tl.int64) * N + ns, mask=ok, other=0.0)
        if NORM_SCALE:
            ss += tl.load(ss_ptr + s * M + m + tl.arange(0, 1))
    if NORM_SCALE:
        acc *= 1.0 / tl.sqrt(ss / K + eps)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ns, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + ns, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fused_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    prologue: str = "none",
    *,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prologue(x) @ weight^T (+ bias) for M <= 8 rows -> (out [M, N], new residual or None).

    x: [M, K] ("none", "rms_norm") or [M, 2K] ([gate | up], "silu_mul"); weight [N, K]; x,
    weight, norm_weight, residual and bias all of one float dtype. "rms_norm" needs
    norm_weight [K] and eps, and takes an optional residual [M, K]: then x + residual is
    normalised and also returned (the second value), inputs untouched.
    """
    fn = "fused_gemv"
    if prologue not in _PROLOGUE_ID:
        raise ValueError(f"{fn}: prologue must be one of {', '.join(PROLOGUES)}, got {prologue!r}")
    check_tensor(fn, "weight", weight, (None, None), FLOAT_DTYPES)
    n, k = weight.shape
    dt = weight.dtype
    check_tensor(fn, "x", x, (None, 2 * k if prologue == "silu_mul" else k), (dt,))
    m = x.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"{fn}: x has {m} rows; this kernel is for at most {MAX_ROWS} (use F.linear)")
    tensors = {"x": x, "weight": weight}
    if bias is not None:
        check_tensor(fn, "bias", bias, (n,), (dt,))
        tensors["bias"] = bias
    tensors |= prologue_operands(fn, prologue, m, k, dt, norm_weight, eps, residual)
    device = check_devices(fn, **tensors)
    for name, v in tensors.items():
        if v.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, got strides {v.stride()}")
    out = torch.empty((m, n), dtype=dt, device=device)
    new_res = torch.empty((m, k), dtype=dt, device=device) if residual is not None else None
    if m == 0 or n == 0:
        return out, new_res
    cfg = config or choose_config(prologue, m, n, k, device)
    if cfg.separate_prologue and prologue != "none":
        return _apart(x, weight, prologue, bias, norm_weight, eps, residual, cfg)
    block_k = min(cfg.block_k, max(triton.next_power_of_2(k), 16))
    split = max(1, min(cfg.split_k, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty slice
    part = torch.empty((split, m, n), dtype=torch.float32, device=device) if split > 1 else out
    # fp16: x * norm weight could overflow before the scale, so fp16 always normalises first.
    two_pass = prologue == "rms_norm" and (not cfg.one_pass_norm or dt == torch.float16)
    norm_scale = prologue == "rms_norm" and not two_pass and split > 1
    strips = triton.cdiv(n, cfg.block_n)
    reduce_here = split > 1 and cfg.reduce_in_kernel and strips <= MAX_COUNTERS
    ss_rows = strips * split if reduce_here else split  # in-kernel: each strip's last program sums its own
    ss = torch.empty((ss_rows, m), dtype=torch.float32, device=device) if norm_scale else part
    counters = strip_counters(device) if reduce_here else part
    _gemv_kernel[(strips, split)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, out, new_res if new_res is not None else out, part, ss, counters,
        m, n, k, eps, k_per_split,
        x.stride(0), residual.stride(0) if residual is not None else 0, weight.stride(0), out.stride(0),
        new_res.stride(0) if new_res is not None else 0,
        PROLOGUE=_PROLOGUE_ID[prologue], HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, SPLIT=split, REDUCE_HERE=reduce_here, TWO_PASS=two_pass,
        # The interpreter multiplies bf16 dot operands wrongly (launch.dot_in_f32): fp32 there.
        DOT_F32=interpreting() and dt != torch.float16, PRECISION=dot_precision(dt),
        BLOCK_M=1 if m == 1 else 16, BLOCK_N=cfg.block_n, BLOCK_K=block_k, EARLY_W=cfg.early_weights,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_args(x.device),
    )
    if split > 1 and not reduce_here:
        block = min(triton.next_power_of_2(n), 1024)
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
            part, ss, bias if bias is not None else weight, out, m, n, k, eps, out.stride(0),
            SPLIT=split, NORM_SCALE=norm_scale, HAS_BIAS=bias is not None, BLOCK=block, **pdl_args(part.device))
    return out, new_res
