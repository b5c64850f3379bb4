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

from pdserve.protocol.kv_transfer import KVTransferParams, RemoteDecodeRequest
from pdserve.worker.request.outputs import RequestOutput
from pdserve.worker.request.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from pdserve.worker.server.metrics import ServerMetrics

_END = object()


class Generation:
    def __init__(self, engine, metrics: ServerMetrics, inflight: set[str], request_id: str,
                 prompts: list[list[int]], params: SamplingParams, n: int,
                 kv_transfer_params: KVTransferParams | RemoteDecodeRequest | None = None,
                 continued: list[list[int]] | None = None, finished: frozenset[int] = frozenset(),
                 lora_name: str | None = None):
        """`continued[i]`: choice i's output so far on a lost worker (protocol/continuation.py);
        the choices in `finished` ended there and are not generated again. `lora_name`: the
        LoRA adapter every choice runs (None: the base model)."""
        self.engine = engine
        self.metrics = metrics
        self.inflight = inflight  # engine request ids in flight, for the SIGTERM grace abort
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

    def __len__(self) -> int:
        return self.num_choices

    async def _one(self, rid: str, prompt: list[int], params: SamplingParams,
                   continued: list[int]) -> AsyncIterator[RequestOutput]:
        self.inflight.add(rid)
        last: float | None = None
        finished = False
        try:
            gen = self.engine.generate(rid, prompt, params, kv_transfer_params=self.kv_transfer_params,
                                       **({"continued": continued} if continued else {}),
                                       **({"lora_name": self.lora_name} if self.lora_name else {}))
            async with aclosing(gen):
                async for out in gen:
                    now = time.monotonic()
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
            self.inflight.discard(rid)
            if not finished:
                self.engine.abort(rid)
                self._record(RequestOutput(rid, [], finished=True, finish_reason="abort"))

    def _record(self, out: RequestOutput) -> None:
        self.metrics.finished(out.finish_reason or "abort", out.num_prompt_tokens, out.num_output_tokens,
                              time.monotonic() - self.arrival)

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """All outputs of all engine requests, tagged with their choice index."""
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
