"""One API request's engine requests: fan-out, merging, metrics and guaranteed abort.

An API request with `p` prompts and `n` choices becomes `p * n` engine requests named
`{id}-{i}` (choice index i = prompt * n + sample); they share their prompt's blocks through the
prefix cache. Their outputs are merged into one stream of `(index, RequestOutput)` in arrival
order. Whatever ends the consumer (finish, client disconnect, error, shutdown), every engine
request that has not finished is aborted, so its KV blocks return to the free pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from pdserve.protocol.contract import HEADER_REQUEST_ID
from pdserve.protocol.kv_transfer import KVTransferParams, RemoteDecodeRequest
from pdserve.protocol.tracing import Tracing, monotonic_to_ns
from pdserve.worker.request.outputs import RequestOutput
from pdserve.worker.request.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from pdserve.worker.server.metrics import ServerMetrics

_END = object()


class Generation:
    def __init__(self, engine, metrics: ServerMetrics, inflight: dict[str, str], request_id: str,
                 prompts: list[list[int]], params: SamplingParams, n: int,
                 kv_transfer_params: KVTransferParams | RemoteDecodeRequest | None = None,
                 continued: list[list[int]] | None = None, finished: frozenset[int] = frozenset(),
                 lora_name: str | None = None, tracing: Tracing | None = None, trace_headers=None):
        """`continued[i]`: choice i's output so far on a lost worker (protocol/continuation.py);
        the choices in `finished` ended there and are not generated again. `lora_name`: the
        LoRA adapter every choice runs (None: the base model). With `tracing` on, the request is
        a span under `trace_headers`' context (the router's call), its engine phases children."""
        self.engine = engine
        self.metrics = metrics
        self.inflight = inflight  # engine request ids in flight (for the SIGTERM grace abort) -> X-Request-Id
        self.client_id = (trace_headers or {}).get(HEADER_REQUEST_ID) or ""
        self.request_id = request_id
        self.arrival = time.monotonic()
        self.num_choices = len(prompts) * n
        self.jobs: list[tuple[str, list[int], SamplingParams, list[int]]] = []
        self.indexes: list[int] = []  # each job's choice index
        for p, prompt in enumerate(prompts):
            for s in range(n):
                params_i = params
                if params.seed is not None and n > 1:
                    # Same seed for every sample would make the n choices identical. Wrapped
                    # within int64, the seeds' range, so the largest seed still has n choices.
                    seed = (params.seed + s - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
                    params_i = dataclasses.replace(params, seed=seed)
                index = p * n + s
                if index in finished:
                    continue
                self.indexes.append(index)
                self.jobs.append((f"{request_id}-{index}", prompt, params_i, continued[index] if continued else []))
        self.kv_transfer_params = kv_transfer_params
        self.lora_name = lora_name
        self.tracing = tracing or Tracing.off()
        self.span = self.prefill_span = None
        if self.tracing.enabled:
            self._start_span(trace_headers, prompts, params, n)

    def _start_span(self, headers, prompts, params: SamplingParams, n: int) -> None:
        kv = self.kv_transfer_params
        self.role = "prefill" if isinstance(kv, RemoteDecodeRequest) else "decode" if kv is not None else "whole"
        handoff = kv.trace_context if isinstance(kv, KVTransferParams) else None
        t = self.tracing
        # The router's call parents it; a decode call that came without one continues the
        # prefill's trace from the hand-off. The prefill's span is linked either way.
        self.prefill_span = t.link_context(handoff)
        self.span = t.start(f"worker {self.role}", t.extract(headers) or t.extract(handoff), kind="server",
                            start_ns=monotonic_to_ns(self.arrival), links=[self.prefill_span], attributes={
                                "gen_ai.request.id": self.request_id, "pdserve.role": self.role,
                                "gen_ai.request.max_tokens": params.max_tokens,
                                "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                                "gen_ai.request.n": n, "gen_ai.usage.prompt_tokens": sum(len(p) for p in prompts),
                                "gen_ai.response.model": self.lora_name})
        t.make_current(self.span)
        self._finish_reasons: list[str] = []
        self._completion_tokens = 0

    def __len__(self) -> int:
        return self.num_choices

    async def _one(self, rid: str, prompt: list[int], params: SamplingParams,
                   continued: list[int]) -> AsyncIterator[RequestOutput]:
        self.inflight[rid] = self.client_id
        last: float | None = None
        finished = False
        phases = _Phases(self, rid) if self.span is not None else None
        try:
            gen = self.engine.generate(rid, prompt, params, kv_transfer_params=self.kv_transfer_params,
                                       **({"continued": continued} if continued else {}),
                                       **({"lora_name": self.lora_name} if self.lora_name else {}))
            async with aclosing(gen):
                async for out in gen:
                    now = time.monotonic()
                    if phases is not None:
                        phases.saw(out, now)
                    if out.queue_time is not None:
                        self.metrics.queued(out.queue_time)
                    if out.new_token_ids:
                        if last is None:
                            self.metrics.first_token(now - self.arrival)
                        else:
                            self.metrics.tokens(now - last, len(out.new_token_ids))
                        last = now
                    if out.finished:
                        finished = True
                        self._record(out)
                    yield out
                    if finished:
                        return
            # The engine ended the stream without a final output (e.g. shut down): report it.
            finished = True
            out = RequestOutput(rid, [], finished=True, finish_reason="abort")
            self._record(out)
            yield out
        finally:
            self.inflight.pop(rid, None)
            if not finished:
                self.engine.abort(rid)
                self._record(RequestOutput(rid, [], finished=True, finish_reason="abort"))

    def _record(self, out: RequestOutput) -> None:
        if self.span is not None:
            self._finish_reasons.append(out.finish_reason or "abort")
            self._completion_tokens += out.num_output_tokens
        self.metrics.finished(out.finish_reason or "abort", out.num_prompt_tokens, out.num_output_tokens,
                              time.monotonic() - self.arrival)

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """All outputs of all engine requests, tagged with their choice index."""
        try:
            async with aclosing(self._stream()) as gen:
                async for item in gen:
                    yield item
        finally:
            if self.span is not None:
                self.tracing.end(self.span, {"gen_ai.response.finish_reasons": self._finish_reasons,
                                             "gen_ai.usage.completion_tokens": self._completion_tokens,
                                             "gen_ai.latency.e2e": time.monotonic() - self.arrival})

    async def _stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.jobs) == 1:
            async with aclosing(self._one(*self.jobs[0])) as gen:
                async for out in gen:
                    yield self.indexes[0], out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, job) -> None:
            try:
                async with aclosing(self._one(*job)) as gen:
                    async for out in gen:
                        queue.put_nowait((index, out))
                queue.put_nowait((index, _END))
            except Exception as e:  # surfaced to the consumer, which then cancels the others
                queue.put_nowait((index, e))

        tasks = [asyncio.create_task(pump(i, job)) for i, job in zip(self.indexes, self.jobs)]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is _END:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _Phases:
    """One engine request's spans, from the stamps its outputs carry (the engine loop makes no
    tracing call): queue, the KV hand-off (decode side), prefill up to the first token, decode.
    On the prefill side, the hand-off's params carry the request's span to the decode worker."""

    def __init__(self, gen: Generation, rid: str):
        self.gen = gen
        self.rid = rid
        self.queued_until: float | None = None
        self.first_token: float | None = None

    def saw(self, out: RequestOutput, now: float) -> None:
        g, t = self.gen, self.gen.tracing
        if out.kv_transfer_params is not None:
            out.kv_transfer_params = dataclasses.replace(out.kv_transfer_params, trace_context=t.carrier(g.span))
        if out.queue_time is not None:
            self.queued_until = g.arrival + out.queue_time
            t.record("queue", g.span, monotonic_to_ns(g.arrival), monotonic_to_ns(self.queued_until),
                     {"gen_ai.request.id": self.rid})
            g.span.set_attribute("gen_ai.latency.time_in_queue", out.queue_time)
        if out.kv_wait is not None:
            params = g.kv_transfer_params
            admitted, landed = out.kv_wait
            t.record("kv transfer", g.span, monotonic_to_ns(admitted), monotonic_to_ns(landed), {
                "gen_ai.request.id": self.rid, "pdserve.kv.bytes": out.kv_bytes,
                "pdserve.kv.blocks": len(params.remote_block_ids) if isinstance(params, KVTransferParams) else None,
                "pdserve.kv.transport": params.transport if isinstance(params, KVTransferParams) else None,
                "pdserve.kv.wait_s": landed - admitted}, links=[g.prefill_span])
        if out.new_token_ids and self.first_token is None:
            self.first_token = now
            start = self.queued_until or g.arrival
            t.record("prefill" if g.role != "decode" else "first token", g.span, monotonic_to_ns(start),
                     monotonic_to_ns(now), {"gen_ai.request.id": self.rid,
                                            "gen_ai.usage.cached_tokens": out.num_cached_tokens})
            g.span.set_attribute("gen_ai.latency.time_to_first_token", now - g.arrival)
        if out.finished and self.first_token is not None and out.num_output_tokens > 1:
            t.record("decode", g.span, monotonic_to_ns(self.first_token), monotonic_to_ns(now), {
                "gen_ai.request.id": self.rid, "gen_ai.usage.completion_tokens": out.num_output_tokens,
                "gen_ai.response.finish_reasons": [out.finish_reason or "abort"]})
