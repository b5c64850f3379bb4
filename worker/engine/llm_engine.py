"""The engine: add_request / step / abort over scheduler, model runner and KV connector.

One step: apply queued arrivals and aborts; apply what the KV connector's worker side
finished (pulls landed or failed, pinned blocks released); schedule; start this step's pulls;
run the model; advance the requests. The scheduler owns every request and block; the model
runner owns the model, the KV cache and the CUDA graphs; the connector's worker side moves
bytes between workers.

Async scheduling (--async-scheduling): `step()` keeps one step in flight. It schedules and
launches step n+1 while step n's work is still queued on the device, then reads step n's
tokens and builds its outputs (stop checks, finished requests) while step n+1 runs; step n+1's
decodes take step n's token ids from the device. A request that step n finished was scheduled
once too often: its step n+1 token is dropped. Where the next step needs the host to know step
n's tokens first (grammar masks, penalties, prompt logprobs) step n is finished before step
n+1 is scheduled: that step runs synchronously. With P/D KV transfer the connector's orders
keep the synchronous engine's order per step (`_step_async`): a streamed chunk becomes readable
when its step is collected, while the next chunk runs. A P/D worker under tensor parallelism
keeps the synchronous engine (see docs/async-scheduling.md).

Thread model: `step()` runs on one thread (the async wrapper's executor); `add_request` and
`abort` may be called from any thread. They only enqueue under a lock; the step thread
applies them at the start of the next step, so scheduler state has a single writer.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import replace

from pdserve.protocol.kv_transfer import (PARAM, KVTransferParams, KVTransferParamsError, RemoteDecodeRequest,
                                          is_remote_decode, prefix_source,
                                          parse_kv_transfer_params)
from pdserve.worker.attention.kv_cache import KVCache, kv_layout
from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.engine.block_manager import BlockManager
from pdserve.worker.engine.host_tier_index import HostTierIndex
from pdserve.worker.engine.hybrid_block_manager import HybridBlockManager
from pdserve.worker.engine.scheduler import Scheduler
from pdserve.worker.executor.model_runner import LaunchedStep, ModelRunner
from pdserve.worker.kv.connector_meta import KVConnectorMetadata
from pdserve.worker.kv.connector_scheduler import KVConnectorScheduler, resolve_split
from pdserve.worker.kv.layer_clock import LayerClock
from pdserve.worker.kv.null_connector import NullKVConnector
from pdserve.worker.request.outputs import EngineStats, HostTierStats, RequestOutput
from pdserve.worker.request.request import Request, RequestError, RequestStatus  # noqa: F401 (RequestError re-exported)
from pdserve.worker.request.sampling_params import SamplingParams, SamplingParamsError
from pdserve.worker.sample.prompt_logprobs import scores_prompt
from pdserve.worker.structured.structured_output import StructuredOutputs

log = logging.getLogger(__name__)


def wants_async_scheduling(asked: bool | None, device_type: str, tensor_parallel: bool, kv_transfer: bool) -> bool:
    """--async-scheduling as given, else on with a GPU (measured better for aggregated and P/D
    workers: docs/async-scheduling.md) and off on CPU, where the host runs the step itself and
    there is nothing to overlap. Never for KV transfer under tensor parallelism (not tested yet)."""
    want = device_type == "cuda" if asked is None else asked
    return want and not (tensor_parallel and kv_transfer)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, attention_backend: str | None = None,
                 static_decode: bool | None = None, structured_outputs_backend: str | None = None):
        """`attention_backend` and `static_decode`: test and benchmark overrides (see ModelRunner);
        `structured_outputs_backend` overrides the config's grammar engine (structured_output.py)."""
        self.config = config
        self.engine_id = uuid.uuid4().hex[:12]
        # Tensor parallelism: the other ranks start first (each builds its own ModelRunner shard),
        # then rank 0's runner joins them (executor/tp_ranks.py).
        self.followers, store = None, None
        if config.tensor_parallel_size > 1:
            from pdserve.worker.executor.tp_ranks import start_followers
            from pdserve.worker.kv.tp_link import FollowerKV, needs_kv_connector

            store, self.followers = start_followers(config, ModelRunner, attention_backend, static_decode,
                                                    FollowerKV if needs_kv_connector(config) else None)
        try:
            self.runner = ModelRunner(config, attention_backend=attention_backend, static_decode=static_decode,
                                      tp_store=store, followers=self.followers)
        except BaseException:
            if self.followers is not None:
                self.followers.shutdown()
            raise
        r = self.runner
        self.model_config, self.tokenizer, self.model_path = r.model_config, r.tokenizer, r.model_path
        self.device, self.dtype, self.attention_backend = r.device, r.dtype, r.attention_backend
        self.max_model_len, self.kv_cache = r.max_model_len, r.kv_cache
        # The connector's worker-side half; a plain worker (role both, no --kv-transfer) moves no
        # KV and opens no port: its connector is the null one.
        self.kv_connector: KVConnector | NullKVConnector = NullKVConnector()
        if config.role != "both" or config.kv_transfer is not None:
            from pdserve.worker.kv.connector import KVConnector

            # Under TP every rank gets a connector over its shard; the layout named is the whole model's.
            self.kv_connector = KVConnector(config, self.kv_cache.tensor, self.engine_id,
                                            kv_layout(self.model_config, r.kv_dtype, config.block_size,
                                                      self.kv_cache.scales if self.kv_cache.quantized else None,
                                                      r.kv_groups),
                                            tp=r.kv_tp_rank, link=r.kv_tp_link)
            if config.role in ("prefill", "both"):
                self.kv_connector.start_server()
        # The host tier's slots are the runners'; which hash is in which slot, the block manager's.
        host_tier = HostTierIndex(r.host_tier_slots) if r.host_kv is not None else None
        if r.kv_groups is None:
            self.block_manager = BlockManager(r.num_blocks, config.block_size, config.enable_prefix_caching,
                                              on_event=self._on_kv_event, host_tier=host_tier)
        else:  # sliding-window layers: their blocks behind the window are released (docs/kv-cache.md)
            self.block_manager = HybridBlockManager(r.num_blocks, config.block_size, r.kv_groups,
                                                    config.enable_prefix_caching, on_event=self._on_kv_event,
                                                    host_tier=host_tier)
        kv_scheduler = KVConnectorScheduler(config.block_size, self.model_config.vocab_size, self.max_model_len,
                                            self.kv_connector.endpoint(), config.kv_stream_chunk_tokens,
                                            resolve_split(config.kv_stream_split, self.kv_connector.transport),
                                            step_budget=r.max_num_batched_tokens)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, r.max_num_batched_tokens,
                                   self.max_model_len, kv_scheduler, config.scheduling_policy,
                                   max_loras=config.max_loras if r.lora else 0)
        self.lora = r.lora  # the LoRA adapters' manager (--enable-lora), else None
        self.requests: dict[str, Request] = {}
        self.structured_outputs = StructuredOutputs(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids,
            structured_outputs_backend or config.structured_outputs_backend,
            allow_additional_properties=config.structured_outputs_allow_additional_properties,
            max_spec_bytes=config.max_structured_spec_bytes)
        # KV cache events for KV-aware routers: collected during a step, published once per step.
        self._kv_events: list[dict] = []
        self._kv_event_publisher = None
        if config.kv_events_port is not None:
            from pdserve.protocol.kv_events import KVEventPublisher

            # Where HTTP listens, so workers of one host on their own addresses (127.0.0.x) can
            # share the port numbers; every interface for a wildcard or an IPv6 address (the
            # socket speaks IPv4 only).
            host = config.kv_bind_host
            host = "*" if not host or host == "0.0.0.0" or ":" in host else host
            self._kv_event_publisher = KVEventPublisher(
                self.engine_id, f"tcp://{host}:{config.kv_events_port}", f"tcp://{host}:{config.kv_events_port + 1}")
        # Async scheduling: tensor-parallel ranks get each step's sampled ids from rank 0 on the
        # device (StepPlan.share_tokens); P/D workers keep the connector's order of orders
        # (_step_async). Both at once (a P/D worker under TP) is not tested yet: synchronous.
        # (A prefill worker pulls too when it may: a prefix a peer holds, kv/prefix_cost.py.)
        self._pulls_kv = self.kv_connector.active and (config.role != "prefill" or bool(config.kv_peer_allow))
        tp = config.tensor_parallel_size > 1
        self.async_scheduling = wants_async_scheduling(config.async_scheduling, self.device.type, tp,
                                                       self.kv_connector.active)
        if self.async_scheduling and tp:
            self.runner.share_sampled = True
        if config.async_scheduling and not self.async_scheduling:
            log.warning("--async-scheduling ignored: not yet supported with KV transfer under tensor parallelism")
        elif self.async_scheduling:
            log.info("async scheduling on: the next step is launched before this one's tokens are read")
        self._in_flight: LaunchedStep | None = None
        # Steps launched while the one before was still in flight, and tokens dropped because
        # their request had finished (tests and benchmarks read these).
        self.num_overlapped_steps = 0
        self.num_dropped_tokens = 0
        self.num_late_joins = 0  # async: a pull landed while the step in flight ran (_step_async)
        self._lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._unpins: list[tuple[str, str]] = []  # (request id, transfer token): pins to release
        # Where a streamed prefill's params go the moment it is admitted, before its first chunk
        # runs (the async engine delivers them to the waiting HTTP request); None: with the step's outputs.
        self.on_announce = None
        mc = self.model_config
        log.info("engine ready: %s on %s/%s, %d KV blocks x %d tokens (%.0f MiB, %s%s), max_model_len %d, "
                 "attention=%s", mc.architecture, self.device, str(self.dtype).removeprefix("torch."), r.num_blocks,
                 config.block_size, r.num_blocks * KVCache.bytes_per_block(mc, config.block_size, r.kv_dtype,
                                                                           r.kv_groups) / 2**20,
                 self.kv_cache.layout.element, "" if r.kv_groups is None else
                 f", {r.kv_groups.slots} layers a block: sliding window {r.kv_groups.window} released",
                 self.max_model_len, self.attention_backend)

    # -- public API ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    kv_transfer_params: KVTransferParams | RemoteDecodeRequest | None = None, grammar=None,
                    continued: list[int] = (), lora_name: str | None = None) -> None:
        """`continued`: a migrated stream's outputs so far (request/request.py).
        `lora_name`: the LoRA adapter it runs (one this worker serves), None for the base model.
        `kv_transfer_params`: the parsed object (the server parses the body once); a dict (a
        direct caller, a test) is parsed here, the same way. `grammar`: the request's
        GrammarMatcher when the caller built it (the server does, off its event loop:
        grammar_pool.py); else a spec in `params` is compiled here."""
        n = len(prompt_token_ids) + len(continued)
        if not prompt_token_ids:
            raise RequestError("prompt", "the prompt is empty")
        if n >= self.max_model_len:
            raise RequestError("prompt", f"this model's maximum context length is {self.max_model_len} tokens, "
                                         f"but the prompt and continuation have {n} tokens")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise RequestError("prompt", f"token ids must be in [0, {vocab})")
        if continued and (kv_transfer_params or min(continued) < 0 or max(continued) >= vocab):
            raise RequestError("continuation", f"continued token ids must be in [0, {vocab}), "
                                               "without kv_transfer_params")
        try:
            params.check_vocabulary(vocab)  # ids the sampler indexes the logits with (width: vocab)
        except SamplingParamsError as e:
            raise RequestError(e.param, str(e)) from None
        try:
            kv_transfer_params = parse_kv_transfer_params(kv_transfer_params)
        except KVTransferParamsError as e:
            raise RequestError(PARAM, str(e)) from None
        if is_remote_decode(kv_transfer_params):
            if params.prompt_logprobs is not None:  # the prompt ran elsewhere: no logits here
                raise RequestError("echo", "prompt logprobs cannot be computed from transferred KV; "
                                           "send this request without kv_transfer_params")
            self.scheduler.connector.check_params(kv_transfer_params, prompt_token_ids)
        elif (source := prefix_source(kv_transfer_params)) is not None:
            self.scheduler.connector.check_prefix(source, prompt_token_ids)
        if lora_name is not None and (self.lora is None or not self.lora.serves(lora_name)):
            raise RequestError("model", f"LoRA adapter {lora_name!r} is not loaded on this worker",
                               "model_not_found")
        if is_remote_decode(kv_transfer_params) and kv_transfer_params.lora_name != lora_name:
            # The pulled KV was computed under the prefill's adapter: decoding under another
            # would continue someone else's activations.
            raise RequestError(PARAM, f"the prefill ran {kv_transfer_params.lora_name or 'the base model'} but "
                                      f"this request asks for {lora_name or 'the base model'}")
        req = Request(request_id, prompt_token_ids, params, self.model_config.eos_token_ids, kv_transfer_params,
                      continued)
        req.lora_name = lora_name
        if lora_name is not None:
            req.lora_path = self.lora.path_of(lora_name)
        if grammar is not None:
            req.grammar = grammar
        elif params.structured is not None:  # compiled (or a cache hit) here: a bad schema is the caller's 400
            req.grammar = self.structured_outputs.matcher(params.structured)
        with self._lock:
            # A second request under a live id would never get outputs of its own: refuse it.
            if request_id in self.requests or any(r.request_id == request_id for r in self._inbox):
                raise RequestError("request_id", f"request id {request_id!r} is already in flight")
            self._inbox.append(req)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def unpin(self, request_id: str, kv_transfer_params: KVTransferParams) -> None:  # the params this worker emitted
        """Any thread: a finished prefill's pin will not be read (its answer ended on a stop
        string, which only the detokenizer sees): free its blocks at the next step, not at TTL."""
        with self._lock:
            self._unpins.append((request_id, kv_transfer_params.transfer_token))

    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self._inbox or self._aborts or self._unpins
                    or self._in_flight is not None)

    @property
    def has_pins(self) -> bool:
        """Blocks are held for a remote decode worker: step now and then, so expired pins are freed."""
        return bool(self.scheduler.sending)

    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_async()
        outputs = self._apply_inbox()
        outputs += self._kv_finished()
        batch = self.scheduler.schedule()
        self._copy_tiers_first(batch)
        # Orders since the last step's (aborts, unpins) and admission's (pulls, streamed pins).
        self.kv_connector.apply(batch.kv_connector_metadata)
        outputs += self._announce()
        self._publish_kv_events()  # evictions made while scheduling
        if not batch:
            if not self.scheduler.held_for_restore:  # else they run at the next schedule
                self.kv_connector.wait_for_loads(timeout=0.005)  # nothing to compute until a pull lands
            return outputs
        # A worker that pulls KV waits for every step, also one that samples nothing (a prefill
        # chunk): the next step's scheduling may free this step's blocks (an abort, a preemption)
        # and hand them to a pull, which writes from another stream or the NIC, unordered with ours.
        t0 = time.perf_counter()
        launched = self.runner.launch(batch, mark_done=self._pulls_kv, layer_clock=self._layer_clock(batch),
                                      immediate=True)
        sampled, logprobs = self.runner.collect(launched)
        self._observe_prefill(batch, time.perf_counter() - t0)
        if self.scheduler.connector.streams(batch.items):
            self.runner.synchronize()  # a streamed chunk is made readable: its KV must be written
        finished = self.scheduler.update(batch, sampled)
        # The results' orders (finished prefills' pins, streamed progress), before any output
        # of this step leaves: a pin exists before its params can reach a reader. Without a
        # connector there is no reader (the next schedule() takes whatever orders there are).
        if self.kv_connector.active:
            self.kv_connector.apply(self.scheduler.connector.build_connector_meta())
        self._publish_kv_events()
        return outputs + self._step_outputs(batch, sampled, logprobs, finished)

    def _kv_finished(self) -> list[RequestOutput]:
        """Unpins first (so get_finished reports them), then what the connector's worker side
        finished: pins freed, pulls landed or failed."""
        if not self.kv_connector.active and not self._unpins:  # no connector: nothing to report
            return []
        with self._lock:
            unpins, self._unpins = self._unpins, []
        for rid, token in unpins:
            self.scheduler.connector.unpin(rid, token)
        outputs = []
        for req in self.scheduler.update_from_kv_xfer(self.kv_connector.get_finished()):
            # A streamed hand-off's first token came with its pull (or it ended without one).
            outputs.append(self._output(req, [], None, handed_over=req.output_token_ids[:1]))
            if req.status.finished:
                self.requests.pop(req.request_id, None)
        return outputs

    def _step_outputs(self, batch, sampled, logprobs, finished) -> list[RequestOutput]:
        outputs = []
        finished_ids = {r.request_id for r in finished}
        for req, _ in batch.items:
            new = req.token_ids[req.num_prompt_tokens + req.num_emitted_tokens:] if req.request_id in sampled else []
            handed_over = None
            if req.hands_over_first and req.output_token_ids:
                req.hands_over_first = False
                handed_over = req.output_token_ids[:1]
            elif not new and req.request_id not in finished_ids:
                continue
            logprob = None if handed_over and not new else logprobs.get(req.request_id)  # not token 0's: P sent it
            outputs.append(self._output(req, new, logprob, handed_over))
        for req in finished:
            self.requests.pop(req.request_id, None)
        return outputs

    # -- async scheduling ---------------------------------------------------------------------

    def _step_async(self) -> list[RequestOutput]:
        """Launch the next step, then finish the one in flight (module docstring).

        With a KV connector each step keeps the synchronous step's order of orders: unpins,
        then what the worker side finished; the admissions' orders (pulls, streamed pins) right
        after `schedule()`, before the launch; a step's results' orders (finished prefills'
        pins, streamed progress) when it is collected, after the device wrote its KV and
        before any of its outputs leave. What changes is only that step n+1 is launched
        between step n's launch and its collection: a streamed prefill's chunk k+1 runs on the
        device while chunk k is made readable."""
        outputs = self._apply_inbox()
        outputs += self._kv_finished()
        previous = self._in_flight
        if previous is not None and not self._can_overlap():
            outputs += self._finish(previous)
            previous = None
        elif previous is not None and self.kv_connector.pull_landing():
            # A hand-off's KV lands about now (P/D's first gap): planned now, behind `previous`,
            # its request would wait a whole extra step. Plan only once it landed or `previous`
            # is done, whichever comes first. Landed while `previous` still runs: a late join,
            # the request is in the step launched behind it (overlap kept). Else one step
            # without overlap: collect `previous`, take what landed meanwhile, plan with it.
            step = previous
            if not self.kv_connector.wait_for_landing(lambda: self.runner.is_done(step)):
                outputs += self._finish(previous)
                previous = None
            self.num_late_joins += previous is not None
            outputs += self._kv_finished()
        batch = self.scheduler.schedule()
        self._copy_tiers_first(batch)
        later_loads = None
        meta = batch.kv_connector_metadata
        if previous is not None and meta.loads:
            # A pull's destination blocks may have been freed while `previous` was queued
            # (a request it decodes finished or was preempted since): `previous` may still
            # write that request's KV into one of them, and a pull writes from another
            # stream (or a NIC), unordered with ours. Pulls start once `previous` is done.
            meta, later_loads = replace(meta, loads=[]), meta.loads
        self.kv_connector.apply(meta)
        outputs += self._announce()
        self._publish_kv_events()  # evictions made while scheduling
        launched = None
        if batch:
            # Under P/D a step is always waited for when collected (`done`): a streamed chunk is
            # made readable then, and pulls into freed blocks start after it.
            launched = self.runner.launch(batch, previous, mark_done=self.kv_connector.active,
                                          layer_clock=self._layer_clock(batch))
            self.num_overlapped_steps += previous is not None
            launched.advanced = self.scheduler.advance(batch, set(launched.rows))
        self._in_flight = launched
        if previous is not None:
            outputs += self._finish(previous)  # while `launched` runs on the device
        if later_loads:
            self.kv_connector.apply(KVConnectorMetadata(loads=later_loads))
        if launched is None and previous is None and not self.scheduler.held_for_restore:
            self.kv_connector.wait_for_loads(timeout=0.005)  # nothing to compute until a pull lands
        return outputs

    def _copy_tiers_first(self, batch) -> None:
        """The host tier beside P/D transfer. The tier's copies normally run with the step, just
        before its forward; the connector's orders do not wait for that step: a pull starts
        writing its blocks (from the NIC or another stream) as soon as it is applied, a streamed
        pin makes blocks readable at admission, and a batch of pulls alone runs no step at all.
        So when this schedule's orders include any of those, its copies are carried out first
        and waited for: a block evicted to the tier (now a pull's destination) is copied out
        before the pull overwrites it, and a block restored from the tier is written before a
        reader or a pull's neighbour can see it. Copies that earlier steps left running beside
        their forwards (HostKVStore.pending) are waited for before a pull or a pin too."""
        if batch and not self.kv_connector.active:
            return
        meta = batch.kv_connector_metadata
        # Copies of earlier steps may still run beside the step in flight (stores ahead of
        # eviction, restores: HostKVStore.pending): a pull or a reader waits for those too.
        # A schedule that runs no step (its requests held out while their restores land, or
        # pulls alone) has nothing to carry its copies: they run here.
        pulls = bool(self.kv_connector.active and (meta.loads or meta.pins))
        if (batch.kv_tier_ops and (pulls or not batch)) or (pulls and self.runner.tier_copies_pending()):
            self.runner.copy_tiers_now(batch.kv_tier_ops)
            batch.kv_tier_ops = []

    def _layer_clock(self, batch) -> LayerClock | None:
        """A step that computes streamed prefills (prefill side, one rank): the blocks it completes
        go into the pin table with a clock its forward ticks per layer, so a layered stream read
        sends their layers as they are written (kv/layer_clock.py), not after the step."""
        if self.followers is not None or not self.scheduler.connector.streams(batch.items):
            return None
        clock = LayerClock(self.model_config.num_layers, self.device, self.kv_connector.clock_ring)
        self.kv_connector.computing(self.scheduler.connector.computing(batch.items), clock)
        return clock

    def _can_overlap(self) -> bool:
        """Whether the next step can be planned before the host knows the step in flight's
        tokens: no running request's sampling or inputs need them on the host."""
        for req in self.scheduler.running:
            p = req.params
            if req.grammar is not None or p.has_penalties or scores_prompt(req) or p.prompt_logprobs is not None:
                return False
        return True

    def _observe_prefill(self, batch, seconds: float) -> None:
        """The prompt tokens a step computed over its time: the recompute side of the choice
        between pulling a prefix a peer holds and computing it (kv/prefix_cost.py). A step of
        decodes only (one token each) says nothing about it."""
        if batch.items[-1][1] == 1:  # decode-like items come first (ScheduledBatch): none computes a prompt
            return
        tokens = sum(n for _, n in batch.items if n > 1)
        if tokens:
            self.scheduler.connector.observe_prefill(tokens, seconds)

    def _finish(self, step: LaunchedStep) -> list[RequestOutput]:
        sampled, logprobs = self.runner.collect(step)
        # Launch to collection: the step's own time, plus the end of the step it was queued behind.
        self._observe_prefill(step.batch, time.perf_counter() - step.launched_at)
        # A token of a request that finished since its step was launched (an earlier token
        # stopped it, or it was aborted) is dropped: no state change, no output.
        dropped = {r.request_id for r in step.samplers if r.status.finished}
        self.num_dropped_tokens += len(dropped)
        finished = self.scheduler.update(step.batch, sampled, advanced=step.advanced)
        # The results' orders (finished prefills' pins, streamed progress up to this step's
        # own computed counts), before any output of this step leaves: `collect` waited for
        # the step's KV, so what they make readable is written.
        self.kv_connector.apply(self.scheduler.connector.build_connector_meta())
        self._publish_kv_events()
        live = {rid: t for rid, t in sampled.items() if rid not in dropped}
        out = self._step_outputs(step.batch, live, logprobs, finished)
        if self._in_flight is step:
            self._in_flight = None
        return out

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting + len(self._inbox),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_pinned_blocks=self.scheduler.num_sending_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            host_tier=self._host_tier_stats(),
            num_preemptions=self.scheduler.num_preemptions,
        )

    def _host_tier_stats(self) -> HostTierStats | None:
        bm, store = self.block_manager, self.runner.host_kv
        if store is None:
            return None
        tier = bm.host_tier
        return HostTierStats(queries=bm.host_queries, hits=bm.host_hits, num_blocks=len(tier),
                             num_slots=tier.num_slots, stored_blocks=tier.stored_blocks,
                             restored_blocks=tier.restored_blocks, evicted_blocks=tier.evicted_blocks,
                             stored_bytes=store.bytes_stored, restored_bytes=store.bytes_restored)

    def kv_health(self) -> str | None:
        """None while P/D transfer can work; else why not (the server's /health answers 503)."""
        return self.kv_connector.health()

    def metrics_collectors(self) -> list:
        """Prometheus collectors beyond `stats()` (KV-transfer series; LoRA's), for the process's registry."""
        collectors = self.kv_connector.collectors()
        if self.lora is not None:
            from pdserve.worker.lora.metrics import LoRARequestsInfo

            collectors.append(LoRARequestsInfo(self.config.max_loras, lambda: self.scheduler.lora_adapters))
        return collectors

    def shutdown(self) -> None:
        if self.followers is not None:  # a tensor-parallel worker's other ranks, then the group
            self.followers.shutdown()
            self.followers = None
        self.runner.shutdown()
        self.kv_connector.shutdown()
        if self._kv_event_publisher is not None:
            self._kv_event_publisher.close()

    # -- internals ----------------------------------------------------------------------------

    def _apply_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            for req in inbox:  # under the lock: add_request's duplicate check sees them
                self.requests[req.request_id] = req
        outputs = []
        for req in inbox:
            if not self.scheduler.add(req):  # the handed-over first token already ended it
                self.requests.pop(req.request_id)
                outputs.append(self._output(req, [], None))
        for rid in aborts:
            req = self.requests.pop(rid, None)
            if req is None or req.status.finished:
                continue
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(req, [], None))
        return outputs

    def _announce(self) -> list[RequestOutput]:
        """Streamed prefills admitted this step: their params leave now, before the chunk runs
        (through `on_announce`; else with this step's outputs)."""
        announced = self.scheduler.connector.announced
        if not announced:
            return []
        outs = [RequestOutput(request_id=r.request_id, new_token_ids=[], num_prompt_tokens=r.num_prompt_tokens,
                              kv_transfer_params=r.kv_transfer_params_out) for r in announced]
        announced.clear()
        if self.on_announce is None:
            return outs
        self.on_announce(outs)
        return []

    def _output(self, req: Request, new: list[int], logprob, handed_over: list[int] | None = None) -> RequestOutput:
        """`new`: a list of the request's new token ids that the output takes as it is (callers
        pass a fresh one). The fields a step's output of a running request leaves at their
        defaults are set only where they apply: this runs for every request of every step."""
        status = req.status
        finished = status.finished
        out = RequestOutput(request_id=req.request_id, new_token_ids=new, finished=finished,
                            stop_reason=req.stop_reason, num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=max(0, req.num_cached_tokens), num_output_tokens=req.num_output_tokens)
        if finished:
            out.finish_reason = status.value
            out.kv_transfer_params = req.kv_transfer_params_out
            if status is RequestStatus.FINISHED_ERROR:
                out.error = req.failure
        if logprob is not None:
            out.logprobs = [logprob]
        if handed_over is not None:
            out.handed_over_token_ids = handed_over
        if not req.waits_reported and (new or finished):
            out.queue_time = self._report_waits(req, new)
            if req.admitted_time is not None and req.kv_landed_time is not None:
                out.kv_wait = (req.admitted_time, req.kv_landed_time)
            out.kv_bytes = getattr(self.kv_connector, "pulled_bytes", {}).pop(req.request_id, None)
        if req.params.prompt_logprobs is not None and req.num_emitted_tokens == 0 and (new or finished):
            out.prompt_logprobs = self.runner.prompt_logprobs.pop(req.request_id, req.num_prompt_tokens)
        req.num_emitted_tokens += len(new)
        return out

    def _report_waits(self, req: Request, new: list[int]) -> float | None:
        """A request's first output with tokens, or its final one (a streamed hand-off's output
        carrying only the prefill's first token is neither): observe a remote-prefilled request's
        hand-off waits (KV metrics: arrival to admission with blocks; pull landed to this first
        decode step, when it had both) and return its queue time, which the server observes."""
        now = time.monotonic()
        req.waits_reported = True
        if is_remote_decode(req.kv_transfer_params):
            admitted, landed = req.admitted_time, req.kv_landed_time
            self.kv_connector.observe_decode_waits(
                None if admitted is None else admitted - req.arrival_time,
                None if landed is None or not new else now - landed)
        return None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time

    def _on_kv_event(self, kind, block_hashes, parent, token_ids, lora_name: str | None = None,
                     medium: str = "GPU") -> None:
        """`medium`: "GPU" for the device cache (whatever the device is, as vLLM names it), "CPU"
        for the host tier."""
        if self._kv_event_publisher is None:
            return
        from pdserve.protocol.kv_events import block_removed, block_stored

        if kind == "BlockStored":
            self._kv_events.append(block_stored(block_hashes, parent, token_ids, self.block_manager.block_size,
                                                lora_name, medium))
        else:
            self._kv_events.append(block_removed(block_hashes, medium))

    def _publish_kv_events(self) -> None:
        if self._kv_events:
            self._kv_event_publisher.publish(self._kv_events)
            self._kv_events = []

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 lora_names: list[str | None] | None = None) -> list[list[int]]:
        """Offline batch generation (tests, benchmarks): output token ids per prompt.
        `lora_names`: each prompt's LoRA adapter (None: the base model)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(prompts))]
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        for rid, prompt, p, lora in zip(ids, prompts, params_list, lora_names or [None] * len(prompts)):
            self.add_request(rid, prompt, p, lora_name=lora)
        pending = set(ids)
        while pending:
            for o in self.step():
                out[o.request_id] += o.new_token_ids
                if o.finished:
                    pending.discard(o.request_id)
        return [out[rid] for rid in ids]
