"""Turns a scheduled batch into model inputs, runs the model and samples.

Host round-trips per step: none before sampling (inputs go host->device, nothing is read back);
the sampler reads back the sampled token ids. A step of only decodes replays a CUDA graph when
the engine captured them (`graphs`); prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import torch

from pdserve.worker.attention import AttentionMetadata
from pdserve.worker.cuda_graphs import DecodeGraphs
from pdserve.worker.outputs import TokenLogprob
from pdserve.worker.request import Request
from pdserve.worker.sampler import Sampler
from pdserve.worker.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model, block_size: int, device: torch.device, graphs: DecodeGraphs | None = None):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.graphs = graphs
        self.sampler = Sampler()

    def _tensor(self, data, dtype) -> torch.Tensor:
        # Built on the CPU and copied once: one host->device transfer per input per step.
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Request]]:
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        dec_tables, dec_lens, pre_tables, pre_lens, cu = [], [], [], [], [0]
        logits_idx, samplers = [], []
        # Width rounded up to 16 columns: Triton specializes integer arguments on divisibility by
        # 16, so a width that wandered across that property would compile the attention kernels
        # again (seconds, mid-serving) for each variant.
        max_blocks = -(-max(len(r.block_ids) for r, _ in batch.items) // 16) * 16
        for req, n in batch.items:
            start = req.num_computed_tokens
            end = start + n
            input_ids += req.token_ids[start:end]
            positions += range(start, end)
            slots += [req.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            table = req.block_ids + [0] * (max_blocks - len(req.block_ids))
            if n == 1:
                dec_tables.append(table)
                dec_lens.append(end)
            else:
                pre_tables.append(table)
                pre_lens.append(end)
                cu.append(cu[-1] + n)
            if end == req.num_tokens:  # reached the end of what is known: sample the next token
                logits_idx.append(len(input_ids) - 1)
                samplers.append(req)
        i32 = torch.int32
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=len(dec_lens),
            decode_block_tables=self._tensor(dec_tables or [[0]], i32)[: len(dec_lens)],
            decode_context_lens=self._tensor(dec_lens, i32),
            prefill_block_tables=self._tensor(pre_tables or [[0]], i32)[: len(pre_lens)],
            prefill_cu_seqlens_q=self._tensor(cu, i32),
            prefill_context_lens=self._tensor(pre_lens, i32),
        )
        return (self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta,
                logits_idx, samplers)

    def _run_graph(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int], list[Request]]:
        """A decode-only step through the graphs' static buffers (the same rows as prepare())."""
        bs = self.block_size
        ids, positions, slots, lens, tables, logits_idx, samplers = [], [], [], [], [], [], []
        for i, (req, _) in enumerate(batch.items):
            p = req.num_computed_tokens
            ids.append(req.token_ids[p])
            positions.append(p)
            slots.append(req.block_ids[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables.append(req.block_ids)
            if p + 1 == req.num_tokens:
                logits_idx.append(i)
                samplers.append(req)
        return self.graphs.run(ids, positions, slots, lens, tables), logits_idx, samplers

    def _use_graph(self, batch: ScheduledBatch) -> bool:
        return (self.graphs is not None and len(batch.items) <= self.graphs.config.max_batch
                and all(n == 1 for _, n in batch.items))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        if self._use_graph(batch):
            hidden, logits_idx, samplers = self._run_graph(batch)
        else:
            input_ids, positions, meta, logits_idx, samplers = self.prepare(batch)
            hidden = self.model(input_ids, positions, meta)
        if not samplers:
            return {}, {}
        if logits_idx == list(range(logits_idx[0], logits_idx[0] + len(logits_idx))):
            rows = hidden[logits_idx[0]:logits_idx[0] + len(logits_idx)]  # a view: no index upload
        else:
            rows = hidden[logits_idx]
        logits = self.model.compute_logits(rows)
        if all(r.params.greedy and r.params.logprobs is None and r.num_output_tokens >= r.params.min_tokens
               for r in samplers):
            # Plain greedy: argmax and one read-back, without the sampler's per-row work
            # (stop-token suppression, logprobs).
            return {r.request_id: t for r, t in zip(samplers, logits.argmax(dim=-1).tolist())}, {}
        tokens, logprobs = self.sampler(logits, samplers)
        sampled = {r.request_id: t for r, t in zip(samplers, tokens)}
        lps = {r.request_id: lp for r, lp in zip(samplers, logprobs) if lp is not None}
        return sampled, lps
