"""Megatron-style tensor parallelism for the Llama-family model: what each rank holds.

Rank r of N holds, per layer:
- qkv_proj (column-parallel): its H/N query heads and the KV heads they read. With N <= KV
  heads, KV/N heads each; with N > KV heads, one KV head, replicated on N/KV ranks (as vLLM
  does): rank r's query heads all belong to KV head r // (N/KV), so attention stays local.
- o_proj (row-parallel): the input columns of its heads; partial sums are all-reduced.
- gate_up_proj (column-parallel) / down_proj (row-parallel): I/N intermediate columns / rows.
- norms (and Qwen3's per-head q/k norms): replicated.
- embed_tokens / lm_head (vocab-parallel): ceil(V/N) vocabulary rows, the last shard padded with
  zero rows. A lookup is masked to the rank's range and all-reduced; logits are gathered to rank
  0, which alone samples.

The model is built from a per-rank `ModelConfig` (`shard_config`): the heads, intermediate size
and vocabulary it holds, so llama.py's layers take their rank's shapes without knowing about
TP, and the paged KV cache built from the same config is the rank's head shard. `parallelize`
then swaps in the three layer kinds whose forward needs a collective. One all-reduce per
row-parallel layer (2 per decoder layer) plus one for the embedding: 2L + 1 per step.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.worker.config import ConfigError
from pdserve.worker.model_config import ModelConfig


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads (of the full model) that rank `rank` of `tp_size` holds, in cache order.

    With N <= KV heads, KV/N consecutive heads each; with N > KV heads, one head, replicated on
    N/KV consecutive ranks. The one mapping both weight loading and KV transfer between workers
    of different TP sizes use (kv/tp_transfer.py), so the two can never disagree."""
    if num_kv_heads >= tp_size:
        n = num_kv_heads // tp_size
        return range(rank * n, rank * n + n)
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


def check_kv_heads(num_kv_heads: int, tp_size: int) -> bool:
    """Whether `tp_size` ranks can share `num_kv_heads` KV heads (one divides the other)."""
    return tp_size >= 1 and ((num_kv_heads % tp_size) if num_kv_heads >= tp_size else (tp_size % num_kv_heads)) == 0


@dataclasses.dataclass(frozen=True)
class TPShard:
    """Which slice of the full model one rank holds (ranges in heads / rows of the full model)."""

    rank: int
    size: int
    full: ModelConfig

    def __post_init__(self):
        c, n = self.full, self.size
        if c.num_heads % n:
            raise ConfigError("--tensor-parallel-size", f"{n} does not divide the model's {c.num_heads} attention heads")
        if not check_kv_heads(c.num_kv_heads, n):
            raise ConfigError("--tensor-parallel-size", f"{n} and the model's {c.num_kv_heads} KV heads: one must "
                                                        f"divide the other")
        if c.intermediate_size % n:
            raise ConfigError("--tensor-parallel-size", f"{n} does not divide the MLP size {c.intermediate_size}")

    @property
    def num_heads(self) -> int:
        return self.full.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return len(kv_head_range(self.full.num_kv_heads, self.size, self.rank))

    @property
    def first_kv_head(self) -> int:
        return kv_head_range(self.full.num_kv_heads, self.size, self.rank).start

    @property
    def intermediate_size(self) -> int:
        return self.full.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.full.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, end) of the real (unpadded) vocabulary rows this rank holds."""
        start = self.rank * self.vocab_per_rank
        return start, min(start + self.vocab_per_rank, self.full.vocab_size)


def shard_config(shard: TPShard) -> ModelConfig:
    """The config the rank's model is built from: its heads, MLP columns and vocabulary rows."""
    return dataclasses.replace(shard.full, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                               intermediate_size=shard.intermediate_size, vocab_size=shard.vocab_per_rank)


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W_shard^T) (+ bias, held by rank 0 only, so it is added once)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, end) of the vocabulary; ids elsewhere contribute zeros to the all-reduce."""

    def __init__(self, rows: int, dim: int, vocab_range: tuple[int, int]):
        super().__init__(rows, dim)
        self.start, self.end = vocab_range

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(out)
        return out


def _row_parallel(old: nn.Linear) -> RowParallelLinear:
    new = RowParallelLinear(old.in_features, old.out_features, bias=old.bias is not None,
                            device=old.weight.device, dtype=old.weight.dtype)
    return new


def parallelize(model: nn.Module, shard: TPShard) -> nn.Module:
    """Swap the layers whose forward needs a collective (call on the meta-device model, before
    weights: the swapped modules keep their parameter names, so loading is unchanged)."""
    for layer in model.layers:
        layer.self_attn.o_proj = _row_parallel(layer.self_attn.o_proj)
        layer.mlp.down_proj = _row_parallel(layer.mlp.down_proj)
    old = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, shard.vocab_range).to(
        device=old.weight.device, dtype=old.weight.dtype)
    return model


def gather_logits(local: torch.Tensor, shard: TPShard) -> torch.Tensor | None:
    """[S, V/N] on every rank -> [S, V] fp32 on rank 0 (None elsewhere), padding rows dropped.

    An all-gather, not `dist.gather`: NCCL runs gather as grouped point-to-point sends/receives
    (connections set up lazily on first use, outside the ring the all-reduces use), the one
    collective of a step that the start-up path (memory profile, KV agreement, graph warm-ups)
    never exercised before TP > 1 hung on its first step on H100s. The all-gather is the same
    kind of ring collective as the all-reduces; the cost is S x V fp32 landing on every rank
    instead of rank 0 only (at most max_num_seqs rows: about 130 MB at 256 x 128k)."""
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(shard.size)]
    dist.all_gather(parts, local)
    if shard.rank != 0:
        return None
    return torch.cat(parts, dim=-1)[:, :shard.full.vocab_size]


def shard_weight(name: str, w, shard: TPShard) -> torch.Tensor:
    """A checkpoint tensor (name without the "model." prefix) -> the rank's slice of it. `w` is a
    tensor or a safetensors slice: indexing the slice reads only the rank's part from the file."""
    c, r = shard.full, shard.rank
    parts = name.split(".")
    leaf = parts[-2] if len(parts) >= 2 else ""
    is_weight = parts[-1] == "weight"
    if leaf == "q_proj":
        n = shard.num_heads * c.head_dim
        return w[r * n:(r + 1) * n]
    if leaf in ("k_proj", "v_proj"):
        n = shard.num_kv_heads * c.head_dim
        start = shard.first_kv_head * c.head_dim
        return w[start:start + n]
    if leaf in ("gate_proj", "up_proj"):
        n = shard.intermediate_size
        return w[r * n:(r + 1) * n]
    if leaf == "o_proj" and is_weight:
        n = shard.num_heads * c.head_dim
        return w[:, r * n:(r + 1) * n]
    if leaf == "down_proj":
        if is_weight:
            n = shard.intermediate_size
            return w[:, r * n:(r + 1) * n]
        return w[:] if r == 0 else torch.zeros_like(w[:])  # the bias is added once, by rank 0
    if leaf in ("embed_tokens", "lm_head"):
        start, end = shard.vocab_range
        part = w[start:end]
        out = part.new_zeros(shard.vocab_per_rank, part.shape[1])
        out[:end - start] = part
        return out
    return w[:]  # norms (incl. per-head q/k norms): replicated
