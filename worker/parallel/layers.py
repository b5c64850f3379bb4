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
- Any of these four may be FP8 (`quant`, worker/quantization/fp8_linear.py): its scales are
  sharded with the rows or columns they scale.
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

from pdserve.kernels.cpu_small_gemm import packed_linear
from pdserve.worker.parallel.communicator import all_reduce
from pdserve.worker.parallel.shard import TPShard


def replicated_weight_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Parameters every rank holds whole (norms, per-head q/k norms)."""
    param.data.copy_(loaded[:])


def weight_loader_of(module: nn.Module):
    """The loader for the parameters of `module`: its own, or the replicated one."""
    return getattr(module, "weight_loader", replicated_weight_loader)


class ParallelLinear(nn.Linear):
    """What the parallel linears share: an optional quantized method (worker/quantization) that
    owns the weight's dtype, its scales and the GEMM; `quant` None is the plain F.linear.

    A subclass says where a checkpoint tensor's rows (and, row-parallel, columns) land
    (`rows_of`, `cols_of`); the weight loader copies the weight and bias by those, and hands
    quantization scales to the method with the same coordinates, so a scale is sharded exactly
    like the rows or columns it scales."""

    quant = None
    part_ids: tuple = (None,)  # shard_id of each fused part, in order
    lora = None  # the adapters' term added to the output (worker/lora/layer.py LoRALinear), when served
    packed = False  # the weight is oneDNN's packed layout (CPU bf16: worker/models/cpu_packed.py)

    def _init_quant(self, quant) -> None:
        self.quant = quant
        if quant is not None:
            quant.create_weights(self, len(self.part_ids))

    def rows_of(self, shard_id) -> tuple[int, int, int]:
        """(first row in this layer, first row in the checkpoint tensor, count) of a part."""
        return 0, 0, self.weight.shape[0]

    def cols_of(self) -> tuple[int, int] | None:
        """(first checkpoint column, count) where input columns are split; None: all of them."""
        return None

    def load_quant_param(self, param: nn.Parameter, loaded, shard_id) -> bool:
        """A quantization scale: loaded by the method; False for the weight and bias."""
        if self.quant is None or param is self.weight or param is self.bias:
            return False
        name = next(n for n, p in self.named_parameters(recurse=False) if p is param)
        self.quant.load_scale(self, name, param, loaded, self.rows_of(shard_id), self.cols_of(),
                              self.part_ids.index(shard_id))
        return True

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lora = self.lora
        forked = lora.fork(x) if lora is not None else None  # its shrink beside the GEMM, if so configured
        if self.packed:  # oneDNN's packed bf16 weight (worker/models/cpu_packed.py); few rows: a native kernel
            out = packed_linear(x, self.weight, bias)
        else:
            out = F.linear(x, self.weight, bias) if self.quant is None else self.quant.apply(self, x, bias)
        if lora is not None:
            out = lora(x, out, forked)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class ColumnParallelLinear(ParallelLinear):
    """y_shard = x @ W[rows of this rank]^T (+ b[rows]). Rows of the output are split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: TPShard, quant=None):
        assert out_features % shard.size == 0, (out_features, shard.size)
        super().__init__(in_features, out_features // shard.size, bias=bias)
        self.shard = shard
        self._init_quant(quant)

    def rows_of(self, shard_id) -> tuple[int, int, int]:
        n = self.weight.shape[0]
        return 0, self.shard.rank * n, n

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if self.load_quant_param(param, loaded, shard_id):
            return
        dst, src, n = self.rows_of(shard_id)
        param.data[dst:dst + n].copy_(loaded[src:src + n])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs (gate, up) in one GEMM: [part 0 of this rank | part 1 ...]."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, shard: TPShard, quant=None):
        self.out_sizes = list(out_sizes)
        self.part_ids = tuple(range(len(out_sizes)))
        super().__init__(in_features, sum(out_sizes), bias, shard, quant)

    def rows_of(self, shard_id) -> tuple[int, int, int]:
        r, n = self.shard.rank, self.shard.size
        local = [s // n for s in self.out_sizes]
        return sum(local[:shard_id]), r * local[shard_id], local[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """q | k | v of this rank's heads in one GEMM. KV heads follow shard.py's head ranges (a KV
    head is replicated on several ranks when there are fewer KV heads than ranks)."""

    part_ids = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, bias: bool, shard: TPShard, quant=None):
        self.head_dim = head_dim
        self.q_size, self.kv_size = shard.num_heads * head_dim, shard.num_kv_heads * head_dim
        nn.Linear.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.shard = shard
        self._init_quant(quant)

    def rows_of(self, shard_id) -> tuple[int, int, int]:
        s = self.shard
        if shard_id == "q":
            return 0, s.rank * self.q_size, self.q_size
        off = self.q_size + (0 if shard_id == "k" else self.kv_size)
        return off, s.first_kv_head * self.head_dim, self.kv_size


class RowParallelLinear(ParallelLinear):
    """y = all_reduce(x_shard @ W[:, columns of this rank]^T) (+ bias, from rank 0 only)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: TPShard, quant=None):
        assert in_features % shard.size == 0, (in_features, shard.size)
        super().__init__(in_features // shard.size, out_features, bias=bias)
        self.shard = shard
        block = quant.cfg.block if quant is not None else None
        if block and shard.size > 1 and self.in_features % block[1]:
            from pdserve.worker.config.quantization import QuantizationError

            raise QuantizationError(
                f"weight_block_size {list(block)}: {in_features} input columns split over --tensor-parallel-size "
                f"{shard.size} give {self.in_features} per rank, not a multiple of {block[1]} (a scale block "
                f"would straddle two ranks)")
        self._init_quant(quant)

    def cols_of(self) -> tuple[int, int] | None:
        n = self.in_features
        return self.shard.rank * n, n

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        if self.load_quant_param(param, loaded, shard_id):
            return
        if param.dim() == 2:  # the weight: this rank's input columns
            c, n = self.cols_of()
            param.data.copy_(loaded[:, c:c + n])
        elif self.shard.rank == 0:  # the bias
            param.data.copy_(loaded[:])
        else:
            param.data.zero_()  # added once, by rank 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.linear(x, self.bias))

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The partial products summed over ranks (a product made elsewhere, e.g. the small-M
        GEMV of models/llama.py, from this layer's weight)."""
        return all_reduce(out) if self.shard.size > 1 else out


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, end) of the vocabulary (padded to ceil(V/N)); ids elsewhere give zeros."""

    def __init__(self, vocab_size: int, dim: int, shard: TPShard):
        # The weight's values are its builder's to set: the loader builds on the meta device and
        # fills every weight (models/loader.py). nn.Embedding's random init is skipped: on meta
        # tensors its normal_ runs through torch's reference ops, whose first use imports
        # torch._dynamo (1.5-2.5 s of every worker's start on the CI machine, ~90 MiB of RSS).
        super().__init__(shard.vocab_per_rank, dim, _weight=torch.empty(shard.vocab_per_rank, dim))
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
    """Hidden rows [S, D] -> logits [S, V] of the full vocabulary on rank 0 (None on the other
    ranks): in the projection's dtype at TP = 1 (the sampler upcasts what it modifies; a plain
    greedy step's argmax reads them as they are, as of their fp32 copy: the same values), fp32
    under TP (gathered). `weight` is the rank's [V/N, D] rows (the lm_head's or the tied embedding's)."""
    local = h @ weight.t()
    if shard.size == 1:
        return local
    return gather_logits(local.float(), shard)


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
