"""gpt-oss-120b's MXFP4 decode GEMVs at one token with their weight strips brought by TMA descriptor
loads into a pipelined shared-memory ring: gate|up (and split down pass) variants timed against the
default kernels in CUDA graphs, same run (tools/gpu/mxfp4_tma.sh).

    python tools/gpu/mxfp4_tma.py time --out FILE [--only N ...] [--budget S]   # on an H200
    python tools/gpu/mxfp4_tma.py --check      # CPU, TRITON_INTERPRET=1, tiny shapes: every variant's math
    python tools/gpu/mxfp4_tma.py sass         # CPU: each variant compiled for sm_90, its K loop's SASS counted

The default gate|up kernel (`_moe_decode_gate_up_kernel`, MXFP4, moe_decode_config's tiles: 16 rows
x 256 inputs, 4 warps, x nibble-major) is latency-bound on an H200: DRAM at ~26% of peak, ~19 warps
resident an SM, each waiting on its own loads (docs/results/gpt-oss/2026-12-04-h200-decode-bounds.md);
register prefetch and cp.async pipelining (`tl.range(num_stages=...)` over pointer loads: LDGSTS then
LDS, ~50 instructions a step) were slower. Hypothesis: TMA bulk copies keep bytes in flight without
warps or per-thread address arithmetic (one thread issues a strip's copy, an mbarrier says when it
landed), so a ring of S stages keeps ~(S - 1) x the strip's bytes in flight per program at any
occupancy while the warps only decode and multiply. The kernel below is the default's math
(fused_moe's @triton.jit helpers: the same e2m1 word decoder, [rows, groups, 4] accumulators scaled by
each step's exponents, the same epilogue), so its intermediate must equal the default's bit for bit.
Knobs, one hypothesis each:

- words (always by descriptor): the packed w13 as int32 words [E * 2N, K / 8] (rows of K / 2 = 1440
  bytes: 16-byte multiples, as TMA needs), a [BLOCK_N, BLOCK_K / 8] box a step for gate and one for
  up (N rows further); columns past K arrive as zeros (TMA's out-of-bounds fill), so every step is
  the same code, no mask.
- X_TMA: the activations (fp32 x 2^64, nibble-major: mx_activations' output) by a 4-D descriptor
  [T, K / 32, 8, 4], one [groups, 4] box per nibble position a step, instead of pointer loads, which
  the pipeliner would turn into cp.async (the instructions that made the last pipelining slower).
- EXP_TMA: the E8M0 exponents by descriptor too. Their rows are K / 32 = 90 bytes (no 16-byte
  stride), so this reads a transposed copy [E, K / 32, 2N] made once at load (an engine would store
  them so); a [groups, BLOCK_N] box, transposed in registers. Off: masked pointer loads, as now.
- STAGES 2 / 3 / 4: the ring's depth (`tl.range(num_stages=)`): bytes in flight a program.
- BLOCK_N 16 / 32 / 64, BLOCK_K 128 / 256, 4 / 8 warps: the strip a stage holds, against programs
  resident an SM (shared memory per program = STAGES x 2 x BLOCK_N x BLOCK_K / 2 bytes of words).
- WS: `warp_specialize=True` on the loop (a producer warp issues the copies, the rest consume);
  where Triton 3.6 refuses it on sm_90 or for a loop without a dot, the row says why. (No early
  return for an expert held elsewhere, unlike the default kernel: Triton 3.9's partitioner asserts
  on a branch out of the kernel before the loop; such a program runs no step and stores nothing.)
- PERSIST p: p programs an SM, each walking tiles (assignment, strip) in one flattened pipelined
  loop, so the ring does not drain between strips (the accumulators reset at a tile's first step,
  the epilogue runs at its last); 0 = one program per tile, as the default kernel.
- down (DOWN_VARIANTS): `_moe_decode_down_split_kernel`'s programs and partials with w2's words by
  descriptor ([E * H, I / 8]), the intermediate and exponents by pointers, fused_moe's own finish
  launch; split 2 (the default's) or unsplit with a deeper ring, 16 or 32 rows.

Timing (`time`): random packed experts of the published shapes (tools/gpu/mxfp4_ncu.py's layer():
E = 128, H = I = 2880, top-4, biases, the clamped SwiGLU alpha 1.702 limit 7), x through
mx_activations once outside the timing; only the gate|up launch is timed, 20 calls with 20 different
routings a CUDA graph (graph_call_ms), so the experts read are not those L2 holds from the call
before. "engine path" is fused_moe's own pass (mx_activations + the default kernel) for scale.
The down rows time the split pass and its finish on each routing's own intermediate (made once).
% of copy: the 4 experts' words and exponents (35.25 MB gate|up, 17.63 MB down) over the time,
against the same run's 1 GiB device-to-device copy. Error: max |variant - default| / max |default|
over the output (gate|up: the intermediate) of two routings, and whether the bits are equal.

--check runs the kernels in Triton's interpreter (which does run host tensor descriptors: it copies
the box with zero fill past the bounds) at E = 4, I = 288, H = 320 (partial last K steps, a partial
last strip, a down share of one partial step), 2 tokens, top-2, against the default kernels (the
down variants on the default gate|up's output): the math and the descriptor plumbing of every
variant, not the pipelining (the interpreter ignores num_stages, warps and warp_specialize, so those
variants run the same code there).

`sass` (no GPU: the installed Triton's ptxas, tools/sass_loop.py's counting) on Triton 3.9, a K step
of 256 inputs: the default 295 instructions (56 registers); words by TMA 497-523 at 2-4 stages (8
LDGSTS: the pipeliner still turns x's pointer loads into cp.async), warp-specialized 470 (x by plain
LDG), exponents by TMA too 548, 32 rows 830 for twice the weights (122 registers), x by TMA 902 (12
TMA copies, 28 barriers and 40 shuffles a step); the split down pass 158 by default, 297 with its
words by TMA; Triton 3.6.0 (the H200's) within ~5% of these, every variant compiling
(docs/results/gpt-oss/2026-12-04-cpu-mxfp4-tma-sass.md). So the TMA ring is bought with 1.3-1.9x
the default's instructions a weight; it pays only if the default's lost time is latency that the
ring hides, not issue: the table decides (the default gate|up issues ~9 us of its ~22).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--check" in sys.argv:  # the interpreter is chosen when triton is imported and kernels decorated
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from pdserve.kernels import fused_moe as fm  # noqa: E402
from pdserve.kernels.fused_moe import (  # noqa: E402
    _activate, _e2m1_word, _mx_activations, _mxfp4_dots, _mxfp4_exponent_groups, _mxfp4_nibble_major,
    _mxfp4_scaled, _mxfp4_total, _mxfp4_word_exponents)
from pdserve.kernels.moe_activation import SwigluOAI  # noqa: E402
from pdserve.kernels.pdl import pdl_args, pdl_enter  # noqa: E402

ACT = SwigluOAI(alpha=1.702, limit=7.0)
# Leanest K loop first (`sass`: Triton 3.9's sm_90 SASS a step, the default's 295), so the runner's time
# limit cuts the least promising; x by descriptor (X_TMA) costs layout shuffles there (~900 a step).
# Warp-specialized ones last: the runner times them in a second process (a compiler abort there
# loses only them).
W = dict(BLOCK_N=16, BLOCK_K=256, warps=4, STAGES=3)  # the default's strip, words by TMA, a 3-deep ring
VARIANTS = [
    ("words by TMA, 16x256, 4 warps, 3 stages", W),
    ("words by TMA, 32 rows", dict(W, BLOCK_N=32)),
    ("words and exponents by TMA", dict(W, EXP_TMA=True)),
    ("words by TMA, 32 rows, 8 warps", dict(W, BLOCK_N=32, warps=8)),
    ("words by TMA, 4 stages", dict(W, STAGES=4)),
    ("words by TMA, 2 stages", dict(W, STAGES=2)),
    ("words by TMA, persistent 1 an SM, 8 warps, 4 stages", dict(W, warps=8, STAGES=4, PERSIST=1)),
    ("words by TMA, 16x128, 4 stages", dict(W, BLOCK_K=128, STAGES=4)),
    ("words by TMA, 64 rows, 8 warps", dict(W, BLOCK_N=64, warps=8)),
    ("all by TMA (words, exponents, x)", dict(W, X_TMA=True, EXP_TMA=True)),
    ("words by TMA, warp-specialized", dict(W, WS=True)),
    ("words and exponents by TMA, warp-specialized", dict(W, EXP_TMA=True, WS=True)),
]
# The split down pass (_moe_decode_down_split_kernel: programs per token, strip of H, expert slot and
# share of I, fp32 partials, the same finish launch) with its words by TMA; the default splits in 2.
DOWN_VARIANTS = [
    ("down: words by TMA, 16 rows, split 2, 3 stages", dict(BLOCK_N=16, BLOCK_K=256, warps=4, STAGES=3, SPLIT=2)),
    ("down: words by TMA, 16 rows, unsplit, 4 stages", dict(BLOCK_N=16, BLOCK_K=256, warps=4, STAGES=4, SPLIT=1)),
    ("down: words by TMA, 32 rows, split 2, 3 stages", dict(BLOCK_N=32, BLOCK_K=256, warps=4, STAGES=3, SPLIT=2)),
]


@triton.jit
def _x_nibble(x_desc, x_row, t, k0, K, J: tl.constexpr, X_TMA: tl.constexpr, BLOCK_K: tl.constexpr):
    # The activations that meet nibble J of a step's words, [1, groups, 4]: inputs 32g + 4J + w of x
    # in nibble-major order (fp32 x 2^64), by a descriptor box (zeros past K) or pointers (masked).
    G: tl.constexpr = BLOCK_K // 32
    if X_TMA:
        return x_desc.load([t, k0 // 32, J, 0]).reshape(1, G, 4)
    else:
        gs = tl.arange(0, G)
        ptrs = x_row + k0 + (32 * gs[:, None] + 4 * J + tl.arange(0, 4)[None, :])[None, :, :]
        return tl.load(ptrs, mask=(gs < (K - k0) // 32)[None, :, None], other=0.0)


@triton.jit
def _exponents(s_desc, s_ptr, e, row0, rows, row_ok, k0, K, stride_se, stride_sn,
               EXP_TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # A step's 2^(s - 127) as [BLOCK_N, groups, 1] (_mxfp4_word_exponents' form) for weight rows
    # row0 .. row0 + BLOCK_N of expert e: from the transposed copy [E, K / 32, 2N] by descriptor
    # (zeros past K read as 0), or from [E, 2N, K / 32] by masked pointers.
    G: tl.constexpr = BLOCK_K // 32
    if EXP_TMA:
        s = tl.trans(s_desc.load([e, k0 // 32, row0]).reshape(G, BLOCK_N))
        return (s.to(tl.int32)[:, :, None] << 23).to(tl.float32, bitcast=True)
    else:
        gs = tl.arange(0, G)
        ptrs = s_ptr + e * stride_se + rows[:, None, None].to(tl.int64) * stride_sn + (k0 // 32
                                                                                       + _mxfp4_exponent_groups(gs))
        return _mxfp4_word_exponents(ptrs, row_ok[:, None, None] & (gs < (K - k0) // 32)[None, :, None])


@triton.jit
def _strip_step(acc_g, acc_u, w_desc, x_desc, s_desc, x_row, s_ptr, t, e, n0, cols, col_ok, k0, N, K,
                stride_se, stride_sn, X_TMA: tl.constexpr, EXP_TMA: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    # One K step of a gate|up strip, the default kernel's arithmetic (_mxfp4_dots, _mxfp4_scaled)
    # with x's loads shared by gate and up: words [BLOCK_N, groups, 4] by descriptor (rows of the
    # [E * 2N, K / 8] view; zeros past K), 8 nibble passes of FMAs, scaled by the exponents.
    G: tl.constexpr = BLOCK_K // 32
    row = e * (2 * N) + n0
    q_g = w_desc.load([row, k0 // 8]).reshape(BLOCK_N, G, 4)
    q_u = w_desc.load([row + N, k0 // 8]).reshape(BLOCK_N, G, 4)
    x0 = _x_nibble(x_desc, x_row, t, k0, K, 0, X_TMA, BLOCK_K)
    p_g = _e2m1_word(q_g, 0) * x0
    p_u = _e2m1_word(q_u, 0) * x0
    for j in tl.static_range(1, 8):
        xj = _x_nibble(x_desc, x_row, t, k0, K, j, X_TMA, BLOCK_K)
        p_g += _e2m1_word(q_g, j) * xj
        p_u += _e2m1_word(q_u, j) * xj
    f_g = _exponents(s_desc, s_ptr, e, n0, cols, col_ok, k0, K, stride_se, stride_sn, EXP_TMA, BLOCK_N, BLOCK_K)
    f_u = _exponents(s_desc, s_ptr, e, N + n0, cols + N, col_ok, k0, K, stride_se, stride_sn, EXP_TMA, BLOCK_N,
                     BLOCK_K)
    return _mxfp4_scaled(acc_g, p_g, f_g), _mxfp4_scaled(acc_u, p_u, f_u)


@triton.jit
def _strip_out(acc_g, acc_u, a, e, cols, col_ok, N, inter_ptr, weight_ptr, bias_ptr, stride_im, stride_bias_e,
               alpha, limit, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, ROUND: tl.constexpr):
    # The default kernel's epilogue: sums, bias, activation, router weight, rounded, x 2^64, nibble-major.
    gate = _mxfp4_total(acc_g)
    up = _mxfp4_total(acc_u)
    if HAS_BIAS:
        bias_row = bias_ptr + e * stride_bias_e
        gate += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        up += tl.load(bias_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)
    h = _activate(gate, up, SWIGLU, alpha, limit) * tl.load(weight_ptr + a).to(tl.float32)
    tl.store(inter_ptr + a.to(tl.int64) * stride_im + _mxfp4_nibble_major(cols), _mx_activations(h, ROUND),
             mask=col_ok)


@triton.jit
def _gate_up_tma_kernel(w_desc, x_desc, s_desc, x_ptr, s_ptr, inter_ptr, ids_ptr, weight_ptr, bias_ptr, N, K,
                        num_experts, expert_offset, num_tiles, stride_xm, stride_se, stride_sn, stride_im,
                        stride_bias_e, alpha, limit, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr, X_TMA: tl.constexpr,
                        EXP_TMA: tl.constexpr, PERSIST: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SWIGLU: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr = False):
    # PERSIST 0: grid (T*k, cdiv(N, BLOCK_N)), a program per (assignment a = t*k + j, strip), as the
    # default kernel. PERSIST > 0: grid (programs,), program p takes tiles p, p + programs, ... (tile
    # = a * strips + strip) in one flattened loop of their K steps.
    pdl_enter(PDL)
    G: tl.constexpr = BLOCK_K // 32
    steps = tl.cdiv(K, BLOCK_K)
    strips = tl.cdiv(N, BLOCK_N)
    if PERSIST == 0:
        # No early return for an expert held elsewhere (the default kernel's): a branch out of the
        # kernel before the loop is what Triton's warp specialization pass cannot partition; such a
        # program runs no step and stores nothing instead.
        a = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        e = tl.load(ids_ptr + a).to(tl.int32) - expert_offset
        held = (e >= 0) & (e < num_experts)
        e = tl.where(held, e, 0)
        t = a // TOP_K
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < tl.where(held, N, 0)
        acc_g = tl.zeros([BLOCK_N, G, 4], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, G, 4], dtype=tl.float32)
        for s in tl.range(0, tl.where(held, steps, 0), num_stages=STAGES, warp_specialize=WS):
            acc_g, acc_u = _strip_step(acc_g, acc_u, w_desc, x_desc, s_desc, x_ptr + t * stride_xm, s_ptr, t, e, n0,
                                       cols, col_ok, s * BLOCK_K, N, K, stride_se, stride_sn, X_TMA, EXP_TMA,
                                       BLOCK_N, BLOCK_K)
        _strip_out(acc_g, acc_u, a, e, cols, col_ok, N, inter_ptr, weight_ptr, bias_ptr, stride_im,
                   stride_bias_e, alpha, limit, HAS_BIAS, SWIGLU, ROUND)
    else:
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        mine = tl.cdiv(num_tiles - pid, programs)
        acc_g = tl.zeros([BLOCK_N, G, 4], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, G, 4], dtype=tl.float32)
        for i in tl.range(0, mine * steps, num_stages=STAGES, warp_specialize=WS):
            tile = pid + (i // steps) * programs
            s = i % steps
            a = tile // strips
            n0 = (tile % strips) * BLOCK_N
            e = tl.load(ids_ptr + a).to(tl.int32) - expert_offset
            held = (e >= 0) & (e < num_experts)
            e = tl.where(held, e, 0)  # not held: expert 0's bytes read, nothing stored
            t = a // TOP_K
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < tl.where(held, N, 0)  # not held: no row stored
            acc_g = tl.where(s == 0, 0.0, acc_g)  # a tile's first step: the default's zeros + p * f
            acc_u = tl.where(s == 0, 0.0, acc_u)
            acc_g, acc_u = _strip_step(acc_g, acc_u, w_desc, x_desc, s_desc, x_ptr + t * stride_xm, s_ptr, t, e, n0,
                                       cols, col_ok, s * BLOCK_K, N, K, stride_se, stride_sn, X_TMA, EXP_TMA,
                                       BLOCK_N, BLOCK_K)
            if s == steps - 1:
                _strip_out(acc_g, acc_u, a, e, cols, col_ok, N, inter_ptr, weight_ptr, bias_ptr, stride_im,
                           stride_bias_e, alpha, limit, HAS_BIAS, SWIGLU, ROUND)


class GateUpTma:
    """One variant's launch over one layer's MXFP4 w13 (uint8 [E, 2N, K / 2]), its exponents
    (uint8 [E, 2N, K / 32]) and bias: the descriptors built once (the transposed exponents too, as
    a loader would store them), then `(x_nm, ids, weights) -> [T*k, N]` fp32 x 2^64 nibble-major, the
    default kernel's intermediate. x_nm: mx_activations(x, nibble_major=True)."""

    def __init__(self, w13, s13, b13, knobs: dict, round_to, num_sms: int):
        self.e, two_n, half_k = w13.shape
        self.n, self.k = two_n // 2, half_k * 2
        self.knobs = dict(knobs)
        bn, bk = self.knobs["BLOCK_N"], self.knobs["BLOCK_K"]
        if self.k % 32 or bk % 128 or bn < 16:
            raise ValueError(f"K {self.k} must be whole exponent groups, BLOCK_K {bk} a multiple of 128, "
                             f"BLOCK_N {bn} >= 16 (the exponents' TMA box needs 16 bytes a row)")
        words = w13.view(torch.int32).reshape(self.e * two_n, self.k // 8)  # a view: rows are 16-byte multiples
        self.w_desc = TensorDescriptor.from_tensor(words, [bn, bk // 8])
        self.s13 = s13
        self.s_t = s13.transpose(1, 2).contiguous() if self.knobs.get("EXP_TMA") else None
        self.s_desc = TensorDescriptor.from_tensor(self.s_t, [1, bk // 32, bn]) if self.s_t is not None else None
        self.b13, self.round_to, self.num_sms = b13, round_to, num_sms

    def __call__(self, x_nm, ids, weights, out=None):
        kn = self.knobs
        bn, bk = kn["BLOCK_N"], kn["BLOCK_K"]
        t, top_k = ids.shape
        out = torch.empty((t * top_k, self.n), dtype=torch.float32, device=x_nm.device) if out is None else out
        x_desc = None
        if kn.get("X_TMA"):
            x_desc = TensorDescriptor(x_nm, [t, self.k // 32, 8, 4], [x_nm.stride(0), 32, 4, 1], [1, bk // 32, 1, 4])
        strips = triton.cdiv(self.n, bn)
        tiles = t * top_k * strips
        persist = kn.get("PERSIST", 0)
        grid = (min(tiles, persist * self.num_sms),) if persist else (t * top_k, strips)
        _gate_up_tma_kernel[grid](
            self.w_desc, x_desc, self.s_desc, x_nm, self.s13, out, ids.reshape(-1), weights, self.b13, self.n,
            self.k, self.e, 0, tiles, x_nm.stride(0), self.s13.stride(0), self.s13.stride(1), out.stride(0),
            self.b13.stride(0), ACT.alpha, ACT.limit,
            TOP_K=top_k, BLOCK_N=bn, BLOCK_K=bk, STAGES=kn.get("STAGES", 1), WS=kn.get("WS", False),
            X_TMA=kn.get("X_TMA", False), EXP_TMA=kn.get("EXP_TMA", False), PERSIST=persist, HAS_BIAS=True,
            SWIGLU=True, ROUND=self.round_to, num_warps=kn["warps"], **pdl_args(x_nm.device))
        return out


@triton.jit
def _down_tma_kernel(w_desc, inter_ptr, s_ptr, part_ptr, ids_ptr, weight_ptr, bias_ptr, N, K, num_experts,
                     expert_offset, stride_im, stride_se, stride_sn, stride_bias_e, TOP_K: tl.constexpr,
                     SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     WS: tl.constexpr, PDL: tl.constexpr = False):
    # _moe_decode_down_split_kernel's grid and partials (N = H, K = I): program (t, strip, j * SPLIT
    # + share) sums its share of slot j's K steps; the words [BLOCK_N, BLOCK_K / 8] by descriptor over
    # [E * H, I / 8] (shares are BLOCK_K-aligned, so only the last share's last step runs past I:
    # zeros), the intermediate row (nibble-major, x 2^64) and exponents by masked pointers.
    pdl_enter(PDL)
    G: tl.constexpr = BLOCK_K // 32
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    pid_p = tl.program_id(2)
    j = pid_p // SPLIT
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    k_begin = (pid_p % SPLIT) * per
    k_end = tl.maximum(tl.minimum(K, k_begin + per), k_begin)
    e = tl.load(ids_ptr + t * TOP_K + j).to(tl.int32) - expert_offset
    held = (e >= 0) & (e < num_experts)
    e = tl.where(held, e, 0)
    steps = tl.where(held, tl.cdiv(k_end - k_begin, BLOCK_K), 0)  # not held: no step, zeros written
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    gs = tl.arange(0, G)
    nm = (32 * gs[:, None] + tl.arange(0, 4)[None, :])[None, :, :]
    a_row = inter_ptr + (t * TOP_K + j).to(tl.int64) * stride_im + nm
    s_row = s_ptr + e * stride_se + cols[:, None, None].to(tl.int64) * stride_sn + _mxfp4_exponent_groups(gs)
    mx = tl.zeros([BLOCK_N, G, 4], dtype=tl.float32)
    for s in tl.range(0, steps, num_stages=STAGES, warp_specialize=WS):
        k0 = k_begin + s * BLOCK_K
        g_ok = gs < (k_end - k0) // 32
        q = w_desc.load([e * N + n0, k0 // 8]).reshape(BLOCK_N, G, 4)
        f = _mxfp4_word_exponents(s_row + k0 // 32, col_ok[:, None, None] & g_ok[None, :, None])
        mx = _mxfp4_scaled(mx, _mxfp4_dots(q, a_row + k0, g_ok[None, :, None], 4), f)
    out = _mxfp4_total(mx)
    wj = tl.where(held & (pid_p % SPLIT == 0), tl.load(weight_ptr + t * TOP_K + j).to(tl.float32), 0.0)
    out += wj * tl.load(bias_ptr + e * stride_bias_e + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(part_ptr + (pid_p * tl.num_programs(0) + t).to(tl.int64) * N + cols, out, mask=col_ok)


class DownTma:
    """One down-pass variant over w2 (uint8 [E, H, I / 2]), its exponents and bias: `(inter, ids,
    weights) -> [T, H]` in `out_dtype`, what fused_moe's split down pass and its finish return."""

    def __init__(self, w2, s2, b2, knobs: dict):
        self.e, self.n, half_k = w2.shape
        self.k, self.knobs = half_k * 2, dict(knobs)
        words = w2.view(torch.int32).reshape(self.e * self.n, self.k // 8)
        self.w_desc = TensorDescriptor.from_tensor(words, [self.knobs["BLOCK_N"], self.knobs["BLOCK_K"] // 8])
        self.s2, self.b2 = s2, b2

    def __call__(self, inter, ids, weights, out_dtype):
        kn = self.knobs
        t, top_k = ids.shape
        split = kn["SPLIT"]
        part = torch.empty((top_k * split, t, self.n), dtype=torch.float32, device=inter.device)
        _down_tma_kernel[(t, triton.cdiv(self.n, kn["BLOCK_N"]), top_k * split)](
            self.w_desc, inter, self.s2, part, ids.reshape(-1), weights, self.b2, self.n, self.k, self.e, 0,
            inter.stride(0), self.s2.stride(0), self.s2.stride(1), self.b2.stride(0),
            TOP_K=top_k, SPLIT=split, BLOCK_N=kn["BLOCK_N"], BLOCK_K=kn["BLOCK_K"], STAGES=kn["STAGES"],
            WS=kn.get("WS", False), num_warps=kn["warps"], **pdl_args(inter.device))
        out = torch.empty((t, self.n), dtype=out_dtype, device=inter.device)
        fm._moe_decode_down_finish[(t, triton.cdiv(self.n, fm.FINISH_BLOCK_N))](
            part, out, self.n, out.stride(0), PARTS=top_k * split, BLOCK_N=fm.FINISH_BLOCK_N, num_warps=4,
            **pdl_args(part.device))
        return out


def default_down(inter, w2, s2, b2, ids, weights, out_dtype):
    """fused_moe's down pass as the engine runs it (moe_decode_config's MXFP4 split pass + finish)."""
    cfg = fm.moe_decode_config(ids.shape[1], inter.shape[1], mxfp4=True, tokens=ids.shape[0])
    return fm._decode_down(inter, w2, weights, ids, 0, cfg, s2, None, b2, ACT, out_dtype=out_dtype)


def default_gate_up(x_nm, w13, s13, b13, ids, weights, round_to, out=None):
    """The default kernel as fused_moe's decode pass launches it (_decode_gate_up with
    moe_decode_config's MXFP4 tiles), minus mx_activations: the same [T*k, N] intermediate."""
    cfg = fm.moe_decode_config(ids.shape[1], w13.shape[1] // 2, mxfp4=True, tokens=ids.shape[0])
    e, two_n = w13.shape[:2]
    n, k, top_k = two_n // 2, x_nm.shape[1], ids.shape[1]
    quant, words, rows = fm._decode_weights(w13, s13, None)
    out = torch.empty((ids.numel(), n), dtype=torch.float32, device=x_nm.device) if out is None else out
    fm._moe_decode_gate_up_kernel[(ids.numel(), triton.cdiv(n, cfg["GU_BLOCK_N"]))](
        x_nm, words, out, ids.reshape(-1), weights, s13, b13, n, k, e, 0, x_nm.stride(0), *rows, out.stride(0),
        *fm._scale_args(s13, None, True), b13.stride(0), ACT.alpha, ACT.limit,
        TOP_K=top_k, BLOCK_N=cfg["GU_BLOCK_N"], BLOCK_K=cfg["GU_BLOCK_K"], HAS_BIAS=True, SWIGLU=True, **quant,
        num_warps=cfg["GU_WARPS"], PREFETCH=cfg.get("GU_PREFETCH", False), X_NM=cfg.get("GU_X_NM", False),
        SPLIT=1, part_ptr=None, ROUND=round_to, **pdl_args(x_nm.device))
    return out


def max_rel(out, ref) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def check() -> int:
    """The interpreter's comparison at tiny shapes; 0 when every variant equals the default."""
    torch.manual_seed(0)
    e, n, k, top_k, t = 4, 288, 320, 2, 2  # gate|up N x K = I x H; the down pass H x I
    w13 = torch.randint(0, 256, (e, 2 * n, k // 2), dtype=torch.uint8)
    s13 = torch.randint(119, 124, (e, 2 * n, k // 32), dtype=torch.uint8)
    b13 = torch.randn(e, 2 * n, dtype=torch.bfloat16) * 0.1
    w2 = torch.randint(0, 256, (e, k, n // 2), dtype=torch.uint8)
    s2 = torch.randint(119, 124, (e, k, n // 32), dtype=torch.uint8)
    b2 = torch.randn(e, k, dtype=torch.bfloat16) * 0.1
    x = torch.randn(t, k, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 3], [3, 0]], dtype=torch.int32)
    weights = torch.rand(t, top_k)
    x_nm = fm.mx_activations(x, True)
    inter = default_gate_up(x_nm, w13, s13, b13, ids, weights, tl.bfloat16)
    ref_down = default_down(inter, w2, s2, b2, ids, weights, torch.bfloat16)
    runs = [(name, kn, lambda kn: GateUpTma(w13, s13, b13, kn, tl.bfloat16, num_sms=3)(x_nm, ids, weights), inter)
            for name, kn in VARIANTS]
    runs += [(name, kn, lambda kn: DownTma(w2, s2, b2, kn)(inter, ids, weights, torch.bfloat16), ref_down)
             for name, kn in DOWN_VARIANTS]
    seen, failed = set(), 0
    for name, knobs, launch, ref in runs:
        # The interpreter ignores stages, warps and warp specialization: one run per distinct math.
        key = (name.startswith("down"),) + tuple(sorted((kk, v) for kk, v in knobs.items()
                                                        if kk not in ("STAGES", "warps", "WS")))
        if key in seen:
            print(f"{name}: same code in the interpreter as a variant above")
            continue
        seen.add(key)
        try:
            out = launch(knobs)
        except Exception as exc:  # said, the rest go on
            print(f"{name}: FAILED to run: {type(exc).__name__}: {str(exc)[:200]}")
            failed += 1
            continue
        err, equal = max_rel(out.float(), ref.float()), torch.equal(out, ref)
        ok = equal or err < 1e-6
        failed += not ok
        print(f"{name}: max rel. err {err:.1e}, bit-equal {equal}: {'ok' if ok else 'MISMATCH'}")
    print("check:", "FAILED" if failed else "ok")
    return 1 if failed else 0


def sass() -> None:
    """Every variant and the default kernel compiled for sm_90 on this machine (no GPU: the
    installed Triton's ptxas), gpt-oss-120b's shapes at one token: registers and the K loop's SASS
    (tools/sass_loop.py's longest backward branch, a step, or two where the pipeliner unrolled it)."""
    import collections

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
    import sass_loop
    from triton.runtime.jit import JITFunction

    e, n, k, top_k = 128, 2880, 2880, 4
    # Untouched torch.empty pages cost no memory: the tensors have the real shapes and strides.
    w13, s13 = torch.empty((e, 2 * n, k // 2), dtype=torch.uint8), torch.empty((e, 2 * n, k // 32), dtype=torch.uint8)
    b13, x_nm = torch.zeros((e, 2 * n), dtype=torch.bfloat16), torch.empty((1, k))
    ids, weights = torch.tensor([[3, 17, 64, 101]], dtype=torch.int32), torch.full((top_k,), 0.25)
    compiled, original = sass_loop.Compiled(), JITFunction.run
    kinds = ("UTMALDG", "SYNCS", "BAR", "LDS", "LDG", "LDGSTS", "SHFL", "FFMA")
    print(f"triton {triton.__version__}, sm_90: | variant | registers | loop SASS | " + " | ".join(kinds) + " |")
    runs = [("default kernel", lambda: default_gate_up(x_nm, w13, s13, b13, ids, weights, tl.bfloat16))]
    runs += [(name, lambda kn=kn: GateUpTma(w13, s13, b13, kn, tl.bfloat16, 132)(x_nm, ids, weights))
             for name, kn in VARIANTS]
    w2, s2 = torch.empty((e, k, n // 2), dtype=torch.uint8), torch.empty((e, k, n // 32), dtype=torch.uint8)
    b2, inter = torch.zeros((e, k), dtype=torch.bfloat16), torch.empty((top_k, n))
    runs += [("default down (split)", lambda: default_down(inter, w2, s2, b2, ids, weights, torch.bfloat16))]
    runs += [(name, lambda kn=kn: DownTma(w2, s2, b2, kn)(inter, ids, weights, torch.bfloat16))
             for name, kn in DOWN_VARIANTS]
    JITFunction.run = lambda self, *a, grid, warmup, **kw: compiled.run(self, a, kw)
    try:
        for name, launch in runs:
            first = len(compiled.kernels)
            try:
                launch()
            except Exception as exc:  # said, the rest go on
                print(f"| {name} | did not compile: {type(exc).__name__}: {' '.join(str(exc).split())[:160]} |")
                continue
            new = [c for c in compiled.kernels[first:] if "finish" not in c[0]]  # the pass, not the down's sum
            if not new:
                print(f"| {name} | the same kernel as a row above |")
                continue
            code, regs = sass_loop.disassemble(new[-1][3])
            ops = collections.Counter(op for op in sass_loop.k_loop(code))
            print(f"| {name} | {regs} | {sum(ops.values())} | " + " | ".join(str(ops[o]) for o in kinds) + " |",
                  flush=True)
    finally:
        JITFunction.run = original


def timed(args) -> None:
    from mxfp4_kernel import copy_gbs  # this folder's: the script's own directory is on sys.path
    from mxfp4_ncu import E, H, I, TOP_K, layer, routings

    from pdserve.bench.moe import graph_call_ms

    t0 = time.monotonic()
    bw = copy_gbs()
    w13, s13, w2, s2, b13, b2 = layer()
    ids, topw = routings(20)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    x_nm = fm.mx_activations(x, True)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    gu_bytes, down_bytes = TOP_K * 2 * I * (H // 2 + H // 32), TOP_K * H * (I // 2 + I // 32)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, same-run copy "
             f"bandwidth {bw:.0f} GB/s. gpt-oss-120b's experts at 1 token (E={E}, H=I={H}, top-{TOP_K}, MXFP4, "
             f"biases, clamped SwiGLU): the kernel alone (down: its split pass + finish), us a call, 20 routings a "
             f"CUDA graph; % of copy: the words and exponents read ({gu_bytes / 1e6:.2f} MB gate|up, "
             f"{down_bytes / 1e6:.2f} MB down). Error: max |v - default| / max |default| over 2 routings.", "",
             "| variant | knobs | us | % of copy | vs default | max rel. err | bit-equal |",
             "|---|---|---:|---:|---:|---:|---:|"]

    def say(line):  # printed and the table rewritten: a process that dies mid-run keeps its rows
        lines.append(line)
        print(line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(lines) + "\n")

    def row(name, knobs, fn, nbytes):
        us = graph_call_ms(fn, 20) * 1e3
        return us, f"| {name} | {knobs} | {us:.1f} | {100 * nbytes / (us * 1e-6) / (bw * 1e9):.0f}% |"

    def gate_up(r):
        return default_gate_up(x_nm, w13, s13, b13, ids[r], topw, tl.bfloat16)

    base = {}  # "gu" / "down": (the default's us, its outputs of routings 0 and 1), measured at first use

    def baseline(kind):
        if kind in base:
            return base[kind]
        if kind == "gu":
            us, text = row("default gate\\|up kernel", "16x256, 4 warps", gate_up, gu_bytes)
            say(text + " 1.00x | 0 | yes |")
            cfg = fm.moe_decode_config(TOP_K, I, mxfp4=True, tokens=1)
            _, text = row("gate\\|up engine path (mx_activations + default)", "fused_moe._decode_gate_up",
                          lambda r: fm._decode_gate_up(x, w13, topw, ids[r], 0, cfg, s13, None, b13, ACT), gu_bytes)
            say(text + " | | |")
            base[kind] = us, [gate_up(r) for r in (0, 1)]
        else:
            inters = [gate_up(r) for r in range(20)]  # each routing's own intermediate, made once
            base["inters"] = inters
            fn = lambda r: default_down(inters[r], w2, s2, b2, ids[r], topw, torch.bfloat16)
            us, text = row("default down (split 2 + finish)", "16 rows x 256, 4 warps", fn, down_bytes)
            say(text + " 1.00x | 0 | yes |")
            base[kind] = us, [fn(r).float() for r in (0, 1)]
        return base[kind]

    runs = [(name, kn, "gu") for name, kn in VARIANTS] + [(name, kn, "down") for name, kn in DOWN_VARIANTS]
    for i in args.only or range(len(runs)):
        name, knobs, kind = runs[i]
        short = " ".join(f"{kk}={v}" for kk, v in knobs.items())
        if time.monotonic() - t0 > args.budget:
            say(f"| {name} | {short} | not run (--budget {args.budget:.0f} s spent) | | | | |")
            continue
        try:
            us0, ref = baseline(kind)
            if kind == "gu":
                v = GateUpTma(w13, s13, b13, knobs, tl.bfloat16, num_sms)
                fn, nbytes = (lambda r, v=v: v(x_nm, ids[r], topw)), gu_bytes
            else:
                v, inters = DownTma(w2, s2, b2, knobs), base["inters"]
                fn, nbytes = (lambda r, v=v: v(inters[r], ids[r], topw, torch.bfloat16)), down_bytes
            outs = [fn(r).float() for r in (0, 1)]  # compiles here: a refusal lands in except
            torch.cuda.synchronize()
            err = max(max_rel(o, ref_r) for o, ref_r in zip(outs, ref))
            equal = all(torch.equal(o, ref_r) for o, ref_r in zip(outs, ref))
            us, text = row(name, short, fn, nbytes)
            say(text + f" {us0 / us:.2f}x | {err:.1e} | {'yes' if equal else 'no'} |")
        except Exception as exc:  # a variant Triton refuses (or that faults): said, the rest go on
            why = " ".join(str(exc).split())[:160].replace("|", "/")
            say(f"| {name} | {short} | did not run: {type(exc).__name__}: {why} | | | | |")
            if "illegal" in str(exc).lower() or "unspecified launch" in str(exc).lower():
                say("(the CUDA context is lost after a fault: the rest not run; --only skips this one)")
                break


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", choices=("time", "sass"),
                    help="time: the variants on the GPU; sass: each compiled for sm_90 here, its K loop counted")
    ap.add_argument("--check", action="store_true", help="the interpreter's comparison on CPU at tiny shapes")
    ap.add_argument("--out")
    ap.add_argument("--only", type=int, nargs="*", default=[],
                    help="indices into VARIANTS + DOWN_VARIANTS, run in this order (time)")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds after which no new variant starts (time)")
    args = ap.parse_args()
    if args.check:
        sys.exit(check())
    if args.mode is None:
        ap.error("say `time` (GPU), `sass` or --check (CPU)")
    sass() if args.mode == "sass" else timed(args)


if __name__ == "__main__":
    main()
