"""Which slice of the model one tensor-parallel rank holds: the head-range math, nothing else.

Rank r of N holds, per layer:
- qkv_proj (column-parallel): its H/N query heads and the KV heads they read. With N <= KV
  heads, KV/N heads each; with N > KV heads, one KV head, replicated on N/KV ranks (as vLLM
  does): rank r's query heads all belong to KV head r // (N/KV), so attention stays local.
- o_proj (row-parallel): the input columns of its heads; partial sums are all-reduced.
- gate_up_proj (column-parallel) / down_proj (row-parallel): I/N intermediate columns / rows.
- norms (and Qwen3's per-head q/k norms): replicated.
- MoE experts (models/moe.py): without expert parallelism every rank holds every expert's I/N
  columns, as a dense MLP; with it (`expert_parallel`), E/N whole experts (`local_experts`).
- embed_tokens / lm_head (vocab-parallel): ceil(V/N) vocabulary rows, the last shard padded with
  zero rows. A lookup is masked to the rank's range and all-reduced; logits are gathered to rank
  0, which alone samples.

`TPShard` is the one place these ranges are computed: the parallel layers (layers.py) size
their parameters and slice checkpoint tensors from it, the paged KV cache of a rank is built from
`shard_config` (its heads), and KV transfer between workers of different TP sizes
(kv/tp_transfer.py) maps heads with `kv_head_range`. It depends on no process group, so the KV
side can import it without importing the model or torch.distributed.
"""

from __future__ import annotations

import dataclasses

from pdserve.worker.config.engine import ConfigError
from pdserve.worker.config.model import ModelConfig


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
    expert_parallel: bool = False  # --enable-expert-parallel: whole experts per rank (MoE models only)

    def __post_init__(self):
        c, n = self.full, self.size
        if c.is_moe and self.expert_parallel and c.num_experts % n:
            raise ConfigError("--enable-expert-parallel", f"{n} ranks cannot share the model's {c.num_experts} experts "
                                                          f"evenly; use a tensor-parallel size that divides it")
        if c.is_moe and not self.expert_parallel and c.moe_intermediate_size % n:
            raise ConfigError("--tensor-parallel-size", f"{n} does not divide the expert MLP size "
                                                        f"{c.moe_intermediate_size} (try --enable-expert-parallel)")
        if c.mxfp4 is not None and not self.expert_parallel and (c.moe_intermediate_size // n) % 32:
            raise ConfigError("--tensor-parallel-size", f"{n} ranks would split the MXFP4 experts' "
                                                        f"{c.moe_intermediate_size} columns mid-way through their "
                                                        f"32-column scale blocks; use --enable-expert-parallel "
                                                        f"(whole experts per rank) or a size giving each rank a "
                                                        f"multiple of 32")
        if c.shared_expert_intermediate_size % n:
            raise ConfigError("--tensor-parallel-size", f"{n} does not divide the shared expert's MLP size "
                                                        f"{c.shared_expert_intermediate_size}")
        if c.num_heads % n:
            raise ConfigError(
                "--tensor-parallel-size", f"{n} does not divide the model's {c.num_heads} attention heads"
            )
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
    def local_experts(self) -> range:
        """The experts (global ids) whose weights this rank holds."""
        if not self.expert_parallel:
            return range(self.full.num_experts)
        n = self.full.num_experts // self.size
        return range(self.rank * n, self.rank * n + n)

    @property
    def expert_intermediate_size(self) -> int:
        """Columns of each local expert's MLP: all of them under expert parallelism, else I/N."""
        i = self.full.moe_intermediate_size
        return i if self.expert_parallel else i // self.size

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
