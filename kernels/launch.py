"""What every kernel launcher shares: argument checks with clear messages, and launch facts.

Launchers check everything that is knowable on the host without a device sync (shapes,
dtypes, devices, strides); values inside index tensors (slot ids, block ids, context
lengths) are the caller's contract, because reading them back would stall the GPU and break
CUDA-graph capture.
"""

from __future__ import annotations

import functools
import math
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What a KV cache may hold: the model's float types, or float8 e4m3 with per-layer scales
# (kernels/reference.py's quantize_kv / dequantize_kv say how).
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
KV_DTYPES = FLOAT_DTYPES + (FP8_KV_DTYPE,)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1), where kernels take CPU tensors.

    The only place pdserve.kernels reads the environment; Triton itself reads the same
    variable when a kernel is decorated.
    """
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def check_tensor(
    fn: str,
    name: str,
    t: object,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
) -> None:
    """Checks rank, sizes (None = any) and dtype; raises ValueError/TypeError naming `fn(name)`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{fn}: {name} has shape {list(t.shape)}, expected {want_s}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{fn}: {name} has dtype {str(t.dtype).removeprefix('torch.')}, expected one of {names}")


def check_devices(fn: str, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and that device is CUDA unless the interpreter runs."""
    devices = {name: t.device for name, t in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise ValueError(f"{fn}: {name} is on {dev} but {first_name} is on {first}")
    if first.type != "cuda" and not interpreting():
        raise ValueError(
            f"{fn}: tensors are on {first}; the Triton kernel needs CUDA tensors "
            f"(use pdserve.kernels.reference on CPU, or TRITON_INTERPRET=1 to test the kernel on CPU)"
        )
    return first


def check_same_layout(fn: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """The kernels index K and V caches with one set of strides."""
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        raise ValueError(
            f"{fn}: {a_name} and {b_name} must have the same shape, strides and dtype, got "
            f"{list(a.shape)}/{a.stride()}/{a.dtype} and {list(b.shape)}/{b.stride()}/{b.dtype}"
        )


def kv_scales(fn: str, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
              v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k_scale, v_scale, fp8) for a launch: an fp8 cache's [1] fp32 scales (None = 1.0, made
    here: callers that capture CUDA graphs pass their own), or any pointer where the cache is
    not fp8 (the kernels never read it then)."""
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{fn}: k_scale/v_scale are for an fp8 KV cache; this one is {k_cache.dtype}")
        return k_cache, k_cache, False
    scales = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            s = torch.ones(1, dtype=torch.float32, device=k_cache.device)
        check_tensor(fn, name, s, (1,), (torch.float32,))
        check_devices(fn, k_cache=k_cache, **{name: s})
        scales.append(s)
    return scales[0], scales[1], True


def cache_dtypes(q_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """What a paged KV cache read with queries of `q_dtype` may hold: q's own dtype, or fp8."""
    return (q_dtype, FP8_KV_DTYPE)


def check_paged_kv(fn: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The paged attention launchers' checks of q [T, Hq, D] against the caches
    [blocks, block_size, Hkv, D] (Hq a multiple of Hkv); returns kv_scales' (k_scale, v_scale, fp8)."""
    check_tensor(fn, "q", q, (None, None, None), FLOAT_DTYPES)
    hq, d = q.shape[1], q.shape[2]
    check_tensor(fn, "k_cache", k_cache, (None, None, None, d), cache_dtypes(q.dtype))
    check_same_layout(fn, "k_cache", k_cache, "v_cache", v_cache)
    scales = kv_scales(fn, k_cache, k_scale, v_scale)
    hkv = k_cache.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{fn}: query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return scales


def check_block_tables_and_scale(fn: str, block_tables: torch.Tensor, scale: float) -> None:
    """The kernels step along a block-table row by one element; the softmax scale must be finite."""
    if block_tables.stride(1) != 1:
        raise ValueError(f"{fn}: block_tables must be contiguous in its last dimension")
    if not math.isfinite(scale):
        raise ValueError(f"{fn}: scale must be finite, got {scale}")


def dot_in_f32(dtype: torch.dtype) -> bool:
    """Whether attention kernels upcast tl.dot operands to float32.

    Triton 3.9's interpreter multiplies bfloat16 operands as their raw uint16 bits (garbage),
    so under the interpreter bf16 tiles are upcast first; on the GPU they go to the tensor
    cores as bf16.
    """
    return interpreting() and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would silently run as tf32 (~3e-4 relative error); "ieee" keeps fp32 exact.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors, to size split-K grids; a small stand-in under the interpreter."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_sinks_window(fn: str, sinks: torch.Tensor | None, window: int, heads: int, device: torch.device) -> None:
    """The optional gpt-oss arguments of the attention launchers: sinks [heads], window >= 0."""
    if sinks is not None:
        check_tensor(fn, "sinks", sinks, (heads,), FLOAT_DTYPES)
        if sinks.device != device:
            raise ValueError(f"{fn}: sinks is on {sinks.device} but q is on {device}")
        if not sinks.is_contiguous():
            raise ValueError(f"{fn}: sinks must be contiguous")
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"{fn}: window must be an int >= 0 (0: no sliding window), got {window!r}")
