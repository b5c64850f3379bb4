"""A KV cache's layout: what a peer's blocks must share with ours for their bytes to mean the same
here (a decode worker compares its own with the prefill worker's before a pull, as values).

On the wire (kv_transfer_params' `kv_layout`, the side channel's `describe`) it is one string,
"<layers>x<kv heads>x<head dim>:<dtype>[@<fp8 scales>]:<block size>", as it always was; this
module is the one place that writes or reads that string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WIRE = re.compile(r"(\d+)x(\d+)x(\d+):([^:@]+)(?:@([^:]*))?:(-?\d+)")


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

    @property
    def element(self) -> str:
        """The dtype and, for an fp8 cache, its scales: "float8_e4m3fn@1"."""
        return self.dtype if self.scales is None else f"{self.dtype}@{self.scales}"

    def __str__(self) -> str:
        return f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}:{self.element}:{self.block_size}"

    @classmethod
    def parse(cls, text: str) -> "KVLayout":
        """The layout a peer's string names; ValueError (saying what is wrong) if it names none."""
        if not isinstance(text, str) or not re.fullmatch(r".*:-?\d+", text):
            raise ValueError("does not end in a block size")
        m = _WIRE.fullmatch(text)
        layout = m and cls(int(m[1]), int(m[2]), int(m[3]), m[4], int(m[6]), m[5])
        if not layout or str(layout) != text:  # one spelling per layout: the wire form compares as before
            raise ValueError("is not <layers>x<kv heads>x<head dim>:<dtype>[@<scales>]:<block size>")
        return layout
