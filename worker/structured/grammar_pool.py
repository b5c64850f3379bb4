"""Grammar compiles off the event loop: a few threads, a bounded wait, one compile per spec.

A large JSON schema takes a grammar engine seconds to compile (measured: a 230 KB schema of
string patterns, 2 s in llguidance and minutes in xgrammar). Run on the worker's event loop,
three such requests stopped /health answering for 12 s and the router declared the worker lost.
Here a request whose grammar is not cached waits for one of `workers` threads (both engines
compile in Rust without the GIL, so the loop keeps running); at most `max_waiting` compiles may
queue behind them, and a request that would be one more gets 429 at once, in OpenAI's shape, with
Retry-After. Concurrent requests with the same spec share one compile; a cached spec builds its
matcher on the loop (a copy, microseconds). A waiter that gives up (client gone) leaves the
compile running: its result lands in the cache for the next request.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pdserve.protocol.errors import APIError
from pdserve.worker.request.sampling_params import StructuredOutputSpec
from pdserve.worker.structured.structured_output import GrammarMatcher, StructuredOutputs


class GrammarPool:
    def __init__(self, structured_outputs: StructuredOutputs, workers: int, max_waiting: int):
        self.structured_outputs = structured_outputs
        self.capacity = workers + max_waiting  # compiles running or queued
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._inflight: dict[tuple, asyncio.Future] = {}  # spec key -> its compile (loop thread only)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """The request's matcher; GrammarError (400) for a spec that does not compile, APIError 429
        when `capacity` compiles are already running or waiting."""
        so = self.structured_outputs
        if (hit := so.cached(spec)) is not None:
            return so.matcher(spec, hit)
        so.check_size(spec)  # too large: 400 before it takes a place in the queue
        compile_ = self._inflight.get(spec.key)
        if compile_ is None:
            if len(self._inflight) >= self.capacity:
                raise APIError(429, f"the worker is compiling {len(self._inflight)} other grammars; retry "
                                    f"shortly (cached {spec.param} specs do not wait)", spec.param,
                               "grammar_compile_busy", headers={"Retry-After": "1"})
            compile_ = asyncio.wrap_future(self._executor.submit(so.compile, spec))
            self._inflight[spec.key] = compile_
            compile_.add_done_callback(lambda f, key=spec.key: self._done(key, f))
        # shield: a cancelled waiter must not cancel the compile other requests share.
        return so.matcher(spec, await asyncio.shield(compile_))

    def _done(self, key: tuple, compile_: asyncio.Future) -> None:
        self._inflight.pop(key, None)
        if not compile_.cancelled():
            compile_.exception()  # retrieved: its waiters may all have left

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
