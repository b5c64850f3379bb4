"""The engine: add_request / step / abort over scheduler, block manager and model runner.

Thread model: `step()` runs on one thread (the async wrapper's executor); `add_request` and
`abort` may be called from any thread. They only enqueue under a lock; the step thread
applies them at the start of the next step, so scheduler state has a single writer.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, replace

import torch

from pdserve.worker.attention import make_backend
from pdserve.worker.block_manager import BlockManager
from pdserve.worker.config import ConfigError, EngineConfig
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


@dataclass
class _Pin:
    block_ids: list[int]
    expires_at: float


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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.engine_id = uuid.uuid4().hex[:12]
        backend = make_backend(self.device)
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
        num_blocks = self._num_kv_blocks()
        if num_blocks * bs < max_len:
            log.warning("KV cache holds %d tokens < max_model_len %d: long requests will be preempted",
                        num_blocks * bs, max_len)
        self.kv_cache = KVCache(mc, num_blocks, bs, self.dtype, self.device)
        backend.bind(self.kv_cache)
        self.block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching, on_event=self._on_kv_event)
        budget = config.max_num_batched_tokens or max(2048, config.max_num_seqs)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, budget, max_len)
        self.runner = ModelRunner(self.model, bs, self.device)
        self.requests: dict[str, Request] = {}
        self.pins: dict[str, _Pin] = {}
        self.kv_event_sinks: list = []
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._unpins: list[str] = []
        log.info("engine ready: %s on %s/%s, %d KV blocks x %d tokens (%.0f MiB), max_model_len %d, attention=%s",
                 mc.architecture, self.device, str(self.dtype).removeprefix("torch."), num_blocks, bs,
                 num_blocks * KVCache.bytes_per_block(mc, bs, self.dtype) / 2**20, max_len, backend.name)

    def _num_kv_blocks(self) -> int:
        per_block = KVCache.bytes_per_block(self.model_config, self.config.block_size, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used
            # Headroom for activations of the largest step (a rough, conservative bound).
            budget -= 2 * (self.config.max_num_batched_tokens or 2048) * self.model_config.vocab_size * 4
        else:
            budget = self.config.kv_cache_memory or CPU_DEFAULT_KV_BYTES
        n = budget // per_block
        if n < 2:
            raise ConfigError("--kv-cache-memory" if self.device.type == "cpu" else "--gpu-memory-utilization",
                              f"leaves room for {n} KV blocks of {per_block} bytes; need at least 2")
        return int(n)

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
        req = Request(request_id, prompt_token_ids, params, self.model_config.eos_token_ids, kv_transfer_params)
        with self._lock:
            self._inbox.append(req)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def release_pin(self, request_id: str) -> bool:
        """The remote decode side is done with this prefill's blocks (or gave up)."""
        with self._lock:
            self._unpins.append(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self._inbox or self._aborts or self._unpins or self.pins)

    def step(self) -> list[RequestOutput]:
        outputs = self._apply_inbox()
        self._expire_pins()
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        sampled, logprobs = self.runner.run(batch)
        finished = self.scheduler.update(batch, sampled)
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
            num_pinned_blocks=sum(len(p.block_ids) for p in self.pins.values()),
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    # -- internals ----------------------------------------------------------------------------

    def _apply_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            unpins, self._unpins = self._unpins, []
        for req in inbox:
            if req.request_id in self.requests:
                log.warning("duplicate request id %s ignored", req.request_id)
                continue
            self._prepare_remote(req)
            self.requests[req.request_id] = req
            self.scheduler.add(req)
        outputs = []
        for rid in aborts:
            req = self.requests.pop(rid, None)
            if req is not None and not req.status.finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                outputs.append(self._output(req, [], None))
        for rid in unpins:
            pin = self.pins.pop(rid, None)
            if pin is not None:
                self.block_manager.unpin(pin.block_ids)
        return outputs

    def _expire_pins(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, p in self.pins.items() if p.expires_at <= now]:
            log.warning("KV pin of %s expired after %.0fs without a release; freeing its blocks",
                        rid, self.config.kv_pin_ttl)
            self.block_manager.unpin(self.pins.pop(rid).block_ids)

    def _prepare_remote(self, req: Request) -> None:
        p = req.kv_transfer_params
        if not p:
            return
        if p.get("do_remote_decode"):
            # Prefill side of P/D: one token, then the blocks wait for the decode worker.
            req.params = replace(req.params, max_tokens=1, min_tokens=0)
            req.keep_blocks = True
            return
        if "first_token_id" not in p:
            return
        # Decode side: the prefill worker already produced the first token.
        # Until the KV pull lands the prompt is recomputed locally; the handed-over token is
        # appended as an already-emitted output so the caller never sees it twice.
        req.token_ids.append(int(p["first_token_id"]))
        req.num_emitted_tokens = 1

    def _output(self, req: Request, new: list[int], logprob) -> RequestOutput:
        req.num_emitted_tokens += len(new)
        finished = req.status.finished
        kv_params = None
        if finished and req.status is not RequestStatus.FINISHED_ABORTED and self._wants_remote_decode(req):
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

    @staticmethod
    def _wants_remote_decode(req: Request) -> bool:
        return bool(req.kv_transfer_params and req.kv_transfer_params.get("do_remote_decode"))

    def _pin_for_remote(self, req: Request) -> dict:
        """Keep the prompt's blocks for the decode worker; describe where they are."""
        # The scheduler left the finished request's block references in place (keep_blocks);
        # they move to the pin table, which drops them on release or TTL. Only prompt blocks
        # are offered: the first token's KV was never computed here.
        n_blocks = -(-req.num_prompt_tokens // self.block_manager.block_size)
        block_ids, extra = req.block_ids[:n_blocks], req.block_ids[n_blocks:]
        self.block_manager.unpin(extra)
        req.block_ids = []
        self.pins[req.request_id] = _Pin(block_ids, time.monotonic() + self.config.kv_pin_ttl)
        return {
            "remote_engine_id": self.engine_id,
            "remote_request_id": req.request_id,
            "remote_block_ids": block_ids,
            "num_prompt_tokens": req.num_prompt_tokens,
            "block_size": self.block_manager.block_size,
            "first_token_id": req.output_token_ids[0],
        }

    def _on_kv_event(self, kind, block_hashes, parent, token_ids) -> None:
        for sink in self.kv_event_sinks:
            sink(kind, block_hashes, parent, token_ids)

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
