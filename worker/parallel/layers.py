"""Tensor-parallel layers: each knows its rank's slice of the weight and loads only that.

The model (models/llama.py) is written once, for any TP size: it builds these layers with the
full model's sizes and the rank's `TPShard`; at TP = 1 (`TPShard(0, 1, cfg)`) every slice is the
whole tensor and no layer runs a collective, so the single-GPU model is the same code path.

Each layer has a `weight_loader(param, loaded, shard_id)` (a method of the module, not an
attribute of the parameter, so it survives `to_empty` and any parameter swap): `loaded` is the
checkpoint's full tensor or a safetensors slice, and indexing a slice reads only the rank's part from the
file, so a rank never holds the whole checkpoint. `shard_id` names the part of a fused
parameter ("q" | "k" | "v" for qkv_proj, 0 | 1 for gate_up_proj), None for the rest.

- ColumnParallelLinear: output rows split; no collective (the next row-parallel layer sums).
- MergedColumnParallelLinear: gate | up, each split, fused into one GEMM.
- QKVParallelLinear: the rank's query heads and the KV heads they read (replicated when ranks
  outnumber KV heads: shard.py).
- RowParallelLinear: input columns split; partial products all-reduced. The bias is held by
  rank 0 only (zeros elsewhere) so the sum adds it once.
- VocabParallelEmbedding: ceil(V/N) rows, the last rank's padded with zeros; ids outside the
  rank's range give zeros, then an all-reduce.
- ParallelLMHead: the same rows as logits columns; `logits` gathers them to rank 0.

The collectives go through parallel/communicator.py (NCCL, symmetric memory or gloo, chosen per
message), never through torch.distributed directly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.worker.parallel.communicator import all_reduce
from pdserve.worker.parallel.shard import TPShard


def replicated_weight_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Parameters every rank holds whole (norms, per-head q/k norms)."""
    param.data.copy_(loaded[:])


def weight_loader_of(module: nn.Module):
    """The loader for the parameters of `module`: its own, or the replicated one."""
    return getattr(module, "weight_loader", replicated_weight_loader)


class ColumnParallelLinear(nn.Linear):
    """y_shard = x @ W[rows of this rank]^T (+ b[rows]). Rows of the output are split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: TPShard):
        assert out_features % shard.size == 0, (out_features, shard.size)
        super().__init__(in_features, out_features // shard.size, bias=bias)
        self.shard = shard

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        n = param.shape[0]
        param.data.copy_(loaded[self.shard.rank * n:(self.shard.rank + 1) * n])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (gate, up) in one GEMM: [part 0 of this rank | part 1 ...]."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, shard: TPShard):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, shard)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        r, n = self.shard.rank, self.shard.size
        local = [s // n for s in self.out_sizes]
        start = sum(local[:shard_id])
        param.data[start:start + local[shard_id]].copy_(loaded[r * local[shard_id]:(r + 1) * local[shard_id]])


class QKVParallelLinear(ColumnParallelLinear):
    """q | k | v of this rank's heads in one GEMM. KV heads follow shard.py's head ranges (a KV
    head is replicated on several ranks when there are fewer KV heads than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, bias: bool, shard: TPShard):
        self.head_dim = head_dim
        self.q_size, self.kv_size = shard.num_heads * head_dim, shard.num_kv_heads * head_dim
        nn.Linear.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.shard = shard

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        s, d = self.shard, self.head_dim
        if shard_id == "q":
            dst, src = param.data[:self.q_size], loaded[s.rank * self.q_size:(s.rank + 1) * self.q_size]
        else:
            off = self.q_size + (0 if shard_id == "k" else self.kv_size)
            first = s.first_kv_head * d
            dst, src = param.data[off:off + self.kv_size], loaded[first:first + self.kv_size]
        dst.copy_(src)


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_shard @ W[:, columns of this rank]^T) (+ bias, from rank 0 only)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: TPShard):
        assert in_features % shard.size == 0, (in_features, shard.size)
        super().__init__(in_features // shard.size, out_features, bias=bias)
        self.shard = shard

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if param.dim() == 2:  # the weight: this rank's input columns
            n, r = param.shape[1], self.shard.rank
            param.data.copy_(loaded[:, r * n:(r + 1) * n])
        elif self.shard.rank == 0:  # the bias
            param.data.copy_(loaded[:])
        else:
            param.data.zero_()  # added once, by rank 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return all_reduce(out) if self.shard.size > 1 else out


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, end) of the vocabulary (padded to ceil(V/N)); ids elsewhere give zeros."""

    def __init__(self, vocab_size: int, dim: int, shard: TPShard):
        super().__init__(shard.vocab_per_rank, dim)
        self.shard = shard
        self.start, self.end = shard.vocab_range

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        part = loaded[self.start:self.end]
        param.data[:self.end - self.start].copy_(part)
        param.data[self.end - self.start:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over the rank's vocabulary rows (untied checkpoints)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied through logits(), not called")


def logits(h: torch.Tensor, weight: torch.Tensor, shard: TPShard) -> torch.Tensor | None:
    """Hidden rows [S, D] -> fp32 logits [S, V] of the full vocabulary on rank 0 (None on the
    other ranks). `weight` is the rank's [V/N, D] rows (the lm_head's or the tied embedding's)."""
    local = (h @ weight.t()).float()
    if shard.size == 1:
        return local
    return gather_logits(local, shard)


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
