"""KV cache groups: how a model with sliding-window layers shares one pool of blocks (vLLM's
hybrid KV cache manager, in its simplest form).

A model whose layers all attend to the whole context has one group, and a block holds every
layer (kv_cache.py). gpt-oss alternates sliding-window layers (window 128) and full-attention
ones. Keeping every layer's KV for the whole sequence would cost a sliding layer as much as a
full one, although it never reads more than its last `window` positions. So its layers are split
in two groups, full and sliding, and a block id holds `slots` = max(#full, #sliding) layers: the
j-th layer of whichever group owns it. Each request has one block table per group over the same
pool (Request.block_ids: the full group; Request.sliding_block_ids: the sliding one). A sliding
table's entries wholly outside the window are released as the sequence advances and become
`null_block`, an id the block manager never hands out and no KV write targets: the attention
kernels do not read those positions (the window masks them), so what the entry names is moot.

Cost per token, long contexts: one block per `block_size` tokens of `slots` layers (half the
model's layers for gpt-oss) plus a window's worth of sliding blocks per request, against one
block of all layers: about twice the tokens in the same memory.

`slots` > the smaller group's size leaves that group's extra slot(s) unused in its blocks: the
split pays off when the groups are about equal (gpt-oss: exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.worker.config.model import ModelConfig


@dataclass(frozen=True)
class KVGroups:
    num_layers: int
    window: int  # the sliding layers' window in positions (the query's included)
    sliding_layers: tuple[int, ...]

    def __post_init__(self):
        if not self.sliding_layers or self.window <= 0:
            raise ValueError("KVGroups needs sliding layers and a positive window (else one group: no KVGroups)")
        if len(self.sliding_layers) == self.num_layers:
            raise ValueError("every layer slides: a single group (a window-sized cache) is not implemented")

    @classmethod
    def of(cls, cfg: ModelConfig) -> KVGroups | None:
        """The model's groups, or None where every layer attends to the whole context (one group)."""
        if not cfg.sliding_layers or not cfg.sliding_window or len(cfg.sliding_layers) == cfg.num_layers:
            return None
        return cls(cfg.num_layers, cfg.sliding_window, tuple(cfg.sliding_layers))

    @property
    def slots(self) -> int:
        """Layers one block holds."""
        n = len(self.sliding_layers)
        return max(n, self.num_layers - n)

    def is_sliding(self, layer: int) -> bool:
        return layer in self.sliding_layers

    def slot(self, layer: int) -> int:
        """The layer's index among its group's layers: where it lives inside a block."""
        sliding = self.is_sliding(layer)
        return sum(1 for i in range(layer) if self.is_sliding(i) == sliding)

    def first_needed_block(self, position: int, block_size: int) -> int:
        """The first block a sliding layer reads for a query at `position`: keys at positions
        > position - window (transformers' mask; the attention kernels' `window`)."""
        return max(position - self.window + 1, 0) // block_size

    def max_tokens(self, num_blocks: int, block_size: int) -> int:
        """The longest sequence `num_blocks` blocks serve alone (one null block; its full blocks and
        a window's sliding blocks, chunked to fit)."""
        return max(num_blocks - 1 - (self.window - 1) // block_size - 2, 0) * block_size
