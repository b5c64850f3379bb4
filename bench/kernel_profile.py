"""GPU time per kernel of one run under torch.profiler: where a benchmark's GPU time goes.

Kernels are grouped by name (`kernel_groups`) so two engines' profiles read side by side: the
GEMMs by path (cuBLAS, the FP8 GEMV, the Triton block GEMM), attention, the activation
quantization, the rest.

Under programmatic dependent launch (kernels/pdl.py, on by default on sm90) a kernel launched
right after a Triton kernel becomes resident while that one still runs and waits inside: the
profiler times it from residency, so its time includes its predecessor's tail (on an H100 the FP8
o_proj's quantization, after the decode attention, read as long as the attention). The table says
so; PDSERVE_PDL=0 times each kernel alone (graphs captured after it is set).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (group, substrings of the kernel's name), first match wins; names are lowercased.
GROUPS = (
    ("fp8 GEMV", ("_fp8_gemv",)),
    ("fp8 block GEMM (Triton)", ("_fp8_block_gemm",)),
    ("bf16 GEMV (Triton)", ("fused_gemv", "_gemv")),
    ("cuBLAS / CUTLASS GEMM", ("gemm", "cutlass", "nvjet", "xmma", "sm90_")),
    ("attention", ("attention", "attn", "flash", "_decode_split", "_decode_reduce", "_prefill_kernel", "_mla_")),
    ("activation quantization (alone or in a norm / SiLU·mul)", ("quant",)),
    ("norm / rotary / KV write / SiLU", ("rms", "norm", "rotary", "kv_write", "silu", "act_and_mul")),
)


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(key in low for key in keys):
            return group
    return "other"


def profile_kernels(run: Callable[[], object]) -> list[tuple[str, int, float]]:
    """(kernel name, calls, GPU µs) of every kernel `run` launched, most time first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ks = [(e.key, e.count, e.self_device_time_total) for e in prof.key_averages()
          if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    return sorted(ks, key=lambda k: -k[2])


def pdl_in_effect() -> bool:
    """Whether Triton kernels launched now on this process's GPU take programmatic dependent launch."""
    if not torch.cuda.is_available():
        return False
    from pdserve.kernels.pdl import pdl_args

    return bool(pdl_args(torch.device("cuda")))


def kernel_groups(kernels: list[tuple[str, int, float]]) -> dict[str, tuple[int, float]]:
    """Calls and GPU µs per group, most time first."""
    out: dict[str, list] = {}
    for name, calls, us in kernels:
        g = out.setdefault(group_of(name), [0, 0.0])
        g[0] += calls
        g[1] += us
    return {k: (v[0], v[1]) for k, v in sorted(out.items(), key=lambda kv: -kv[1][1])}


PDL_NOTE = ("programmatic dependent launch on: a kernel after a Triton kernel is timed from residency, "
            "its wait included (times overlap; PDSERVE_PDL=0 for each kernel's own)")


def kernel_lines(kernels: list[tuple[str, int, float]], top: int, pdl: bool | None = None) -> list[str]:
    """The total, the `top` kernels of most GPU time and the groups, as markdown; `pdl`: the run
    launched with programmatic dependent launch (the module doc), said under the total (None: as
    this process launches now, `pdl_in_effect()`)."""
    if pdl is None:
        pdl = pdl_in_effect()
    total = sum(k[2] for k in kernels)
    lines = [f"under the profiler: GPU kernels {total / 1e3:.1f} ms in {sum(k[1] for k in kernels)} launches", "",
             *([PDL_NOTE, ""] if pdl else []),
             "| kernel | calls | ms | µs/call |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name[:80]} | {calls} | {us / 1e3:.1f} | {us / max(calls, 1):.1f} |"
              for name, calls, us in kernels[:top]]
    lines += ["", "| group | calls | ms | share |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {g} | {calls} | {us / 1e3:.1f} | {100 * us / max(total, 1e-9):.0f}% |"
              for g, (calls, us) in kernel_groups(kernels).items()]
    return lines
