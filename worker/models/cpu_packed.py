"""Linear weights pre-packed for oneDNN on the CPU (bf16): the layout its GEMM reads, made once at load.

A bf16 `F.linear` on the CPU hands oneDNN a plain row-major weight, which it re-blocks or reads
with a slow path on every call; at decode sizes (a few rows against a 576 x 3072 matrix) a call
is memory-bound, and the plain path reads the weight at about half the rate the packed one does
(this 2-core AVX-512 machine: SmolLM2's 30 layers 21 -> 12 ms per token on one core, its 49152-row
lm_head 4.6 -> 2.0 ms). `torch.ops.mkldnn._reorder_linear_weight` makes the packed copy and
`_linear_pointwise` runs the GEMM on it; the products are the same bf16 values as `F.linear`'s
(one fp32 accumulation rounded once; checked by tests/worker/test_cpu_packed.py).

Each unquantized linear's weight Parameter is replaced by its packed tensor (no second copy: the
plain one is freed), and `ParallelLinear.linear` sees `packed` and calls the packed GEMM. The
output projection is packed beside the embedding when they are tied (the lookup needs the plain
rows), so tied models hold the head twice (SmolLM2: +54 MiB).

Only bf16 on a CPU whose oneDNN has bf16 kernels: fp32 stays on `F.linear` (MKL), whose sums
the fp32 equality tests compare bit for bit with Hugging Face's. `PDSERVE_CPU_PACKED_WEIGHTS=0`
turns it off (A/B runs).

A call on at most 32 rows (a decode batch) without a bias runs a native kernel that reads the
same packed weight in place (kernels/cpu_small_gemm.py: `attach` checks the layout once per shape at
load); its sums may differ from oneDNN's in the last fp32 bit (`PDSERVE_CPU_SMALL_GEMM=0`: off)."""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn

from pdserve.kernels import cpu_small_gemm

log = logging.getLogger(__name__)

ENV = "PDSERVE_CPU_PACKED_WEIGHTS"


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.bfloat16 or os.environ.get(ENV, "1") == "0":
        return False
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, W, bias) for W = pack(W): x is [..., K] bf16."""
    if x.dim() != 2:
        return packed_linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    return cpu_small_gemm.packed_linear(x, weight, bias)


def pack_model(net: nn.Module) -> None:
    """Pack every unquantized ParallelLinear's weight in place, and the output projection into
    `net.packed_head` (read by compute_logits)."""
    from pdserve.worker.parallel.layers import ParallelLinear

    t, n, nbytes, small = time.perf_counter(), 0, 0, 0
    for module in net.modules():
        if isinstance(module, ParallelLinear) and module.quant is None and module.weight.dtype == torch.bfloat16:
            module.weight = nn.Parameter(pack(module.weight), requires_grad=False)
            module.packed = True
            small += cpu_small_gemm.attach(module.weight)
            n, nbytes = n + 1, nbytes + module.weight.numel() * 2
    head = getattr(net, "lm_head", None)
    head = head if head is not None else getattr(net, "embed_tokens", None)
    if head is not None and head.weight.dtype == torch.bfloat16:
        net.packed_head = pack(head.weight)
        nbytes += head.weight.numel() * 2
        small += cpu_small_gemm.attach(net.packed_head)
    # Every product on the native GEMM (no weight matrix left to torch: experts, latent attention's
    # absorbed matrices): the engine can run batch-invariant (worker/executor/cpu_threads.py).
    lookups = {id(getattr(m, "weight", None)) for m in (head, getattr(net, "embed_tokens", None))}
    others = [name for name, p in net.named_parameters() if p.dim() >= 2 and not p.is_mkldnn and id(p) not in lookups]
    net.cpu_gemm_every_linear = small == n + (head is not None) and not others
    log.info(
        "packed %d linear weights and the lm_head for oneDNN (%.0f MiB; %d read by the small-batch GEMM) in %.2fs",
        n,
        nbytes / 2**20,
        small,
        time.perf_counter() - t,
    )
