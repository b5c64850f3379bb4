"""The GEMV, FP8 block GEMM, MoE gate, MoE split down pass and split decode attention kernels
compile for an sm90 card (tests/kernels/sm90_compile.py), on CPU: what the interpreter cannot say
(it runs their Python, not Triton's compiler), said before a GPU runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile.py")


def _has_cuda_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_cuda_backend(), reason="this Triton build has no CUDA backend to compile with")
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled here, not taken from an earlier run's cache
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled fused_gemv._gemv_kernel: 12 variants" in proc.stdout
    assert "compiled fp8_gemv._fp8_gemv_kernel: 20 variants" in proc.stdout
    assert "compiled fp8_block_gemm._fp8_block_gemm_kernel: 4 variants" in proc.stdout
    assert "compiled moe_gate._moe_gate_kernel: 6 variants" in proc.stdout
    assert "compiled paged_decode_attention._decode_split_kernel: 6 variants" in proc.stdout
    assert "compiled fused_moe._moe_decode_down_split_kernel: 6 variants" in proc.stdout
