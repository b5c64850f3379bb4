"""The paged KV cache tensor and its sizing.

Layout: one tensor [num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim].
Block-major on purpose: every byte of a block, for all layers, is one contiguous span, and a
run of consecutive block ids is one larger span. KV transfer then moves a request's blocks
with a handful of large descriptors instead of one per layer per block (per-descriptor
overhead dominates small transfers). Attention sees each layer as a strided view.
"""

from __future__ import annotations

import torch

from pdserve.worker.model_config import ModelConfig


def kv_layout(cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> str:
    """"<layers>x<kv heads>x<head dim>:<dtype>:<block size>" (P/D peers compare it before a pull)."""
    return f"{cfg.num_layers}x{cfg.num_kv_heads}x{cfg.head_dim}:{str(dtype).removeprefix('torch.')}:{block_size}"


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_layers = cfg.num_layers
        # What a peer must share for our blocks' bytes to mean the same there (checked before a pull).
        self.layout = kv_layout(cfg, dtype, block_size)
        self.tensor = torch.zeros(
            num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device
        )
        # Pre-built views: indexing per layer on every forward would allocate view objects.
        self._layers = [(self.tensor[:, i, 0], self.tensor[:, i, 1]) for i in range(cfg.num_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    @property
    def block_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem
