"""bench/kernel_profile.py: kernels grouped by name, as the FP8 and offline benchmarks print them."""

from pdserve.bench.kernel_profile import group_of, kernel_groups, kernel_lines


def test_kernels_fall_into_their_groups_first_match_first():
    assert group_of("_fp8_gemv_kernel") == "fp8 GEMV"  # not the bf16 GEMV's "_gemv"
    assert group_of("_fp8_block_gemm_kernel") == "fp8 block GEMM (Triton)"
    assert group_of("_gemv_kernel") == "bf16 GEMV (Triton)"
    assert group_of("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128") == "cuBLAS / CUTLASS GEMM"
    assert group_of("_paged_decode_attention_kernel") == "attention"
    assert group_of("_rms_norm_quant_fp8_kernel").startswith("activation quantization")
    assert group_of("_rotary_kv_write_kernel") == "norm / rotary / KV write / SiLU"
    assert group_of("void at::native::elementwise_kernel<128, 4>") == "other"


def test_groups_sum_calls_and_time_and_the_table_names_the_total():
    kernels = [("_fp8_gemv_kernel", 10, 500.0), ("nvjet_hsh_256x128", 4, 300.0), ("_fp8_gemv_kernel_b", 2, 100.0),
               ("memcpy", 1, 100.0)]
    groups = kernel_groups(kernels)
    assert list(groups) == ["fp8 GEMV", "cuBLAS / CUTLASS GEMM", "other"]
    assert groups["fp8 GEMV"] == (12, 600.0)
    text = "\n".join(kernel_lines(kernels, top=2))
    assert "GPU kernels 1.0 ms in 17 launches" in text
    assert "| fp8 GEMV | 12 | 0.6 | 60% |" in text and "memcpy" not in text.split("| group |")[0]


def test_attention_kernels_by_their_names_and_the_pdl_caveat():
    for name in ("_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel", "_mla_decode_kernel"):
        assert group_of(name) == "attention", name
    kernels = [("_decode_split_kernel", 4, 400.0), ("_quantize_fp8_kernel", 4, 390.0)]
    assert "timed from residency" in "\n".join(kernel_lines(kernels, top=2, pdl=True))
    assert "residency" not in "\n".join(kernel_lines(kernels, top=2, pdl=False))
