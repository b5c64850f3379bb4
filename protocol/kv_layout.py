"""A KV cache's layout: what a peer's blocks must share with ours for their bytes to mean the same
here (a decode worker compares its own with the prefill worker's before a pull, as values).

On the wire (kv_transfer_params' `kv_layout`, the side channel's `describe`) it is one string,
"<layers>x<kv heads>x<head dim>:<dtype>[@<fp8 scales>]:<block size>[:w<window>/<sliding mask>][:mla]";
this module is the one place that writes or reads that string.

The `:w...` suffix names a hybrid KV cache's group split (worker/attention/kv_groups.py): its
sliding layers (bit i of the hex mask: layer i) and their window. Such a cache's block holds one
group's layers, so its bytes mean something else than a plain cache's block, and its hand-off list
is the full group's blocks followed by the sliding group's tail (`handoff_blocks`): a hybrid peer
and a plain one compare unequal and never exchange KV (the decode side prefills locally instead).

The `:mla` suffix names a multi-head latent attention cache (worker/attention/kv_spec.py): one
latent of <head dim> values per token and layer ("1" KV head), not K and V per head. A GQA cache of
the same numbers would read those bytes as something else, so the two compare unequal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WIRE = re.compile(r"(\d+)x(\d+)x(\d+):([^:@]+)(?:@([^:]*))?:(-?\d+)(?::w(\d+)/([0-9a-f]+))?(:mla)?")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int  # of the whole model (a tensor-parallel rank holds its share)
    head_dim: int
    dtype: str  # the element type's torch name: "bfloat16", "float8_e4m3fn", ...
    block_size: int  # tokens per block
    # An fp8 cache's scales ("1": all 1, else a digest of them): blocks written with other scales
    # dequantize to other values, so they are part of the layout. None: not a quantized cache.
    scales: str | None = None
    # A hybrid cache (kv_groups.py): the sliding layers' window in positions and those layers.
    # 0 and (): a plain cache, whose blocks hold every layer.
    window: int = 0
    sliding_layers: tuple[int, ...] = ()
    # An MLA latent cache (one latent per token and layer, not K and V per head).
    latent: bool = False

    def __post_init__(self):
        if bool(self.window) != bool(self.sliding_layers) or self.window < 0:
            raise ValueError("a hybrid KV layout names both a positive window and its sliding layers")

    @property
    def element(self) -> str:
        """The dtype and, for an fp8 cache, its scales: "float8_e4m3fn@1"."""
        return self.dtype if self.scales is None else f"{self.dtype}@{self.scales}"

    @property
    def hybrid(self) -> bool:
        """Whether blocks hold one group's layers (full or sliding), not every layer."""
        return self.window > 0

    def sliding_start(self, num_prompt_tokens: int) -> int:
        """The first prompt block the sliding layers still read when the decode side's first query
        (position `num_prompt_tokens`) runs: keys at positions > position - window
        (KVGroups.first_needed_block). Earlier sliding blocks are not handed off."""
        return max(num_prompt_tokens - self.window + 1, 0) // self.block_size

    def handoff_blocks(self, num_prompt_tokens: int) -> int:
        """Blocks in a hand-off of a `num_prompt_tokens`-token prompt: every prompt block, and for a
        hybrid cache the sliding group's blocks from `sliding_start` on after them."""
        n = -(-num_prompt_tokens // self.block_size)
        return n + (n - self.sliding_start(num_prompt_tokens) if self.hybrid else 0)

    def __str__(self) -> str:
        text = f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}:{self.element}:{self.block_size}"
        if self.hybrid:
            text += f":w{self.window}/{sum(1 << i for i in self.sliding_layers):x}"
        return text + (":mla" if self.latent else "")

    @classmethod
    def parse(cls, text: str) -> "KVLayout":
        """The layout a peer's string names; ValueError (saying what is wrong) if it names none."""
        if not isinstance(text, str) or not re.fullmatch(r".*:-?\d+(:w\d+/[0-9a-f]+)?(:mla)?", text):
            raise ValueError("does not end in a block size")
        m = _WIRE.fullmatch(text)
        layout = None
        if m:
            mask = int(m[8], 16) if m[8] else 0
            sliding = tuple(i for i in range(mask.bit_length()) if mask >> i & 1)
            try:
                layout = cls(int(m[1]), int(m[2]), int(m[3]), m[4], int(m[6]), m[5], int(m[7] or 0), sliding,
                             bool(m[9]))
            except ValueError:
                layout = None
        if not layout or str(layout) != text:  # one spelling per layout: the wire form compares as before
            raise ValueError("is not <layers>x<kv heads>x<head dim>:<dtype>[@<scales>]:<block size>"
                             "[:w<window>/<sliding layers' mask>][:mla]")
        return layout
