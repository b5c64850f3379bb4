"""What the paged KV cache holds for one token of one layer: its typed shape.

Two kinds:
- "kv": a key and a value per KV head ([2, num_kv_heads, head_dim]): every attention but MLA.
- "latent": multi-head latent attention (DeepSeek-V2/V3, config/deepseek.py) caches one vector per
  token and layer, shared by every head: the RMS-normed latent (kv_lora_rank values) followed by
  the rope key (qk_rope_head_dim) ([1, 1, latent_dim]). Its heads' keys and values are
  up-projections of it, made at attention time (attention/mla.py). It is not split by heads, so
  every tensor-parallel rank holds the whole latent (num_kv_heads 1, replicated: parallel/shard.py).

The cache tensor is [num_blocks, layers, entries, block_size, num_kv_heads, head_dim] either way
(attention/kv_cache.py), so block bytes, hand-offs and prefix caching treat both kinds alike; the
layout string a P/D peer compares names the kind (protocol/kv_layout.py), so a GQA worker never
reads an MLA worker's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.worker.config.model import ModelConfig


@dataclass(frozen=True)
class KVSpec:
    kind: str  # "kv" | "latent"
    num_kv_heads: int  # of this rank's model config (1 for a latent)
    head_dim: int  # values per head and entry (the latent's whole width)

    @property
    def entries(self) -> int:
        """Vectors per KV head per token: K and V, or the one latent."""
        return 1 if self.kind == "latent" else 2

    @property
    def latent(self) -> bool:
        return self.kind == "latent"

    def token_values(self) -> int:
        """Values one token stores per layer."""
        return self.entries * self.num_kv_heads * self.head_dim


def kv_spec(cfg: ModelConfig) -> KVSpec:
    if cfg.mla is not None:
        return KVSpec("latent", 1, cfg.mla.latent_dim)
    return KVSpec("kv", cfg.num_kv_heads, cfg.head_dim)
