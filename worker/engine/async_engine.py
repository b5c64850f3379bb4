"""Asyncio face of the engine: a background task drives step() on a dedicated thread.

Each request gets an asyncio queue; step outputs are routed to it and detokenized there
(stop strings included). Leaving the `generate()` iterator early (client disconnect,
cancellation) aborts the request, which frees its KV blocks at the start of the next step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from pdserve.protocol.kv_transfer import (PARAM, KVTransferParams, KVTransferParamsError, is_remote_decode, is_streamed,
                                          parse_kv_transfer_params)
from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.engine.detokenizer import IncrementalDetokenizer
from pdserve.worker.engine.llm_engine import LLMEngine
from pdserve.worker.request.outputs import EngineStats, RequestOutput
from pdserve.worker.request.request import RequestError, RequestFailed
from pdserve.worker.request.sampling_params import SamplingParams
from pdserve.worker.structured.grammar_pool import GrammarPool

log = logging.getLogger(__name__)

# With nothing to run the loop still wakes this often, so KV pins expire on time.
IDLE_TICK_S = 0.5


class EngineDeadError(RuntimeError):
    """The step loop failed; the worker must be restarted (maps to HTTP 503)."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.model_path: str | None = getattr(engine, "model_path", None)  # the directory loaded
        self._queues: dict[str, asyncio.Queue] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        cfg = engine.config
        # Grammars compile on their own threads, never on the event loop (grammar_pool.py).
        self.grammars = GrammarPool(engine.structured_outputs, cfg.structured_compile_workers,
                                    cfg.structured_compile_queue)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    @property
    def is_ready(self) -> bool:
        """False once the step loop or the KV side channel is gone: /health turns 503, so the
        router stops sending here and Kubernetes restarts the pod."""
        return (self._task is not None and not self._task.done() and self.error is None
                and self.engine.kv_health() is None)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        # A streamed prefill's params reach its HTTP request while its first chunk computes.
        self.engine.on_announce = lambda outs: loop.call_soon_threadsafe(self._deliver, outs)
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
        self.grammars.shutdown()
        self.engine.shutdown()

    @property
    def lora(self):
        """The LoRA adapters' manager (--enable-lora: worker/lora/manager.py), else None."""
        return self.engine.lora

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def metrics_collectors(self) -> list:
        return self.engine.metrics_collectors()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._kick()

    def unpin(self, request_id: str, kv_transfer_params: KVTransferParams) -> None:
        """A finished prefill's pin that no decode worker will read: freed at the next step."""
        self.engine.unpin(request_id, kv_transfer_params)
        self._kick()

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_TICK_S)
                except asyncio.TimeoutError:
                    pass
                if not self.engine.has_work() and not self.engine.has_pins:
                    continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as e:  # a bug or device failure: fail every waiter, never hang them
                log.exception("engine step failed; failing all in-flight requests")
                self.error = e
                for q in self._queues.values():
                    q.put_nowait(e)
                return
            self._deliver(outputs)

    def _deliver(self, outputs) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       kv_transfer_params=None, continued: list[int] = (),
                       lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """`kv_transfer_params`: parsed (KVTransferParams | RemoteDecodeRequest), or a dict parsed here.
        `continued`: a migrated stream's outputs so far, replayed into the detokenizer like a
        handed-over first token (their text is out already), never emitted."""
        if self.error is not None:
            raise EngineDeadError(f"engine failed: {self.error}")
        # A decode worker's first token was sent by the prefill worker: replayed into the
        # detokenizer, never emitted. A streamed hand-off learns it with the KV pull (below).
        try:
            kv_transfer_params = parse_kv_transfer_params(kv_transfer_params)
        except KVTransferParamsError as e:
            raise RequestError(PARAM, str(e)) from None
        streamed = is_streamed(kv_transfer_params)
        emitted = [kv_transfer_params.first_token_id] if is_remote_decode(kv_transfer_params) and not streamed else []
        emitted += continued
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop_strings,
                                       skip_special_tokens=params.skip_special_tokens, emitted_token_ids=emitted)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        done = False
        try:
            # A new grammar compiles off the loop (seconds for a large schema); 400 or 429 from here.
            grammar = await self.grammars.matcher(params.structured) if params.structured is not None else None
            self.engine.add_request(request_id, prompt_token_ids, params, kv_transfer_params,  # raises RequestError
                                    grammar=grammar, **({"continued": continued} if continued else {}),
                                    **({"lora_name": lora_name} if lora_name else {}))
            self._kick()
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise EngineDeadError(f"engine failed: {out}") from out
                if out.error is not None:  # this request alone failed in a step; the engine carries on
                    done = True
                    raise RequestFailed(out.error)
                if out.handed_over_token_ids:
                    detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop_strings,
                                                   skip_special_tokens=params.skip_special_tokens,
                                                   emitted_token_ids=out.handed_over_token_ids)
                    out.handed_over_text = detok.output_text[:detok.num_emitted_chars]
                    if not out.finished:
                        yield out  # tells the server the first token's text (logprob offsets); no tokens
                        continue
                text, stop = detok.update(out.new_token_ids)
                if stop is not None:
                    if not out.finished:
                        self.engine.abort(request_id)  # the engine cannot see strings; stop it here
                    elif out.kv_transfer_params:
                        # A prefill for a remote decode whose first token ends the answer: the router
                        # calls no decode worker, so release the pin now and hand out no params.
                        self.engine.unpin(request_id, out.kv_transfer_params)
                        out.kv_transfer_params = None
                        self._kick()
                    out.finished, out.finish_reason, out.stop_reason = True, "stop", stop
                elif out.finished and not (out.kv_transfer_params and out.finish_reason == "length"):
                    # A prefill handing its KV to a decode worker ends here but the generation does
                    # not: held-back text is the decode worker's to release (detokenizer.py).
                    text += detok.flush()
                out.text = text
                done = out.finished
                yield out
                if done:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not done:
                self.abort(request_id)
