"""The engine: add_request / step / abort over scheduler, block manager and model runner.

Thread model: `step()` runs on one thread (the async wrapper's executor); `add_request` and
`abort` may be called from any thread. They only enqueue under a lock; the step thread
applies them at the start of the next step, so scheduler state has a single writer.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace

import torch

from pdserve.worker.attention import AttentionMetadata, TorchAttentionBackend, make_backend
from pdserve.worker.block_manager import BlockManager
from pdserve.worker.config import ConfigError, EngineConfig
from pdserve.worker.cuda_graphs import DecodeGraphConfig, DecodeGraphs
from pdserve.worker.kv_cache import KVCache
from pdserve.worker.model_loader import load_model
from pdserve.worker.model_runner import ModelRunner
from pdserve.worker.outputs import EngineStats, RequestOutput
from pdserve.worker.request import Request, RequestStatus
from pdserve.worker.sampling_params import SamplingParams
from pdserve.worker.scheduler import Scheduler

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30


class RequestError(ValueError):
    """The request cannot be served as given (maps to HTTP 400); `param` names the field."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


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
            log.warning("KV cache holds %d tokens < max_model_len %d: long requests will be preempted",
                        num_blocks * bs, max_len)
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
        # Decode side of P/D: requests waiting for blocks to pull into, and pulls in flight.
        self._remote_waiting: list[Request] = []
        self._pulling: dict[str, tuple[Request, Future]] = {}
        self.connector = self._make_connector()
        log.info("engine ready: %s on %s/%s, %d KV blocks x %d tokens (%.0f MiB), max_model_len %d, attention=%s",
                 mc.architecture, self.device, str(self.dtype).removeprefix("torch."), num_blocks, bs,
                 num_blocks * KVCache.bytes_per_block(mc, bs, self.dtype) / 2**20, max_len, backend.name)

    def _num_kv_blocks(self, backend) -> int:
        per_block = KVCache.bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            peak = self._profile_activation_bytes(backend)
            free, total = torch.cuda.mem_get_info(self.device)
            # Everything on the card now (weights, CUDA context, other processes) plus the
            # largest step's activations must fit beside the KV cache in the allowed share.
            budget = int(total * self.config.gpu_memory_utilization) - (total - free) - peak
            log.info("KV sizing: %.2f GiB total, %.2f GiB in use, %.2f GiB peak activations -> %.2f GiB for KV",
                     total / 2**30, (total - free) / 2**30, peak / 2**30, max(budget, 0) / 2**30)
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
        if kv_transfer_params and "first_token_id" in kv_transfer_params:
            self._check_remote_params(kv_transfer_params, n)
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
        return bool(self.scheduler.has_work() or self._inbox or self._aborts or self._remote_waiting or self._pulling)

    @property
    def has_pins(self) -> bool:
        return self.connector is not None and len(self.connector.pins) > 0

    def step(self) -> list[RequestOutput]:
        outputs = self._apply_inbox()
        self._free_released_pins()
        self._start_pulls()
        self._finish_pulls()
        batch = self.scheduler.schedule()
        self._publish_kv_events()  # evictions made while scheduling
        if not batch:
            if self._pulling:  # nothing to compute until a pull lands: wait for one, briefly
                wait([f for _, f in self._pulling.values()], timeout=0.005, return_when=FIRST_COMPLETED)
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
            num_pinned_blocks=self.connector.pins.num_blocks() if self.connector else 0,
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
            if self._prepare_remote(req):
                self._remote_waiting.append(req)
            elif req.status.finished:  # the handed-over first token already ended it
                self.requests.pop(req.request_id)
                outputs.append(self._output(req, [], None))
            else:
                self.scheduler.add(req)
        for rid in aborts:
            req = self.requests.pop(rid, None)
            if req is None or req.status.finished:
                continue
            if req.request_id in self._pulling:
                req.aborted = True  # blocks are being written: freed when the pull ends
            else:
                if req in self._remote_waiting:
                    self._remote_waiting.remove(req)
                    self._release_remote(req)
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            req.set_status(RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(req, [], None))
        return outputs

    # -- KV transfer (scheduler side) ---------------------------------------------------------

    def _make_connector(self):
        c = self.config
        if c.role == "both" and c.kv_transfer is None:
            return None  # a plain worker: no side channel, no port
        from pdserve.worker.kv.connector import KVConnector

        mc = self.model_config
        layout = f"{mc.num_layers}x{mc.num_kv_heads}x{mc.head_dim}:{str(self.dtype).removeprefix('torch.')}:{c.block_size}"
        connector = KVConnector(c, self.kv_cache.tensor, self.engine_id, layout)
        if c.role in ("prefill", "both"):
            connector.start_server()
        return connector

    REMOTE_KEYS = {"remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_request_id": str,
                   "remote_block_ids": list, "num_prompt_tokens": int, "first_token_id": int,
                   "transfer_token": str, "kv_layout": str}

    def _check_remote_params(self, p: dict, num_prompt_tokens: int) -> None:
        """Decode side: reject malformed or incompatible kv_transfer_params before admission."""
        for key, typ in self.REMOTE_KEYS.items():
            if not isinstance(p.get(key), typ) or isinstance(p.get(key), bool):
                raise RequestError("kv_transfer_params", f"kv_transfer_params.{key} is missing or not a {typ.__name__}")
        if not 0 <= p["first_token_id"] < self.model_config.vocab_size:
            raise RequestError("kv_transfer_params", "kv_transfer_params.first_token_id is out of the vocabulary")
        if p["num_prompt_tokens"] != num_prompt_tokens:
            raise RequestError("kv_transfer_params", f"kv_transfer_params describe {p['num_prompt_tokens']} prompt "
                                                     f"tokens but the prompt has {num_prompt_tokens}")
        remote_bs = p["kv_layout"].rsplit(":", 1)[-1]
        if remote_bs != str(self.block_manager.block_size):
            raise RequestError("kv_transfer_params", f"the prefill worker's KV block size is {remote_bs} but this "
                                                     f"worker's is {self.block_manager.block_size}; P and D must match")
        if self.connector is not None:
            from pdserve.worker.kv.connector import KVLayoutMismatch

            try:
                self.connector.check_params(p, self.block_manager.block_size)
            except KVLayoutMismatch as e:
                raise RequestError("kv_transfer_params", str(e)) from e

    def _free_released_pins(self) -> None:
        if self.connector is None:
            return
        for rid, block_ids, expired in self.connector.pins.collect():
            if expired:
                log.warning("KV pin of %s expired after %.0fs without a release; freeing %d blocks",
                            rid, self.config.kv_pin_ttl, len(block_ids))
            self.block_manager.unpin(block_ids)

    def _start_pulls(self) -> None:
        bs = self.block_manager.block_size
        while self._remote_waiting:
            req = self._remote_waiting[0]
            cached = self.block_manager.lookup_prefix(req)
            if not self.block_manager.can_allocate(req, req.num_tokens, cached):
                return  # FCFS; retried next step as blocks free up
            self._remote_waiting.pop(0)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = len(cached) * bs
                self.block_manager.record_query(req.num_prompt_tokens, req.num_cached_tokens)
            self.block_manager.take_cached(req, cached)
            self.block_manager.allocate(req, req.num_tokens)
            n_prompt_blocks = -(-req.num_prompt_tokens // bs)
            # Prompt blocks already in our prefix cache are not pulled again.
            indices = list(range(len(cached), n_prompt_blocks))
            dst = req.block_ids[len(cached):n_prompt_blocks]
            self._pulling[req.request_id] = (req, self.connector.start_pull(req.kv_transfer_params, indices, dst))

    def _finish_pulls(self) -> None:
        for rid, (req, fut) in list(self._pulling.items()):
            if not fut.done():
                continue
            del self._pulling[rid]
            if req.aborted:
                self.block_manager.free_request(req)
                continue
            try:
                fut.result()
                req.num_computed_tokens = req.num_prompt_tokens
            except Exception as e:
                # The prompt's KV never arrived: prefill it here (slower, but the answer is
                # the same) rather than failing the request.
                log.warning("KV pull for %s failed (%s); prefilling locally", rid, e)
                self.connector.metrics.local_prefill_fallbacks.inc()
            self.scheduler.add_running(req)

    def _release_remote(self, req: Request) -> None:
        if self.connector is not None:  # an empty pull only releases the remote pin
            self.connector.start_pull(req.kv_transfer_params, [], [])

    def _prepare_remote(self, req: Request) -> bool:
        """Set up P/D roles for `req`; True if its prompt KV is to be pulled from a prefill worker."""
        p = req.kv_transfer_params
        if not p:
            return False
        if p.get("do_remote_decode"):
            # Prefill side: one token, then the blocks wait for the decode worker. A worker
            # with no side channel serves the request plainly (no params come back).
            req.params = replace(req.params, max_tokens=1, min_tokens=0)
            req.keep_blocks = self.connector is not None and self.connector.server is not None
            return False
        if "first_token_id" not in p:
            return False
        # Decode side: the prefill worker already produced (and returned) the first token. It
        # joins the sequence as an emitted output, so the caller never sees it twice.
        req.token_ids.append(int(p["first_token_id"]))
        req.num_emitted_tokens = 1
        if req.check_stop(self.max_model_len):
            self._release_remote(req)
            return False
        # Without a connector (or with a failed pull) the prompt is prefilled locally.
        return self.connector is not None

    def _output(self, req: Request, new: list[int], logprob) -> RequestOutput:
        req.num_emitted_tokens += len(new)
        finished = req.status.finished
        kv_params = None
        if finished and req.keep_blocks and req.status is not RequestStatus.FINISHED_ABORTED:
            kv_params = self._pin_for_remote(req)
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

    def _pin_for_remote(self, req: Request) -> dict:
        """Keep the prompt's blocks for the decode worker; describe where they are."""
        # The scheduler left the finished request's block references in place (keep_blocks);
        # they move to the pin table, which drops them on release or TTL. Only prompt blocks
        # are offered: the first token's KV was never computed here.
        n_blocks = -(-req.num_prompt_tokens // self.block_manager.block_size)
        block_ids, extra = req.block_ids[:n_blocks], req.block_ids[n_blocks:]
        self.block_manager.unpin(extra)
        req.block_ids = []
        return self.connector.pin(req.request_id, block_ids, req.num_prompt_tokens, req.output_token_ids[0])

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
