"""The CPU engine's element-wise stages: the references' functions (rms_norm_ref, rotary_ref,
silu_and_mul_ref), on bf16 rows through the native kernels (cpu_pointwise.c), each one call
instead of 5-15 torch operators; anything else (fp32, fp16, a weight of another dtype, rows not
contiguous in their last dimension, no compiler) runs the reference itself.

Each native call is single-threaded: at decode sizes (a few rows of 576-1536 values) a parallel
region costs more than the work; a prompt's rows are split over torch's intra-op threads, as the
native decode attention splits its batch (ctypes releases the GIL).
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref

# Rows a thread takes before a call is split over threads (a prompt, not a decode batch).
ROWS_PER_THREAD = 64
MAX_HEAD_DIM = 1024  # rotary_bf16's stack arrays


def _rows_split(rows: int, run) -> None:
    """run(lo, hi) over [0, rows): one call, or a share per intra-op thread for many rows."""
    cpu_native.run_split(rows, min(cpu_native.threads(), rows // ROWS_PER_THREAD), run)


def _bf16_rows(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.stride(-1) == 1 for t in ts)


def _row(t: torch.Tensor, i: int) -> int:
    """Address of row i (no `t[i]` view: one tensor fewer per call)."""
    return t.data_ptr() + i * t.stride(0) * t.element_size()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """= rms_norm_ref: (normed, x + residual or None)."""
    if (x.dim() != 2 or not _bf16_rows(x, weight) or not weight.is_contiguous()
            or (residual is not None and (not _bf16_rows(residual) or residual.shape != x.shape))
            or (lib := cpu_native.pointwise()) is None):
        return rms_norm_ref(x, weight, eps, residual)
    T, H = x.shape
    out = torch.empty(T, H, dtype=torch.bfloat16)
    res_out = torch.empty(T, H, dtype=torch.bfloat16) if residual is not None else None

    def run(lo: int, hi: int) -> None:
        res_args = (_row(residual, lo), residual.stride(0)) if residual is not None else (None, 0)
        res_out_ptr = _row(res_out, lo) if res_out is not None else None
        lib.rms_norm_bf16(_row(x, lo), x.stride(0), *res_args, weight.data_ptr(), hi - lo, H, eps,
                          _row(out, lo), H, res_out_ptr, H, cpu_native.scratch_floats(H).data_ptr())

    if T:
        _rows_split(T, run)
    return out, res_out


def rotary_cpu(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    """= rotary_ref: (rotated q, rotated k), new tensors."""
    D = q.shape[-1]
    if (q.dim() != 3 or k.dim() != 3 or not _bf16_rows(q, k) or D % 2 or D > MAX_HEAD_DIM
            or k.shape[-1] != D or cos_sin_cache.dtype != torch.float32 or cos_sin_cache.shape[-1] != D
            or cos_sin_cache.stride(-1) != 1 or (lib := cpu_native.pointwise()) is None):
        return rotary_ref(positions, q, k, cos_sin_cache)
    pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() \
        else positions.to(torch.int64).contiguous()
    qo, ko = torch.empty(q.shape, dtype=torch.bfloat16), torch.empty(k.shape, dtype=torch.bfloat16)

    def run(lo: int, hi: int) -> None:
        for src, dst in ((q, qo), (k, ko)):
            lib.rotary_bf16(_row(src, lo), src.stride(0), src.stride(1), hi - lo, src.shape[1], D,
                            _row(pos, lo), cos_sin_cache.data_ptr(), cos_sin_cache.stride(0),
                            _row(dst, lo), dst.stride(0), dst.stride(1))

    if q.shape[0]:
        _rows_split(q.shape[0], run)
    return qo, ko


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """= silu_and_mul_ref: [T, 2I] -> [T, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or not _bf16_rows(x) or (lib := cpu_native.pointwise()) is None:
        return silu_and_mul_ref(x)
    T, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(T, inter, dtype=torch.bfloat16)

    def run(lo: int, hi: int) -> None:
        lib.silu_and_mul_bf16(_row(x, lo), x.stride(0), hi - lo, inter, _row(out, lo), inter)

    if T:
        _rows_split(T, run)
    return out
