"""Compile kernels for an sm90 card (H100/H200) on a machine without one: Triton's whole pipeline,
source to cubin (its bundled ptxas), no launch. The interpreter runs a kernel's Python; this
catches what only the compiler rejects (a constexpr branch's variable, a helper's return, an
op the backend lacks) before a GPU session finds it. Run by tests/kernels/test_sm90_compile.py in
a process without TRITON_INTERPRET (under it `triton.jit` makes interpreted functions, which the
compiler cannot take).

    python tests/kernels/sm90_compile.py    -> one line per kernel, exit 1 on the first failure
"""

from __future__ import annotations

import itertools
import sys


def variants():
    """(name, jit function, argument types (or a function of the constexprs giving them), [constexpr
    values]) per kernel checked."""
    import triton.language as tl

    from pdserve.kernels import fp8_block_gemm, fp8_gemv, fused_gemv, fused_moe, moe_gate, paged_decode_attention

    gemv_types = {n: "*bf16" for n in ("x_ptr", "res_ptr", "g_ptr", "w_ptr", "b_ptr", "out_ptr", "new_res_ptr")}
    gemv_types.update(part_ptr="*fp32", ss_ptr="*fp32", counter_ptr="*i32", eps="fp32")
    gemv_types.update({n: "i32" for n in ("M", "N", "K", "K_PER_SPLIT", "stride_xm", "stride_rm", "stride_wn",
                                          "stride_om", "stride_nm")})
    # Each branch at least once rather than every product of them (a compile of one variant takes
    # ~2 s of CI's CPU): per prologue (and the two-pass norm) every K-split mode, the one-row and
    # the 16-row tiles and the early weight load alternating.
    gemv = []
    for i, ((prologue, two_pass), (split, here)) in enumerate(itertools.product(
            ((0, False), (1, False), (1, True), (2, False)), ((1, False), (3, False), (3, True)))):
        rows, early = (1, 16)[i % 2], i % 4 >= 2
        gemv.append(dict(PROLOGUE=prologue, HAS_RESIDUAL=prologue == 1, HAS_BIAS=True, SPLIT=split,
                         REDUCE_HERE=here, TWO_PASS=two_pass, DOT_F32=False, PRECISION="tf32", BLOCK_M=rows,
                         BLOCK_N=2 if rows == 1 else 16, BLOCK_K=1024 if rows == 1 else 128, EARLY_W=early,
                         PDL=True))
    fp8_types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", out_ptr="*fp32", final_ptr="*bf16",
                     counter_ptr="*i32", res_ptr="*bf16", g_ptr="*bf16", new_res_ptr="*bf16", eps="fp32")
    fp8_types.update({n: "i32" for n in ("M", "N", "K", "K_SPLIT", "SPLITS", "stride_xm", "stride_wn", "stride_sn",
                                         "stride_os", "stride_om", "stride_fm", "stride_rm", "stride_nm")})
    # Group scales at one row also with K steps of several groups (WIDE); 64-row dots with group scales.
    fp8 = [dict(REDUCE_HERE=here, BLOCKED=blocked, SCALE_ROWS=128 if blocked else 1, GROUP=128, DOT_F32=False,
                PRECISION="tf32", ONE_ROW=one_row, BLOCK_M=64 if blocked else 16, BLOCK_N=8 if one_row else 32,
                BLOCK_K=128 if blocked and not wide else 1024, EARLY_W=early, WIDE=wide, PDL=True, PROLOGUE=0,
                HAS_RESIDUAL=False)
           for blocked, one_row, early, here, wide in itertools.product((False, True), repeat=5)
           if (one_row or not early) and (not wide or blocked and one_row)]
    # The prologues (the norm with a residual, SiLU·mul): one row (early weights, wide group steps,
    # the in-kernel sum) and 16-row dots.
    fp8 += [dict(REDUCE_HERE=one_row, BLOCKED=blocked, SCALE_ROWS=128 if blocked else 1, GROUP=128, DOT_F32=False,
                 PRECISION="tf32", ONE_ROW=one_row, BLOCK_M=16, BLOCK_N=8 if one_row else 32,
                 BLOCK_K=512 if one_row else 128, EARLY_W=one_row, WIDE=blocked and one_row, PDL=True,
                 PROLOGUE=prologue, HAS_RESIDUAL=prologue == 1)
            for prologue, one_row in itertools.product((1, 2), (True, False)) for blocked in (prologue == 1,)]
    gate_types = dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", part_ptr="*fp32", weights_ptr="*fp32",
                      ids_ptr="*i64", counter_ptr="*i32", K="i32", E="i32", stride_xt="i32", stride_we="i32",
                      res_ptr="*bf16", g_ptr="*bf16", h_ptr="*bf16", new_res_ptr="*bf16", eps="fp32",
                      stride_rt="i32", stride_ht="i32", stride_nt="i32")
    gate = [dict(TOP_K=4, K_TILE=4, E_TILE=128, BLOCK_E=16, BLOCK_K=512, SPLIT=split, HAS_BIAS=i % 2 == 0,
                 RENORMALIZE=i % 3 == 0, ROUND=tl.bfloat16, NORM=norm is not None, HAS_RESIDUAL=bool(norm),
                 BLOCK_H=2048, PDL=True)
            for i, (split, norm) in enumerate(itertools.product((1, 6), (None, False, True)))]
    attn_types = dict(q_ptr="*bf16", bt_ptr="*i32", ctx_ptr="*i32", out_ptr="*bf16", part_out_ptr="*fp32",
                      part_lse_ptr="*fp32", sem_ptr="*i32", pos_ptr="*i64", slot_ptr="*i64", k_new_ptr="*bf16",
                      v_new_ptr="*bf16", bias_ptr="*bf16", cs_ptr="*fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                      sinks_ptr="*fp32", scale_log2="fp32", q_norm_ptr="*bf16", k_norm_ptr="*bf16", norm_eps="fp32")
    attn_types.update({n: "i32" for n in paged_decode_attention._decode_split_kernel.arg_names
                       if n.startswith("stride_") or n in ("num_splits", "window")})
    # Per split mode both caches' dtypes and both the rotary and the sliding-window variants, the
    # cache dtype alternating between them (the longest compiles here: ~3 s each).
    attn = []
    for i, ((split, fused), (rotary, sliding)) in enumerate(itertools.product(
            ((False, False), (True, False), (True, True)), ((False, True), (True, False)))):
        kv_fp8 = (i + i // 2) % 2 == 1
        attn.append(dict(GROUP=8, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=64, SPLIT=split,
                         FUSED_REDUCE=fused, ROTARY=rotary, HAS_BIAS=rotary, QK_NORM=rotary and not kv_fp8,
                         KV_FP8=kv_fp8, DOT_F32=False, PRECISION="tf32", SLIDING=sliding, HAS_SINKS=sliding, PDL=True))
    # The cache's dtype is a pointer type per variant (fp8 or bf16).
    attn_kv = {False: dict(k_ptr="*bf16", v_ptr="*bf16"), True: dict(k_ptr="*fp8e4nv", v_ptr="*fp8e4nv")}
    down_types = dict(part_ptr="*fp32", ids_ptr="*i64", weight_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16",
                      counter_ptr="*i32")
    down_types.update({n: "i32" for n in fused_moe._moe_decode_down_split_kernel.arg_names
                       if n.startswith("stride_") or n in ("N", "K", "num_experts", "expert_offset")})
    # Per weight format: the intermediate row's, the weight's and the scales' element types.
    down_formats = {"bf16": dict(inter_ptr="*bf16", w2_ptr="*bf16", s_ptr="*bf16"),
                    "fp8": dict(inter_ptr="*bf16", w2_ptr="*fp8e4nv", s_ptr="*fp32"),
                    "mxfp4": dict(inter_ptr="*fp32", w2_ptr="*i32", s_ptr="*u8")}
    down = [dict(TOP_K=8, SPLIT=split, BLOCK_N=32, BLOCK_K=128 if fmt == "fp8" else 256, HAS_BIAS=fmt == "mxfp4",
                 FP8=fmt == "fp8", MXFP4=fmt == "mxfp4", SCALE_ROWS=128 if fmt == "fp8" else 1,
                 GROUP_K=128 if fmt == "fp8" else 1, REDUCE_HERE=here, PDL=True, FORMAT=fmt)
            for fmt, (split, here) in itertools.product(down_formats, ((1, False), (2, True)))]
    block_types = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", b_ptr="*fp8e4nv", bs_ptr="*fp32", c_ptr="*bf16",
                       part_ptr="*fp32", counter_ptr="*i32")
    block_types.update({n: "i32" for n in ("M", "N", "K", "GROUPS_PER_SPLIT", "stride_am", "stride_asm", "stride_bn",
                                           "stride_bsn", "stride_cm", "stride_ps")})
    # K split (the tile's last slice sums) or not; group scales or per-token x per-row (fp8_rowwise_gemm).
    block = [dict(SPLITS=splits, SCALE_ROWS=1 if rowwise else 128, ROWWISE=rowwise, BLOCK_M=64, BLOCK_N=64,
                  BLOCK_K=128, PDL=True)
             for splits, rowwise in itertools.product((1, 3), (False, True))]
    return [("fused_gemv._gemv_kernel", fused_gemv._gemv_kernel, gemv_types, gemv),
            ("fp8_block_gemm._fp8_block_gemm_kernel", fp8_block_gemm._fp8_block_gemm_kernel, block_types, block),
            ("fp8_gemv._fp8_gemv_kernel", fp8_gemv._fp8_gemv_kernel, fp8_types, fp8),
            ("moe_gate._moe_gate_kernel", moe_gate._moe_gate_kernel, gate_types, gate),
            ("paged_decode_attention._decode_split_kernel", paged_decode_attention._decode_split_kernel,
             lambda c: attn_types | attn_kv[c["KV_FP8"]], attn),
            ("fused_moe._moe_decode_down_split_kernel", fused_moe._moe_decode_down_split_kernel,
             lambda c: down_types | down_formats[c["FORMAT"]], down)]


def compile_sm90(fn, types, constexprs: dict) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    types = types(constexprs) if callable(types) else types
    constexprs = {k: v for k, v in constexprs.items() if k in names}  # the rest name a variant's types
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})


def main() -> int:
    for name, fn, types, constexpr_sets in variants():
        for c in constexpr_sets:
            try:
                compile_sm90(fn, types, c)
            except Exception as e:
                print(f"FAILED {name} {c}: {type(e).__name__}: {e}", flush=True)
                return 1
        print(f"compiled {name}: {len(constexpr_sets)} variants", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
