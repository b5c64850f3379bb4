"""Which attention backend a worker runs: Triton's kernels on CUDA, the CPU backend elsewhere.

A module of its own so that the interface (attention/backend.py) stays below the backends built on it:
the Triton backend imports the interface, and only this choice imports the Triton backend.
"""

from __future__ import annotations

import logging

import torch

from pdserve.worker.attention.backend import AttentionBackend, CpuAttentionBackend, TorchAttentionBackend

logger = logging.getLogger(__name__)


def make_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """`name` ("torch" | "cpu" | "triton") forces a backend; None picks by device."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        return CpuAttentionBackend()
    if name == "triton":
        from pdserve.worker.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name is not None:
        raise ValueError(f"unknown attention backend {name!r} (torch, cpu, triton)")
    if device.type == "cuda":
        try:
            from pdserve.worker.attention.triton_backend import TritonAttentionBackend
        except ImportError as e:
            # CUDA builds of torch bring Triton along; without it the GPU would run the slow
            # references, so say so loudly rather than serve at a fraction of the speed.
            logger.warning("Triton is not importable (%s): CUDA runs the torch reference attention; "
                           "install pdserve[triton] for the GPU kernels", e)
            return TorchAttentionBackend()
        return TritonAttentionBackend()
    return CpuAttentionBackend()
