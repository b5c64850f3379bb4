"""What every kernel launcher shares: argument checks with clear messages, and launch facts.

Launchers check everything that is knowable on the host without a device sync (shapes,
dtypes, devices, strides); values inside index tensors (slot ids, block ids, context
lengths) are the caller's contract, because reading them back would stall the GPU and break
CUDA-graph capture.
"""

from __future__ import annotations

import functools
import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
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
