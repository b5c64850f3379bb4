"""The engine: add_request / step / abort over scheduler, block manager and model runner.

Thread model: `step()` runs on one thread (the async wrapper's executor); `add_request` and
`abort` may be called from any thread. They only enqueue under a lock; the step thread
applies them at the start of the next step, so scheduler state has a single writer.
"""

from __future__ import annotations

import logging
import threading
import uuid

import torch

from pdserve.worker.attention import AttentionMetadata, TorchAttentionBackend, make_backend
from pdserve.worker.block_manager import BlockManager
from pdserve.worker.config import ConfigError, EngineConfig
from pdserve.worker.cuda_graphs import DecodeGraphConfig, DecodeGraphs
from pdserve.worker.kv_cache import KVCache
from pdserve.worker.model_loader import load_model
from pdserve.worker.model_runner import ModelRunner
from pdserve.worker.outputs import EngineStats, RequestOutput
from pdserve.worker.kv.transfer_scheduler import KVTransferScheduler, is_remote_decode
from pdserve.worker.request import Request, RequestError, RequestStatus  # noqa: F401 (RequestError re-exported)
from pdserve.worker.sampling_params import SamplingParams
from pdserve.worker.scheduler import Scheduler

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
# Left free on the GPU for what torch does not count (CUDA context growth, cuBLAS workspaces).
GPU_HEADROOM_BYTES = 512 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", f"{name} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _attention_backend(name: str | None, device: torch.device):
    if name is None:
        return make_backend(device)
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from pdserve.worker.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (torch, triton)")


class LLMEngine:
    def __init__(self, config: EngineConfig, *, attention_backend: str | None = None,
                 static_decode: bool | None = None):
        """`attention_backend` ("torch" | "triton") and `static_decode` are internal overrides for
        tests and benchmarks: by default CUDA gets Triton and decode CUDA graphs (unless
        --enforce-eager), CPU the torch reference. `static_decode=True` on CPU runs the graphs'
        static-buffer path without capturing."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.engine_id = uuid.uuid4().hex[:12]
        torch.manual_seed(config.seed)  # unseeded sampling is reproducible per worker start (--seed)
        backend = _attention_backend(attention_backend, self.device)
        self.attention_backend = backend.name
        max_len = config.max_model_len
        loaded = load_model(config.model, self.device, self.dtype, backend, max_positions=max_len)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.model_config, loaded.tokenizer
        self.model_path = loaded.path
        mc = self.model_config
        if max_len is None:
            max_len = mc.max_position_embeddings
            self.model.init_rope(max_len)
        self.max_model_len = max_len
        bs = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        num_blocks = self._num_kv_blocks(backend)
        if num_blocks * bs < max_len:
            # A sequence longer than the whole cache could never run: it would preempt itself
            # and be recomputed forever. Refuse an explicit limit; shrink a defaulted one.
            if config.max_model_len is not None:
                raise ConfigError("--max-model-len", f"{max_len} tokens do not fit the KV cache ({num_blocks * bs} "
                                                     f"tokens); lower it or give the cache more memory "
                                                     f"(--kv-cache-memory / --gpu-memory-utilization)")
            log.warning("KV cache holds %d tokens < the model's %d positions: max_model_len set to %d",
                        num_blocks * bs, max_len, num_blocks * bs)
            max_len = self.max_model_len = num_blocks * bs
        self.kv_cache = KVCache(mc, num_blocks, bs, self.dtype, self.device)
        backend.bind(self.kv_cache)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching, on_event=self._on_kv_event)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens, max_len)
        if static_decode is None:
            # The torch reference reads context lengths on the host, which a graph cannot capture.
            static_decode = self.device.type == "cuda" and not config.enforce_eager and backend.name == "triton"
        graphs = None
        if static_decode:
            graphs = DecodeGraphs(self.model, DecodeGraphConfig(config.max_num_seqs, -(-max_len // bs),
                                                                capture=self.device.type == "cuda"), self.device)
            graphs.capture()
            log.info("decode CUDA graphs: %d batch sizes captured in %.2fs", len(graphs.buckets), graphs.capture_seconds)
        self.runner = ModelRunner(self.model, bs, self.device, graphs)
        self.requests: dict[str, Request] = {}
        # KV cache events for KV-aware routers: collected during a step, published once per step.
        self._kv_events: list[dict] = []
        self.kv_event_publisher = None
        if config.kv_events_port is not None:
            from pdserve.router.kv_events import KVEventPublisher

            self.kv_event_publisher = KVEventPublisher(
                self.engine_id, f"tcp://*:{config.kv_events_port}", f"tcp://*:{config.kv_events_port + 1}")
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        layout = f"{mc.num_layers}x{mc.num_kv_heads}x{mc.head_dim}:{str(self.dtype).removeprefix('torch.')}:{bs}"
        self.kv_transfer = KVTransferScheduler(config, self.engine_id, layout, self.kv_cache.tensor, self.block_manager,
                                               self.scheduler, mc.vocab_size, max_len)
        self.connector = self.kv_transfer.connector  # the worker-side half (metrics, tests)
        log.info("engine ready: %s on %s/%s, %d KV blocks x %d tokens (%.0f MiB), max_model_len %d, attention=%s",
                 mc.architecture, self.device, str(self.dtype).removeprefix("torch."), num_blocks, bs,
                 num_blocks * KVCache.bytes_per_block(mc, bs, self.dtype) / 2**20, max_len, backend.name)

    def _num_kv_blocks(self, backend) -> int:
        per_block = KVCache.bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            peak = self._profile_activation_bytes(backend)
            free, total = torch.cuda.mem_get_info(self.device)
            # --gpu-memory-utilization is this engine's share of the card, as in vLLM: what this
            # process holds (weights, anything else it allocated) plus the largest step's
            # activations plus the KV cache. Other processes on the card (a prefill and a decode
            # worker sharing one GPU) do not eat into it; what is actually free still caps it.
            own = torch.cuda.memory_reserved(self.device)
            budget = min(int(total * self.config.gpu_memory_utilization) - own - peak,
                         free - peak - GPU_HEADROOM_BYTES)
            log.info("KV sizing: %.2f GiB total, %.2f GiB free, %.2f GiB held by this process, %.2f GiB peak "
                     "activations -> %.2f GiB for KV", total / 2**30, free / 2**30, own / 2**30, peak / 2**30,
                     max(budget, 0) / 2**30)
        else:
            budget = self.config.kv_cache_memory or CPU_DEFAULT_KV_BYTES
        n = budget // per_block
        if n < 2:
            raise ConfigError("--kv-cache-memory" if self.device.type == "cpu" else "--gpu-memory-utilization",
                              f"leaves room for {n} KV blocks of {per_block} bytes; need at least 2")
        return int(n)

    @torch.inference_mode()
    def _profile_activation_bytes(self, backend) -> int:
        """Peak memory of the largest step (a full token budget of prefill, then sampling rows
        for max_num_seqs), measured by running it over a throwaway KV cache just large enough."""
        bs, mc = self.config.block_size, self.model_config
        n, seq = self.max_num_batched_tokens, min(self.max_num_batched_tokens, self.max_model_len)
        lens = [seq] * (n // seq) + ([n % seq] if n % seq else [])
        blocks = [-(-L // bs) for L in lens]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        scratch = KVCache(mc, sum(blocks), bs, self.dtype, self.device)
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
        self.model.compute_logits(rows).log_softmax(-1).argmax(-1).tolist()  # the sampler's buffers
        peak = torch.cuda.max_memory_allocated(self.device) - base - scratch.tensor.numel() * scratch.tensor.element_size()
        del scratch, meta, hidden, rows
        torch.cuda.empty_cache()
        return peak

    # -- public API ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: dict | None = None) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("prompt", "the prompt is empty")
        if n >= self.max_model_len:
            raise RequestError("prompt", f"this model's maximum context length is {self.max_model_len} tokens, "
                                         f"but the prompt has {n} tokens")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise RequestError("prompt", f"token ids must be in [0, {vocab})")
        if is_remote_decode(kv_transfer_params):
            self.kv_transfer.check_params(kv_transfer_params, n)
        req = Request(request_id, prompt_token_ids, params, self.model_config.eos_token_ids, kv_transfer_params)
        with self._lock:
            # A second request under a live id would never get outputs of its own: refuse it.
            if request_id in self.requests or any(r.request_id == request_id for r in self._inbox):
                raise RequestError("request_id", f"request id {request_id!r} is already in flight")
            self._inbox.append(req)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self._inbox or self._aborts or self.kv_transfer.has_work)

    @property
    def has_pins(self) -> bool:
        return self.kv_transfer.has_pins

    def step(self) -> list[RequestOutput]:
        outputs = self._apply_inbox()
        self.kv_transfer.step()
        batch = self.scheduler.schedule()
        self._publish_kv_events()  # evictions made while scheduling
        if not batch:
            self.kv_transfer.wait_for_pull(timeout=0.005)
            return outputs
        sampled, logprobs = self.runner.run(batch)
        finished = self.scheduler.update(batch, sampled)
        self._publish_kv_events()
        finished_ids = {r.request_id for r in finished}
        for req, _ in batch.items:
            new = req.token_ids[req.num_prompt_tokens + req.num_emitted_tokens:] if req.request_id in sampled else []
            if not new and req.request_id not in finished_ids:
                continue
            outputs.append(self._output(req, new, logprobs.get(req.request_id)))
        for req in finished:
            self.requests.pop(req.request_id, None)
        return outputs

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self._inbox),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_pinned_blocks=self.kv_transfer.num_pinned_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    # -- internals ----------------------------------------------------------------------------

    def _apply_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            for req in inbox:  # under the lock: add_request's duplicate check sees them
                self.requests[req.request_id] = req
        outputs = []
        for req in inbox:
            if self.kv_transfer.admit(req):
                continue  # waits for its prompt KV from a prefill worker
            if req.status.finished:  # the handed-over first token already ended it
                self.requests.pop(req.request_id)
                outputs.append(self._output(req, [], None))
            else:
                self.scheduler.add(req)
        for rid in aborts:
            req = self.requests.pop(rid, None)
            if req is None or req.status.finished:
                continue
            if self.kv_transfer.abort(req):  # else blocks are being written: freed when the pull ends
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            req.set_status(RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(req, [], None))
        return outputs

    def _output(self, req: Request, new: list[int], logprob) -> RequestOutput:
        req.num_emitted_tokens += len(new)
        finished = req.status.finished
        kv_params = None
        if finished and req.keep_blocks and req.status is not RequestStatus.FINISHED_ABORTED:
            kv_params = self.kv_transfer.pin(req)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=list(new),
            finished=finished,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(0, req.num_cached_tokens),
            num_output_tokens=req.num_output_tokens,
            logprobs=[logprob] if logprob is not None else None,
            kv_transfer_params=kv_params,
        )

    def _on_kv_event(self, kind, block_hashes, parent, token_ids) -> None:
        if self.kv_event_publisher is None:
            return
        from pdserve.router.kv_events import block_removed, block_stored

        if kind == "BlockStored":
            self._kv_events.append(block_stored(block_hashes, parent, token_ids, self.block_manager.block_size))
        else:
            self._kv_events.append(block_removed(block_hashes))

    def _publish_kv_events(self) -> None:
        if self._kv_events:
            self.kv_event_publisher.publish(self._kv_events)
            self._kv_events = []

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline batch generation (tests, benchmarks): output token ids per prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(prompts))]
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        pending = set(ids)
        while pending:
            for o in self.step():
                out[o.request_id] += o.new_token_ids
                if o.finished:
                    pending.discard(o.request_id)
        return [out[rid] for rid in ids]
