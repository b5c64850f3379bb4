"""An `LLMEngine` over a test checkpoint, with the small configuration engine tests share.

The defaults keep an engine cheap on the CPU (4-token blocks, a 4 MiB KV cache, 128 positions);
a test names only what it is about:

    engine = make_engine(ckpt, max_num_batched_tokens=5)
    engine = make_engine(ckpt, attention_backend="triton", static_decode=True, max_model_len=64)

`device_engine`: the same on the GPU where there is one.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.engine.llm_engine import LLMEngine

SMALL = dict(device="cpu", block_size=4, max_model_len=128, kv_cache_memory=1 << 22)


def engine_config(ckpt: Path | str, **overrides) -> EngineConfig:
    """`SMALL` over `ckpt`, with `overrides` (any EngineConfig field) on top."""
    return EngineConfig(**{**SMALL, "model": str(ckpt), **overrides})


def make_engine(ckpt: Path | str, *, attention_backend: str | None = None, static_decode: bool | None = None,
                structured_outputs_backend: str | None = None, **overrides) -> LLMEngine:
    """An engine over `engine_config(ckpt, **overrides)`; the keyword-only arguments are
    LLMEngine's test overrides."""
    return LLMEngine(engine_config(ckpt, **overrides), attention_backend=attention_backend,
                     static_decode=static_decode, structured_outputs_backend=structured_outputs_backend)


ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def device_engine(ckpt: Path | str, **kw) -> LLMEngine:
    """`make_engine` on the GPU where there is one (tier 4), else on the CPU (kernels in Triton's
    interpreter); fp32 either way, so both compare token for token with the torch reference.

    On the GPU the KV cache is sized by --gpu-memory-utilization, a share of the whole card
    counting engines still alive; engines hold reference cycles (bound-method callbacks), so
    unreachable ones are collected first, and their memory is free again for this one."""
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()
    gpu = {"gpu_memory_utilization": 0.25, "kv_cache_memory": None} if ON_GPU else {}
    return make_engine(ckpt, **{"device": DEVICE, "dtype": "float32", **gpu, **kw})


def native_gemm_here() -> bool:
    """This CPU runs bf16 linears on the native GEMM (kernels/cpu_small_gemm.py): a C compiler,
    oneDNN's bf16 kernels, and a packed layout the kernel reads (AVX512-BF16 without AMX). Where
    it does, a bf16 engine is batch-invariant (kernels/cpu_native.py)."""
    import shutil

    from pdserve.kernels import cpu_small_gemm
    from pdserve.worker.models import cpu_packed

    if shutil.which("cc") is None or not cpu_packed.wanted(torch.device("cpu"), torch.bfloat16):
        return False
    return cpu_small_gemm.attach(cpu_packed.pack(torch.randn(64, 64).bfloat16()))
