"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small model is mostly launch overhead: ~10 kernels per layer, each a few
microseconds of GPU work and as much host time to launch. A CUDA graph replays the whole
forward with one launch. Graphs fix their tensors' addresses and shapes, so the step's inputs
live in static buffers sized for the largest bucket; a batch of n sequences runs the graph of
the smallest bucket b >= n, and rows n..b-1 are padding that the kernels handle without
special cases: slot -1 (the KV write skips it), context length 1 over whatever valid block id
the table row holds, token and position 0. Their outputs are discarded.

Block tables are `max_blocks_per_seq` wide. A step writes only the first `w` columns its
batch needs; columns beyond a row's context are never read, so stale ids there are harmless
(every id ever written is a valid block). Prefill and mixed steps run eagerly.

`capture=False` keeps the static buffers and the padding but calls the forward directly
instead of replaying a graph: the CPU tests run this path under the Triton interpreter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from pdserve.worker.attention.backend import AttentionMetadata
from pdserve.worker.executor.host_staging import HostStaging


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_batch (padding <= 7 rows)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, max_batch, 8))
    return buckets + [max_batch]


@dataclass(frozen=True)
class DecodeGraphConfig:
    max_batch: int  # the engine's max_num_seqs
    max_blocks_per_seq: int  # ceil(max_model_len / block_size)
    capture: bool = True  # False: same buffers and padding, forward run eagerly (CPU tests)
    # A KV cache with a sliding group (attention/kv_groups.py): a second slot row and block table
    # per sequence, which the sliding layers read (AttentionMetadata.sliding).
    sliding: bool = False
    # LoRA adapters served (worker/lora/): a row of each token's adapter slot (-1 pads), which
    # the LoRA layers read through their context inside the graph.
    lora: bool = False

    def __post_init__(self):
        if self.max_batch < 1:
            raise ValueError(f"DecodeGraphConfig.max_batch must be >= 1, got {self.max_batch}")
        if self.max_blocks_per_seq < 1:
            raise ValueError(f"DecodeGraphConfig.max_blocks_per_seq must be >= 1, got {self.max_blocks_per_seq}")


class DecodeGraphs:
    def __init__(self, model, config: DecodeGraphConfig, device: torch.device, lora_ctx=None):
        self.model, self.config, self.device = model, config, device
        self.buckets = batch_buckets(config.max_batch)
        n = config.max_batch
        # Rows: token ids, positions, KV slots, context lengths. One buffer, so a step's scalars
        # travel in one host->device copy; the int32 context lengths are cast inside the graph.
        # With a sliding group, a fifth row: its KV slots.
        pad = [[0], [0], [-1], [1]] + ([[-1]] if config.sliding else []) + ([[-1]] if config.lora else [])
        self._lora_row = len(pad) - 1 if config.lora else None
        self.lora_ctx = lora_ctx
        self._inputs = torch.tensor(pad, dtype=torch.int64, device=device).repeat(1, n)
        self._padding = np.array(pad, dtype=np.int64).repeat(n, axis=1)  # rows n..b-1
        self._context_lens = torch.ones(n, dtype=torch.int32, device=device)
        # [groups, n, max_blocks]: the full group's tables, then the sliding group's.
        self._tables = torch.zeros(1 + config.sliding, n, config.max_blocks_per_seq, dtype=torch.int32,
                                   device=device)
        self._block_tables = self._tables[0]
        # Host side of each step's two input copies, allocated once (host_staging.py). The block
        # tables' side is flat: a step packs its [groups, n, width] tables at its start, so they
        # leave in one contiguous pinned copy (a strided one goes through a pageable host copy).
        self._staging = HostStaging([((len(pad), n), torch.int64),
                                     (((1 + config.sliding) * n * config.max_blocks_per_seq,), torch.int32)], device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        # With LoRA, a second set captured as the base model (LoRAContext.base_model): a batch in
        # which no sequence runs an adapter (known on the host) replays it and launches no LoRA kernel.
        self._base_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._base_outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self.num_base_replays = 0  # of them, LoRA's base-model set's
        self.capture_seconds = 0.0

    def _forward(self, b: int, base: bool = False) -> torch.Tensor:
        """The model over the first b rows of the static buffers -> hidden [b, H]; `base`: as
        the base model, no LoRA term (a batch without adapters)."""
        self._context_lens[:b].copy_(self._inputs[3, :b])
        empty = self._block_tables[:0]
        meta = AttentionMetadata(
            slot_mapping=self._inputs[2, :b],
            num_decode_tokens=b,
            decode_block_tables=self._block_tables[:b],
            decode_context_lens=self._context_lens[:b],
            prefill_block_tables=empty,
            prefill_cu_seqlens_q=self._context_lens[:1],  # no prefill rows: never read
            prefill_context_lens=self._context_lens[:0],
        )
        if self.config.sliding:
            meta.sliding = replace(meta, slot_mapping=self._inputs[4, :b], decode_block_tables=self._tables[1, :b])
        if base:
            with self.lora_ctx.base_model():
                return self.model(self._inputs[0, :b], self._inputs[1, :b], meta)
        if self._lora_row is not None:
            self.lora_ctx.slots = self._inputs[self._lora_row, :b]
            try:
                return self.model(self._inputs[0, :b], self._inputs[1, :b], meta)
            finally:
                self.lora_ctx.slots = self.lora_ctx.idle
        return self.model(self._inputs[0, :b], self._inputs[1, :b], meta)

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket (largest first, so smaller ones reuse its memory); returns seconds."""
        if not self.config.capture:
            return 0.0
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        sets = [(False, self._graphs, self._outputs)]
        if self._lora_row is not None:
            sets.append((True, self._base_graphs, self._base_outputs))
        for b in reversed(self.buckets):
            for base, graphs, outputs in sets:
                self._forward(b, base)  # warm-up outside the graph: Triton compiles, allocator settles
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outputs[b] = self._forward(b, base)
                graphs[b] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    def replay(self, b: int) -> torch.Tensor:
        """Replay bucket b over whatever the static buffers hold (benchmarks time this)."""
        self._graphs[b].replay()
        return self._outputs[b]

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
            block_tables: list[list[int]], sliding: tuple[list[int], list[list[int]]] | None = None,
            from_previous=None, lora_slots: list[int] | None = None, waited: bool = False) -> torch.Tensor:
        """One decode step for n <= max_batch sequences (block tables of any lengths) -> hidden [n, H].
        `from_previous(ids)`: called on the token-id row once the host's values are queued, to put
        token ids that are still on the device in place (async scheduling, model_runner.py).
        `sliding`: the sliding group's (slots, block tables), where the config has one.
        `lora_slots`: each sequence's adapter slot, where the config serves adapters.
        `waited`: the caller waits for this step's device work before it runs another step (the
        synchronous engine's step that samples): the copies out of the host buffers are done by
        the time that buffer is next acquired, so no event is recorded for it."""
        n = len(input_ids)
        b = self.bucket(n)
        slot, (host, host_tables), (rows, tables) = self._staging.acquire()
        rows[0, :n], rows[1, :n], rows[2, :n], rows[3, :n] = input_ids, positions, slots, context_lens
        groups = [block_tables]
        if sliding is not None:
            rows[4, :n] = sliding[0]
            groups.append(sliding[1])
        if self._lora_row is not None:
            rows[self._lora_row, :n] = lora_slots if lora_slots is not None else -1
        rows[:, n:b] = self._padding[:, :b - n]
        # Columns past a row's length keep whatever an older step packed there: never read, and every
        # one is a valid block.
        width = max(len(t) for t in block_tables)
        shape = (len(groups), n, width)
        size = len(groups) * n * width
        packed = tables[:size].reshape(shape)
        for g, group in enumerate(groups):
            for i, t in enumerate(group):
                packed[g, i, :len(t)] = t
        # The whole rows buffer (max_batch columns, a few KiB), not its first b columns: a strided
        # slice would be copied through temporaries (a host copy of it, a pageable transfer, a
        # device copy kernel), one contiguous pinned copy is a single transfer. Columns past b
        # carry whatever an earlier step left there; no graph of bucket b reads them.
        self._inputs.copy_(host, non_blocking=True)
        self._tables[:, :n, :width].copy_(host_tables[:size].view(shape), non_blocking=True)
        if not waited:
            self._staging.record(slot)
        if from_previous is not None:
            from_previous(self._inputs[0, :n])
        self.num_replays += 1
        base = self._lora_row is not None and (lora_slots is None or all(s < 0 for s in lora_slots))
        self.num_base_replays += base
        if not self.config.capture:
            return self._forward(b, base)[:n]
        graphs, outputs = (self._base_graphs, self._base_outputs) if base else (self._graphs, self._outputs)
        graphs[b].replay()
        return outputs[b][:n]
