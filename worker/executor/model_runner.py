"""The model runner: loads the model, sizes and allocates the KV cache, captures decode CUDA
graphs, then turns each scheduled batch into model inputs, runs the model and samples.

Construction order matters (nano-vllm's): the model first, then the largest step is profiled
to see what activations need, the KV cache takes what is left, and graphs are captured last,
over the real cache.

Host round-trips per step: none before sampling (inputs go host->device, nothing is read back).
A step is `launch` (inputs, forward, sampling, and an asynchronous copy of the sampled token ids
into a pinned host buffer) then `collect` (wait for that copy). The synchronous engine (and
`run`) launches `immediate`: it collects at once, so `collect` reads the ids from the device in
one blocking copy, with no buffer or event to manage. With
async scheduling the engine launches the next step between the two, and that step's decodes
take the in-flight token ids from the device (`StepPlan.from_previous`). A step of only
decodes replays a CUDA graph when they were captured (`graphs`); prefill and mixed steps run
eagerly.

Tensor parallelism (--tensor-parallel-size N > 1): the engine starts ranks 1..N-1
(executor/tp_ranks.py), each a ModelRunner of its own shard (parallel/shard.py, parallel/layers.py),
and hands rank 0's runner their handle (`followers`); every step this runner sends them the
step's plan (`StepPlan`) before running it itself; logits are gathered to rank 0, which alone
samples. At N = 1 none of this exists: no processes, no collectives, no plan sent.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pdserve.worker.attention.backend import AttentionMetadata
from pdserve.worker.attention.kv_cache import KVCache, resolve_kv_dtype
from pdserve.worker.attention.kv_groups import KVGroups
from pdserve.worker.attention.kv_scales import load_kv_scales
from pdserve.worker.attention.selector import make_backend
from pdserve.worker.config.engine import ConfigError, EngineConfig
from pdserve.worker.executor.cpu_threads import CpuThreads, cpu_batch_invariant
from pdserve.worker.executor.cuda_graphs import DecodeGraphConfig, DecodeGraphs
from pdserve.worker.executor.host_staging import HostStaging
from pdserve.worker.executor.scheduled_batch import ScheduledBatch
from pdserve.worker.kv.layer_clock import LayerClock
from pdserve.worker.models.loader import load_model
from pdserve.worker.parallel.communicator import share_from_rank0
from pdserve.worker.request.outputs import TokenLogprob
from pdserve.worker.request.request import Request
from pdserve.worker.sample.prompt_logprobs import (
    PromptLogprobsCollector,
    PromptRows,
    plan_rows,
    score_rows,
    scores_prompt,
)
from pdserve.worker.sample.sampler import Sampler

log = logging.getLogger(__name__)
# _tensor's host arrays, and the chunk length from which _plan_eager computes a row's slots in
# numpy (below it, a list comprehension is cheaper than the arrays' set-up).
_NP = {torch.int64: np.int64, torch.int32: np.int32}
_VECTOR_ROWS = 64


@dataclass
class StepPlan:
    """One step's model inputs as host lists: all a tensor-parallel rank needs to run the step."""

    graph: bool  # decode only, through the CUDA graphs' static buffers
    # graph: (ids, positions, slots, context_lens, block_tables, sliding) as DecodeGraphs.run takes them;
    # eager: (ids, positions, slots, dec_tables, dec_lens, pre_tables, pre_lens, cu_seqlens, sliding);
    # `sliding`: the sliding group's slots and tables (KV groups, attention/kv_groups.py), else None
    inputs: tuple
    logits_idx: list[int]  # rows of the step's hidden states that are projected to logits
    # Prompt logprobs (echo): rows whose logits score the next prompt token, those tokens, and
    # the most top-N any of them asked for (prompt_logprobs.py).
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_top_k: int = 0
    # Async scheduling: (input row, row of the previous step's sampled tokens) for token ids the
    # host does not know yet; their host value is a 0 overwritten on the device. Under tensor
    # parallelism the other ranks take them from `share_tokens`' broadcast of the step before.
    from_previous: list[tuple[int, int]] = field(default_factory=list)
    # Async scheduling under tensor parallelism: rank 0 broadcasts this step's sampled token ids
    # (this many) on the device once sampled, so that every rank holds what the next step's
    # `from_previous` rows read; 0: nothing is sent.
    share_tokens: int = 0
    # LoRA (--enable-lora): the GPU slot of each input row's adapter (-1: the base model); None
    # when the worker serves no adapters.
    lora_slots: list[int] | None = None
    lora_swaps: list = field(default_factory=list)  # (slot, LoRAModule): adapters every rank copies in first
    # The host KV tier's block copies (TierCopy), every rank its shard, before the forward.
    tier_ops: list = field(default_factory=list)


@dataclass
class LaunchedStep:
    """A step whose work is queued: its sampled token ids are still on the device (`tokens`,
    one per sampling request, in `samplers` order) while a copy brings them to `host_tokens`."""

    batch: ScheduledBatch
    samplers: list[Request]
    rows: dict[str, int]  # request id -> its row in `tokens`
    tokens: torch.Tensor | None  # [S] int64 on the device; None when nothing sampled
    # The pinned buffer the tokens are copied into; None for a step launched `immediate`
    # (collect reads `tokens` itself, which waits for the step: is_done does not apply).
    host_tokens: torch.Tensor | None
    copied: torch.cuda.Event | None  # passed when host_tokens holds them (None: CPU, already there)
    logprobs: list[TokenLogprob | None] | None  # host values when any sampler asked (read back at launch)
    advanced: list[int] | None = None  # async scheduling: computed counts after it (Scheduler.advance)
    # Passed when all of the step's device work is done, where `copied` does not say it (no
    # sampler) and the caller asked (launch's mark_done); None: nothing to wait for at collect.
    done: torch.cuda.Event | None = None
    launched_at: float = field(default_factory=time.perf_counter)  # host clock when it was queued

CPU_DEFAULT_KV_BYTES = 1 << 30
# Left free on the GPU for what torch does not count (CUDA context growth, cuBLAS workspaces).
GPU_HEADROOM_BYTES = 512 << 20


def resolve_device(name: str) -> torch.device:
    """The device, always with an index on CUDA ("cuda" -> the current card): the engine steps on
    its own thread and sets that thread's device from it (torch.cuda.set_device needs an index)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"{name} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def kv_groups(config: EngineConfig, cfg) -> KVGroups | None:
    """The KV cache's groups (attention/kv_groups.py): a model with sliding-window layers gets a
    sliding group unless --disable-hybrid-kv-cache-manager. A P/D worker hands off the full
    group's blocks and the sliding group's window (docs/kv-cache.md)."""
    if config.disable_hybrid_kv_cache_manager:
        return None
    return KVGroups.of(cfg)


class ModelRunner:
    def __init__(self, config: EngineConfig, *, attention_backend: str | None = None,
                 static_decode: bool | None = None, tp_rank: int = 0, tp_store_port: int | None = None,
                 tp_store=None, followers=None):
        """`attention_backend` ("torch" | "cpu" | "triton") and `static_decode` are internal overrides for
        tests and benchmarks: by default CUDA gets Triton and decode CUDA graphs (unless
        --enforce-eager), CPU the CPU backend. `static_decode=True` on CPU runs the graphs'
        static-buffer path without capturing. Tensor parallelism: rank 0 gets the rendezvous
        store and the other ranks' handle (`tp_store`, `followers`: executor/tp_ranks.py's
        start_followers); ranks >= 1 their rank and the store's port."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # The KV cache's element type: fp8 halves a block's bytes, so the same memory holds twice the blocks.
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.tp_rank, self.tp_size = tp_rank, config.tensor_parallel_size
        self.followers = followers  # rank 0 of a tensor-parallel worker: the other ranks (TPFollowers)
        # Async scheduling under TP: broadcast each step's sampled ids to the other ranks (the engine sets it).
        self.share_sampled = False
        if self.tp_size > 1:
            if tp_rank == 0 and (tp_store is None or followers is None):
                raise ValueError("rank 0 of a tensor-parallel worker needs the store and the followers "
                                 "(executor/tp_ranks.py start_followers; LLMEngine does this)")
            self.device = self._join_tensor_parallel(tp_store_port, tp_store)
        elif self.device.type == "cuda":
            # Loading, KV sizing and graph capture run on this thread: Triton launches on the
            # current device, so `--device cuda:1` must make it current (TP ranks do it on joining).
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible per worker start (--seed)
        backend = make_backend(self.device, attention_backend)
        self.attention_backend = backend.name
        max_len = config.max_model_len
        loaded = load_model(config.model, self.device, self.dtype, backend, max_positions=max_len,
                            tp=(tp_rank, self.tp_size), expert_parallel=config.enable_expert_parallel,
                            quantization=config.quantization, load_format=config.load_format)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.model_config, loaded.tokenizer
        # What this rank holds (its heads and KV heads): the full model's shape at TP = 1.
        self.shard_config = self.model.cfg
        self.model_path = loaded.path
        mc = self.model_config
        if max_len is None:
            max_len = mc.max_position_embeddings
            self.model.init_rope(max_len)
        self.max_model_len = max_len
        self.block_size = bs = config.block_size
        self.kv_groups = kv_groups(config, self.shard_config)
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        # LoRA adapters: their GPU slots exist before the KV cache is sized, so it leaves them room.
        self.lora = self._start_lora(backend.name) if config.enable_lora else None
        self._step_lora: dict[str, int] = {}  # the step being planned: adapter name -> its GPU slot
        self.num_blocks = num_blocks = self._num_kv_blocks(backend)
        fits = num_blocks * bs if self.kv_groups is None else self.kv_groups.max_tokens(num_blocks, bs)
        if fits < max_len:
            # A sequence longer than the whole cache could never run: it would preempt itself
            # and be recomputed forever. Refuse an explicit limit; shrink a defaulted one.
            if config.max_model_len is not None:
                raise ConfigError("--max-model-len", f"{max_len} tokens do not fit the KV cache ({fits} "
                                                     f"tokens); lower it or give the cache more memory "
                                                     f"(--kv-cache-memory / --gpu-memory-utilization)")
            log.warning("KV cache holds %d tokens < the model's %d positions: max_model_len set to %d",
                        fits, max_len, fits)
            max_len = self.max_model_len = fits
        # Per-tensor scales are the same on every TP rank (a rank holds some heads of each layer).
        try:
            self.kv_scales = load_kv_scales(self.model_path, mc.num_layers) if config.kv_cache_fp8 else None
        except ValueError as e:
            raise ConfigError("--kv-cache-dtype", f"fp8 needs usable KV scales: {e}") from None
        self.kv_cache = KVCache(self.shard_config, num_blocks, bs, self.kv_dtype, self.device, self.kv_scales,
                                self.kv_groups)
        from pdserve.worker.kv.tp_transfer import TPRank

        # The KV connector of this rank (kv/tp_link.py): which heads it holds; rank 0's pipes to the others.
        self.kv_tp_rank = TPRank(tp_rank, self.tp_size, self.model_config.num_kv_heads)
        self.kv_tp_link = self.followers.kv_link if self.followers is not None else None
        # The host KV tier (--kv-offloading-size): this rank's slots; the engine's block manager
        # decides what goes in and out (engine/host_tier_index.py), the same decisions for every rank.
        self.host_kv, self.host_tier_slots = None, 0
        if config.kv_offloading_size:
            from pdserve.worker.executor.host_kv_store import HostKVStore, host_tier_slots

            self.host_tier_slots = host_tier_slots(config.kv_offloading_size, self.kv_cache.block_bytes, self.tp_size)
            self.host_kv = HostKVStore(self.kv_cache.tensor, self.host_tier_slots, config.kv_offloading_size)
        backend.bind(self.kv_cache)
        self.graphs = self._capture_decode_graphs(static_decode, backend.name)
        self.sampler = Sampler()
        # CPU: decode steps leave a core to the server's threads; bf16 runs batch-invariant where
        # the native kernels compute every product (executor/cpu_threads.py).
        self.cpu_threads = None
        if self.device.type == "cpu":
            invariant = cpu_batch_invariant(self.model, self.kv_cache.dtype, lora=self.lora is not None)
            self.cpu_threads = CpuThreads(batch_invariant=invariant)
        # Sampled token ids come back through persistent (pinned) buffers, one per step in flight.
        self._readback = HostStaging([((config.max_num_seqs,), torch.int64)], self.device)
        self.prompt_logprobs = PromptLogprobsCollector()  # rank 0: echo requests' prompt logprobs
        self.prompt_scores = None  # rank 0: the last execute()'s prompt scores (score_rows)

    # -- construction: tensor parallelism, KV sizing and graph capture ---------------------------

    def _start_lora(self, backend_name: str):
        """The adapters' manager over this model, with --lora-modules read and checked (LoRAError
        naming the adapter: the worker does not start with one it could not serve)."""
        from pdserve.worker.lora.manager import LoRAManager
        from pdserve.worker.config.lora_modules import parse_lora_modules

        c = self.config
        manager = LoRAManager(self.model, max_loras=c.max_loras, max_rank=c.max_lora_rank,
                              max_cpu_loras=c.cpu_loras, max_tokens=max(self.max_num_batched_tokens, c.max_num_seqs),
                              backend_name=backend_name, device=self.device)
        for module in parse_lora_modules(c.lora_modules):
            manager.add(module)
        return manager

    def _join_tensor_parallel(self, store_port, store) -> torch.device:
        """Join the process group (and make the rank's all-reduce communicator)."""
        from pdserve.worker.parallel.group import init_tensor_parallel, rank_device

        if store is not None:
            store_port = store.port
        device = rank_device(self.device, self.tp_rank)
        if device.type == "cpu":
            # N processes share the host's cores: without this each would start one thread per core.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.tp_size))
        init_tensor_parallel(self.tp_rank, self.tp_size, device, store_port, store)
        return device

    def synchronize(self) -> None:
        """Wait until this rank's queued device work is done (a streamed KV chunk is read by
        another process right after; TP ranks are tied to this one by the step's collectives)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def shutdown(self) -> None:
        """Leave the tensor-parallel group (after the engine stopped the other ranks)."""
        self.followers = None
        if self.tp_size > 1:
            from pdserve.worker.parallel.group import shutdown_tensor_parallel

            shutdown_tensor_parallel()

    def _num_kv_blocks(self, backend) -> int:
        per_block = KVCache.bytes_per_block(self.shard_config, self.config.block_size, self.kv_dtype, self.kv_groups)
        if self.device.type == "cuda":
            peak = self._profile_activation_bytes(backend)
            free, total = torch.cuda.mem_get_info(self.device)
            # --gpu-memory-utilization is this engine's share of the card, as in vLLM: what this
            # process holds (weights, anything else it allocated) plus the largest step's
            # activations plus the KV cache. Other processes on the card (a prefill and a decode
            # worker sharing one GPU) do not eat into it; what is actually free still caps it.
            own = torch.cuda.memory_reserved(self.device)
            # --kv-cache-memory, when given, replaces the share (vLLM's --kv-cache-memory-bytes):
            # capacity comparisons need the same KV bytes whatever else the process holds.
            share = (self.config.kv_cache_memory if self.config.kv_cache_memory is not None
                     else int(total * self.config.gpu_memory_utilization) - own - peak)
            budget = min(share, free - peak - GPU_HEADROOM_BYTES)
            log.info("KV sizing: %.2f GiB total, %.2f GiB free, %.2f GiB held by this process, %.2f GiB peak "
                     "activations -> %.2f GiB for KV", total / 2**30, free / 2**30, own / 2**30, peak / 2**30,
                     max(budget, 0) / 2**30)
        else:
            budget = self.config.kv_cache_memory or CPU_DEFAULT_KV_BYTES
        n = budget // per_block
        if self.tp_size > 1:
            # Every rank sized its own cache (--gpu-memory-utilization is per rank); the scheduler's
            # block ids must exist on all of them.
            from pdserve.worker.parallel.group import agree_min

            n = agree_min(n, self.device)
        if n < 2:
            sized_by = self.device.type == "cpu" or self.config.kv_cache_memory is not None
            raise ConfigError("--kv-cache-memory" if sized_by else "--gpu-memory-utilization",
                              f"leaves room for {n} KV blocks of {per_block} bytes; need at least 2")
        return int(n)

    @torch.inference_mode()
    def _profile_activation_bytes(self, backend) -> int:
        """Peak memory of the largest step (a full token budget of prefill, then sampling rows
        for max_num_seqs), measured by running it over a throwaway KV cache just large enough."""
        bs = self.config.block_size
        n, seq = self.max_num_batched_tokens, min(self.max_num_batched_tokens, self.max_model_len)
        lens = [seq] * (n // seq) + ([n % seq] if n % seq else [])
        blocks = [-(-L // bs) for L in lens]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        scratch = KVCache(self.shard_config, sum(blocks), bs, self.kv_dtype, self.device)
        backend.bind(scratch)
        first = [sum(blocks[:i]) for i in range(len(lens))]
        table = [[f + j for j in range(max(blocks))] for f in first]  # columns past a row's blocks unread
        slots = [(f * bs) + p for f, L in zip(first, lens) for p in range(L)]
        cu = [0]
        for L in lens:
            cu.append(cu[-1] + L)

        def dev(x, dt):
            return torch.tensor(x, dtype=dt, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=dev(slots, torch.int64), num_decode_tokens=0,
            decode_block_tables=dev([[0]], torch.int32)[:0], decode_context_lens=dev([], torch.int32),
            prefill_block_tables=dev(table, torch.int32), prefill_cu_seqlens_q=dev(cu, torch.int32),
            prefill_context_lens=dev(lens, torch.int32),
        )
        positions = dev([p for L in lens for p in range(L)], torch.int64)
        hidden = self.model(torch.zeros(n, dtype=torch.int64, device=self.device), positions, meta)
        rows = hidden[-min(n, self.config.max_num_seqs):]
        # The sampler's buffers; under TP the full-vocabulary logits all-gathered from every rank
        # (every rank profiles, so the collectives match).
        logits = self._project(rows)
        if logits is not None:  # as the sampler holds them: an fp32 copy, then its log-softmax
            logits.float().log_softmax(-1).argmax(-1).tolist()
        torch.cuda.synchronize(self.device)
        del logits
        peak = (
            torch.cuda.max_memory_allocated(self.device) - base - scratch.tensor.numel() * scratch.tensor.element_size()
        )
        del scratch, meta, hidden, rows
        torch.cuda.empty_cache()
        return peak

    def _capture_decode_graphs(self, static_decode: bool | None, backend_name: str) -> DecodeGraphs | None:
        config = self.config
        if static_decode is None:
            # The torch reference reads context lengths on the host, which a graph cannot capture.
            static_decode = self.device.type == "cuda" and not config.enforce_eager and backend_name == "triton"
            if static_decode and not getattr(self.model, "cuda_graphs", True):  # e.g. gpt-oss's torch experts
                log.info("decode CUDA graphs: off, %s has a step a graph cannot capture", type(self.model).__name__)
                static_decode = False
        if not static_decode:
            return None
        max_blocks = -(-self.max_model_len // self.block_size)
        graphs = DecodeGraphs(self.model, DecodeGraphConfig(config.max_num_seqs, max_blocks,
                                                            capture=self.device.type == "cuda",
                                                            sliding=self.kv_groups is not None,
                                                            lora=self.lora is not None), self.device,
                              lora_ctx=self.lora.ctx if self.lora is not None else None)
        graphs.capture()
        log.info("decode CUDA graphs: %d batch sizes captured in %.2fs", len(graphs.buckets), graphs.capture_seconds)
        return graphs

    # -- every step -----------------------------------------------------------------------------

    def _tensor(self, data, dtype) -> torch.Tensor:
        # Built on the CPU and copied once: one host->device transfer per input per step. Through
        # numpy: a prefill's per-token lists (16k ids, positions, slots) convert ~3.5x faster
        # than torch.tensor(list) does them (docs/results/engine/2026-12-06-cpu-prefill-inputs.md).
        return torch.from_numpy(np.array(data, dtype=_NP[dtype])).to(self.device, non_blocking=True)

    def _plan_eager(
        self, batch: ScheduledBatch, prev_rows: dict[str, int] | None = None
    ) -> tuple[StepPlan, list[Request]]:
        bs = self.block_size
        from_previous = []
        input_ids, positions, slots = [], [], []
        dec_tables, dec_lens, pre_tables, pre_lens, cu = [], [], [], [], [0]
        logits_idx, samplers = [], []
        prompt_rows, prompt_targets, book = [], [], PromptRows([], [])
        # Width rounded up to 16 columns: Triton specializes integer arguments on divisibility by
        # 16, so a width that wandered across that property would compile the attention kernels
        # again (seconds, mid-serving) for each variant.
        max_blocks = -(-max(len(r.block_ids) for r, _ in batch.items) // 16) * 16
        sliding = None if self.kv_groups is None else ([], [], [])  # slots, decode tables, prefill tables
        lora_slots = None if self.lora is None else []
        for req, n in batch.items:
            if lora_slots is not None:
                lora_slots += [self._step_lora.get(req.lora_name, -1)] * n
            start = req.num_computed_tokens
            end = start + n
            known = req.token_ids[start:end]
            input_ids += known
            if len(known) < n:  # the last token is in flight (async scheduling): taken on the device
                from_previous.append((len(input_ids), prev_rows[req.request_id]))
                input_ids.append(0)
            positions += range(start, end)
            if n < _VECTOR_ROWS:
                slots += [req.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            else:  # a prefill chunk: the same slots, computed per block table in numpy
                p = np.arange(start, end)
                slots += (np.array(req.block_ids, dtype=np.int64)[p // bs] * bs + p % bs).tolist()
            table = req.block_ids + [0] * (max_blocks - len(req.block_ids))
            if n == 1:
                dec_tables.append(table)
                dec_lens.append(end)
            else:
                pre_tables.append(table)
                pre_lens.append(end)
                cu.append(cu[-1] + n)
            if sliding is not None:
                s_table = req.sliding_block_ids
                sliding[0].extend(s_table[p // bs] * bs + p % bs for p in range(start, end))
                sliding[1 if n == 1 else 2].append(s_table + [0] * (max_blocks - len(s_table)))
            if scores_prompt(req):
                plan_rows(req, start, end, len(input_ids) - n, prompt_rows, prompt_targets, book)
            if end == req.num_scheduled_tokens:  # reached the end of what is known: sample the next token
                logits_idx.append(len(input_ids) - 1)
                samplers.append(req)
        inputs = (input_ids, positions, slots, dec_tables, dec_lens, pre_tables, pre_lens, cu, sliding)
        top_k = max((r.params.prompt_logprobs for r in book.requests), default=0)
        self._prompt_book = book
        return StepPlan(False, inputs, logits_idx, prompt_rows, prompt_targets, top_k,
                        from_previous=from_previous, lora_slots=lora_slots), samplers

    def _eager_inputs(self, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids, positions, slots, dec_tables, dec_lens, pre_tables, pre_lens, cu, sliding = inputs
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
        if sliding is not None:  # the sliding group's slots and tables; the lengths are shared
            s_slots, s_dec, s_pre = sliding
            meta.sliding = replace(meta, slot_mapping=self._tensor(s_slots, torch.int64),
                                   decode_block_tables=self._tensor(s_dec or [[0]], i32)[: len(dec_lens)],
                                   prefill_block_tables=self._tensor(s_pre or [[0]], i32)[: len(pre_lens)])
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[Request]]:
        plan, samplers = self._plan_eager(batch)
        return (*self._eager_inputs(plan.inputs), plan.logits_idx, samplers)

    def _plan_graph(
        self, batch: ScheduledBatch, prev_rows: dict[str, int] | None = None
    ) -> tuple[StepPlan, list[Request]]:
        """A decode-only step through the graphs' static buffers (the same rows as prepare())."""
        bs = self.block_size
        ids, positions, slots, lens, tables, logits_idx, samplers = [], [], [], [], [], [], []
        sliding = None if self.kv_groups is None else ([], [])  # the sliding group's slots and tables
        from_previous = []
        lora_slots = None if self.lora is None else [self._step_lora.get(r.lora_name, -1) for r, _ in batch.items]
        for i, (req, _) in enumerate(batch.items):
            p = req.num_computed_tokens
            if p < len(req.token_ids):
                ids.append(req.token_ids[p])
            else:  # in flight (async scheduling): taken on the device
                from_previous.append((i, prev_rows[req.request_id]))
                ids.append(0)
            positions.append(p)
            slots.append(req.block_ids[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables.append(req.block_ids)
            if sliding is not None:
                sliding[0].append(req.sliding_block_ids[p // bs] * bs + p % bs)
                sliding[1].append(req.sliding_block_ids)
            if p + 1 == req.num_scheduled_tokens:
                logits_idx.append(i)
                samplers.append(req)
        return StepPlan(True, (ids, positions, slots, lens, tables, sliding), logits_idx,
                        from_previous=from_previous, lora_slots=lora_slots), samplers

    def _use_graph(self, batch: ScheduledBatch) -> bool:
        return (self.graphs is not None and len(batch.items) <= self.graphs.config.max_batch
                and all(n == 1 for _, n in batch.items)
                and not any(scores_prompt(r) for r, _ in batch.items))

    @torch.inference_mode()
    def execute(self, plan: StepPlan, previous: torch.Tensor | None = None,
                layer_clock: LayerClock | None = None, waited: bool = False) -> torch.Tensor | None:
        """Run one step's forward -> logits [S, V] of plan.logits_idx's rows (None when no
        row samples; on ranks >= 1 of a tensor-parallel worker, always None: rank 0 samples).
        `previous`: the last step's sampled token ids on the device, for plan.from_previous.
        `layer_clock`: told as each decoder layer's KV is written (a streamed prefill's chunk;
        such a step is never a decode graph's). `waited`: see DecodeGraphs.run."""
        if plan.inputs is None:  # the host tier's copies alone (copy_tiers_now)
            self._copy_tiers_and_wait(plan.tier_ops)
            return None
        if plan.lora_swaps:
            self.lora.apply(plan.lora_swaps)
        if self.host_kv is not None:  # also when it has none: the forward waits for earlier copies
            self.host_kv.apply(plan.tier_ops)
        if self.cpu_threads is not None:
            self.cpu_threads.for_step(decode_only=plan.graph or not plan.inputs[6])  # inputs[6]: prefill lengths
        fill = None
        if plan.from_previous:
            fill = lambda ids: self._fill_from_previous(ids, plan.from_previous, previous)  # noqa: E731
        if plan.graph:
            hidden = self.graphs.run(*plan.inputs, from_previous=fill, lora_slots=plan.lora_slots, waited=waited)
        else:
            input_ids, positions, meta = self._eager_inputs(plan.inputs)
            if fill is not None:
                fill(input_ids)
            self.model.after_layer = layer_clock.after_layer if layer_clock is not None else None
            if plan.lora_slots is not None:
                self._lora_inputs(plan.lora_slots)
            try:
                hidden = self.model(input_ids, positions, meta)
            finally:
                self.model.after_layer = None
                if self.lora is not None:
                    ctx = self.lora.ctx
                    ctx.slots, ctx.segments, ctx.active = ctx.idle, None, True
        self.prompt_scores = None
        if plan.prompt_rows:
            self.prompt_scores = score_rows(hidden, plan.prompt_rows, plan.prompt_targets, plan.prompt_top_k,
                                            self._project, self.config.max_num_seqs)
        logits_idx = plan.logits_idx
        if not logits_idx:
            return None
        if logits_idx == list(range(logits_idx[0], logits_idx[0] + len(logits_idx))):
            rows = hidden[logits_idx[0]:logits_idx[0] + len(logits_idx)]  # a view: no index upload
        else:
            rows = hidden[logits_idx]
        return self._project(rows)

    @torch.inference_mode()
    def copy_tiers_now(self, ops) -> None:
        """Carry out host-tier copies (TierCopy) now, outside a step, on every rank, and return
        once all of them are done. P/D: a pull writes its blocks from another stream or the NIC,
        and a reader reads pinned blocks, unordered with this rank's streams; a block evicted to
        the tier must be copied out before a pull overwrites it, and a restored one copied in
        before a reader can see it."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)
        plan = StepPlan(False, None, [], tier_ops=list(ops))
        if self.followers is not None:
            self.followers.send(plan)
        self._copy_tiers_and_wait(plan.tier_ops)

    def tier_copies_pending(self) -> bool:
        """Host-tier copies still run that no forward has waited for (HostKVStore.pending)."""
        return self.host_kv is not None and self.host_kv.pending

    def _copy_tiers_and_wait(self, ops) -> None:
        self.host_kv.apply(ops)
        self.host_kv.settle()  # the copies that would have overlapped a forward: waited for too
        if self.tp_size > 1:
            # Every rank's copies are queued before this on its stream (or done, on CPU): once
            # rank 0 has the sum, every rank's copies are done, so rank 0 may start the pulls
            # that its connector drives on all ranks.
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(1, device=self.device))
        self.synchronize()

    def receive_sampled(self, n: int) -> torch.Tensor:
        """Ranks >= 1: rank 0's `n` sampled token ids of the step just run (StepPlan.share_tokens)."""
        return share_from_rank0(torch.empty(n, dtype=torch.int64, device=self.device))

    def _lora_inputs(self, lora_slots: list[int]) -> None:
        """An eager step's adapter per token on the device, and its runs of one adapter where
        they are long enough for the segmented kernels (worker/lora/layer.py); none at all when
        no token runs an adapter."""
        from pdserve.worker.lora.layer import segments_of

        ctx = self.lora.ctx
        ctx.active = any(s >= 0 for s in lora_slots)
        if not ctx.active:  # the base model's tokens only: nothing to add
            return
        ctx.slots = self._tensor(lora_slots, torch.int64)
        runs = segments_of(lora_slots)
        if runs is not None:
            starts, seg_slots, longest = runs
            ctx.segments = (self._tensor(starts, torch.int32), self._tensor(seg_slots, torch.int32), longest)

    def _fill_from_previous(self, ids: torch.Tensor, pairs: list[tuple[int, int]], previous: torch.Tensor) -> None:
        """ids[dst] = previous[src] on the device, without the host reading either. The usual
        shape (the same decodes, in the same order, first in both steps) is one slice copy."""
        k = len(pairs)
        if pairs[0] == (0, 0) and pairs[-1] == (k - 1, k - 1) and all(d == r for d, r in pairs):
            ids[:k].copy_(previous[:k])
            return
        dst = torch.tensor([d for d, _ in pairs], dtype=torch.int64).to(self.device, non_blocking=True)
        src = torch.tensor([r for _, r in pairs], dtype=torch.int64).to(self.device, non_blocking=True)
        ids.index_copy_(0, dst, previous.index_select(0, src))

    def _project(self, rows: torch.Tensor) -> torch.Tensor | None:
        """Hidden rows -> full-vocabulary logits (the model's dtype at TP = 1, fp32 gathered to rank 0
        under TP; None elsewhere)."""
        return self.model.compute_logits(rows)

    def run(self, batch: ScheduledBatch) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        """One step, start to finish."""
        return self.collect(self.launch(batch, immediate=True))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None,
               mark_done: bool = False, layer_clock: LayerClock | None = None,
               immediate: bool = False) -> LaunchedStep:
        """Queue one step's work (forward, sampling, the copy of its token ids to the host) and
        return without waiting for it, except where sampling needs the host (seeded rows, logprobs,
        grammar masks). `previous`: the step still in flight, whose tokens some of this step's
        inputs are (async scheduling; the scheduler planned this batch with them in flight).
        `mark_done`: `collect` also waits for a step that samples nothing (a prefill chunk), so
        that its KV is written when it returns (P/D: a streamed chunk is then made readable).
        `layer_clock`: see `execute`. `immediate`: the caller collects this step before doing
        anything else (the synchronous engine), so nothing is queued to read its token ids
        back: `collect` reads them from the device in one blocking copy, as the host must wait
        for them anyway (no pinned buffer, no event to record and wait for)."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            # The server steps on its own thread, and the current device is per thread: without
            # this, Triton launches would target cuda:0 whatever card this rank was given.
            torch.cuda.set_device(self.device)
        prev_rows = previous.rows if previous is not None else None
        if self.lora is not None:  # the step's adapters into GPU slots (copies queued before its forward)
            self._step_lora, swaps = self.lora.slots_for(r.lora_name for r, _ in batch.items if r.lora_name)
        plan, samplers = (self._plan_graph(batch, prev_rows) if self._use_graph(batch)
                          else self._plan_eager(batch, prev_rows))
        if self.lora is not None:
            plan.lora_swaps = swaps
        plan.tier_ops = batch.kv_tier_ops
        if self.followers is not None:
            if plan.from_previous and not self.share_sampled:
                raise RuntimeError("async scheduling under tensor parallelism needs share_sampled (the engine sets it)")
            plan.share_tokens = len(samplers) if self.share_sampled else 0
            self.followers.send(plan)
        # An immediate step that samples (or is marked done) is waited for by collect() before the
        # caller does anything else: its input buffers are free again by then.
        waited = immediate and (bool(samplers) or mark_done)
        logits = self.execute(plan, previous.tokens if previous is not None else None, layer_clock, waited)
        if self.prompt_scores is not None:
            self.prompt_logprobs.record(self._prompt_book, self.prompt_scores)
        rows = {r.request_id: i for i, r in enumerate(samplers)}
        if not samplers:
            done = None
            if mark_done and self.device.type == "cuda":
                done = torch.cuda.Event()
                done.record()
            return LaunchedStep(batch, samplers, rows, None, None, None, None, done=done)
        logprobs = None
        # min_tokens first: at 0 (nearly always) the request's output index is not needed.
        if all((p := r.params).greedy and p.logprobs is None and not p.modifies_logits
               and (not p.min_tokens or r.next_output_index >= p.min_tokens) for r in samplers):
            # Plain greedy: argmax, without the sampler's per-row work (stop-token suppression, logprobs).
            tokens = logits.argmax(dim=-1)
        else:
            tokens, logprobs = self.sampler.sample(logits, samplers)
        if plan.share_tokens:
            share_from_rank0(tokens)  # the other ranks' next step reads them (StepPlan.share_tokens)
        if immediate:
            return LaunchedStep(batch, samplers, rows, tokens, None, None, logprobs)
        slot, (host,), _ = self._readback.acquire()
        host = host[:len(samplers)]
        host.copy_(tokens, non_blocking=True)
        return LaunchedStep(batch, samplers, rows, tokens, host, self._readback.record(slot), logprobs)

    def is_done(self, step: LaunchedStep) -> bool:
        """Whether `collect` would return at once: the step's token ids (or, with `done`, all of
        its work) are on the host. Never blocks (an event query)."""
        event = step.copied if step.samplers else step.done
        return event is None or event.query()

    def collect(self, step: LaunchedStep) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        """Wait for a launched step's token ids on the host: {request id: token}, {request id: logprob}.
        The copy of the token ids is queued after the step's forward: once they are here, so is its KV."""
        if not step.samplers:
            if step.done is not None:
                step.done.synchronize()
            return {}, {}
        if step.host_tokens is None:  # launched `immediate`: a blocking read of the device's ids
            ids = step.tokens.tolist()
        else:
            if step.copied is not None:
                step.copied.synchronize()
            ids = step.host_tokens.tolist()
        sampled = dict(zip(step.rows, ids))
        lps = {} if step.logprobs is None else {
            r.request_id: lp for r, lp in zip(step.samplers, step.logprobs) if lp is not None}
        return sampled, lps
