"""A hand-off's adapter loaded on a decode worker that lacks it.

A prefill worker's kv_transfer_params name the adapter it ran and where it read it from
(`lora_name`, `lora_path`). A decode worker started with --enable-lora and
$VLLM_ALLOW_RUNTIME_LORA_UPDATING true (vLLM's switch for runtime loads, its LoRA resolvers
included) loads that adapter before it admits the request, as /v1/load_lora_adapter would, and
serves it from then on (vLLM's resolvers keep what they load too). Without the switch the
request is refused 404 model_not_found, and a router never sends it one: the worker's model card
says whether it loads adapters (`runtime_lora_loading`).

Bounded: one load at a time per worker (reading and checking an adapter is disk and CPU work on
a thread, off the event loop), and concurrent hand-offs naming the same adapter share one load.
A load that fails is the request's LoRAError (a 400 naming the adapter and the reason), never
the worker's: nothing was registered, the next hand-off tries again.
"""

from __future__ import annotations

import asyncio

from pdserve.worker.config.lora_modules import LoRAModule
from pdserve.worker.lora.adapter import LoRAError


class OnDemandLoads:
    def __init__(self, manager):
        self.manager = manager
        self._one_at_a_time = asyncio.Semaphore(1)
        self._pending: dict[str, asyncio.Future] = {}  # adapter name -> its load in progress
        self.num_loaded = 0  # adapters this worker loaded for hand-offs (tests, logs)

    async def ensure(self, name: str, path: str) -> None:
        """`name` is served when this returns (read from `path` unless it already was); LoRAError
        when it cannot be. A caller that leaves does not cancel a load others may wait on."""
        if self.manager.serves(name):
            return
        load = self._pending.get(name)
        if load is None:
            load = self._pending[name] = asyncio.ensure_future(self._load(name, path))
            load.add_done_callback(lambda f: self._done(name, f))
        await asyncio.shield(load)

    def _done(self, name: str, load: asyncio.Future) -> None:
        self._pending.pop(name, None)
        if not load.cancelled():
            load.exception()  # retrieved: every waiter may have left; each one that stayed gets it

    async def _load(self, name: str, path: str) -> None:
        async with self._one_at_a_time:
            if self.manager.serves(name):
                return
            try:
                await asyncio.to_thread(self.manager.add, LoRAModule(name, path))
            except LoRAError:
                if self.manager.serves(name):  # loaded meanwhile through /v1/load_lora_adapter
                    return
                raise
            self.num_loaded += 1
