"""The scheduler-side half of P/D KV transfer: which requests pin, pull, wait and free blocks.

The worker-side half (`connector.KVConnector`) moves bytes; this half owns request state and
runs on the engine's step thread only, so block accounting keeps a single writer.

Prefill side: a request with `do_remote_decode` runs one token, then its prompt blocks move
from the request to the connector's pin table (freed on release or TTL, in `step()`).
Decode side: a request carrying a prefill worker's params gets blocks (prefix-cache hits
taken, not pulled), its pull runs on the connector's threads, and it joins the running set
when the pull lands, or with only its cache hits computed if the pull failed, so the rest is
prefilled locally. The handed-over first token is an already-emitted output either way.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace

from pdserve.worker.block_manager import BlockManager
from pdserve.worker.config import EngineConfig
from pdserve.worker.request import Request, RequestError
from pdserve.worker.scheduler import Scheduler

log = logging.getLogger(__name__)

# Keys (and types) a decode worker needs in kv_transfer_params; anything else is refused up front.
REMOTE_KEYS = {"remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_request_id": str,
               "remote_block_ids": list, "num_prompt_tokens": int, "first_token_id": int,
               "transfer_token": str, "kv_layout": str}


def is_remote_decode(params: dict | None) -> bool:
    """Params handed to a decode worker by a prefill worker (not the router's request for one)."""
    return bool(params) and not params.get("do_remote_decode") and "first_token_id" in params


class KVTransferScheduler:
    def __init__(self, config: EngineConfig, engine_id: str, kv_layout: str, cache, block_manager: BlockManager,
                 scheduler: Scheduler, vocab_size: int, max_model_len: int):
        self.bm, self.scheduler = block_manager, scheduler
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.pin_ttl = config.kv_pin_ttl
        self.connector = None
        if config.role != "both" or config.kv_transfer is not None:  # a plain worker opens no port
            from pdserve.worker.kv.connector import KVConnector

            self.connector = KVConnector(config, cache, engine_id, kv_layout)
            if config.role in ("prefill", "both"):
                self.connector.start_server()
        self.waiting: list[Request] = []  # decode side: waiting for blocks to pull into
        self.pulling: dict[str, tuple[Request, Future]] = {}

    # -- admission (step thread) ----------------------------------------------------------------

    def check_params(self, p: dict, num_prompt_tokens: int) -> None:
        """Decode side: refuse malformed or incompatible params before anything is allocated."""
        for key, typ in REMOTE_KEYS.items():
            if not isinstance(p.get(key), typ) or isinstance(p.get(key), bool):
                raise RequestError("kv_transfer_params", f"kv_transfer_params.{key} is missing or not a {typ.__name__}")
        if not 0 <= p["first_token_id"] < self.vocab_size:
            raise RequestError("kv_transfer_params", "kv_transfer_params.first_token_id is out of the vocabulary")
        if p["num_prompt_tokens"] != num_prompt_tokens:
            raise RequestError("kv_transfer_params", f"kv_transfer_params describe {p['num_prompt_tokens']} prompt "
                                                     f"tokens but the prompt has {num_prompt_tokens}")
        remote_bs = p["kv_layout"].rsplit(":", 1)[-1]
        if remote_bs != str(self.bm.block_size):
            raise RequestError("kv_transfer_params", f"the prefill worker's KV block size is {remote_bs} but this "
                                                     f"worker's is {self.bm.block_size}; P and D must match")
        if self.connector is not None:
            from pdserve.worker.kv.connector import KVLayoutMismatch

            try:
                self.connector.check_params(p, self.bm.block_size)
            except KVLayoutMismatch as e:
                raise RequestError("kv_transfer_params", str(e)) from e

    def admit(self, req: Request) -> bool:
        """Set up `req`'s P/D role. True: it waits here for its KV (the scheduler must not run it)."""
        p = req.kv_transfer_params
        if not p:
            return False
        if p.get("do_remote_decode"):
            # Prefill side: one token, then the blocks wait for the decode worker. A worker with
            # no side channel serves the request plainly (no params come back).
            req.params = replace(req.params, max_tokens=1, min_tokens=0)
            req.keep_blocks = self.connector is not None and self.connector.server is not None
            return False
        if not is_remote_decode(p):
            return False
        req.token_ids.append(int(p["first_token_id"]))
        req.num_emitted_tokens = 1
        if req.check_stop(self.max_model_len):  # the first token already ended it
            self._release_remote(req)
            return False
        if self.connector is None:  # no transport here: prefill locally
            return False
        self.waiting.append(req)
        return True

    def abort(self, req: Request) -> bool:
        """Drop `req` from transfer state. False: its pull is in flight, blocks freed when it lands."""
        if req.request_id in self.pulling:
            req.aborted = True
            return False
        if req in self.waiting:
            self.waiting.remove(req)
            self._release_remote(req)
        return True

    # -- every step (step thread) -----------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.pulling)

    @property
    def has_pins(self) -> bool:
        return self.connector is not None and len(self.connector.pins) > 0

    @property
    def num_pinned_blocks(self) -> int:
        return self.connector.pins.num_blocks() if self.connector else 0

    def step(self) -> None:
        if self.connector is None:
            return
        self._free_released_pins()
        self._start_pulls()
        self._finish_pulls()

    def wait_for_pull(self, timeout: float) -> None:
        """Nothing to compute until a pull lands: block briefly rather than spin."""
        if self.pulling:
            wait([f for _, f in self.pulling.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def _free_released_pins(self) -> None:
        for rid, block_ids, expired in self.connector.pins.collect():
            if expired:
                log.warning("KV pin of %s expired after %.0fs without a release; freeing %d blocks",
                            rid, self.pin_ttl, len(block_ids))
            self.bm.unpin(block_ids)

    def _start_pulls(self) -> None:
        bs = self.bm.block_size
        while self.waiting:
            req = self.waiting[0]
            cached = self.bm.lookup_prefix(req)
            if not self.bm.can_allocate(req, req.num_tokens, cached):
                return  # FCFS; retried next step as blocks free up
            self.waiting.pop(0)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = len(cached) * bs
                self.bm.record_query(req.num_prompt_tokens, req.num_cached_tokens)
            self.bm.take_cached(req, cached)
            self.bm.allocate(req, req.num_tokens)
            n_prompt_blocks = -(-req.num_prompt_tokens // bs)
            # Prompt blocks already in our prefix cache are not pulled again.
            indices = list(range(len(cached), n_prompt_blocks))
            dst = req.block_ids[len(cached):n_prompt_blocks]
            self.pulling[req.request_id] = (req, self.connector.start_pull(req.kv_transfer_params, indices, dst))

    def _finish_pulls(self) -> None:
        for rid, (req, fut) in list(self.pulling.items()):
            if not fut.done():
                continue
            del self.pulling[rid]
            if req.aborted:
                self.bm.free_request(req)
                continue
            try:
                fut.result()
                req.num_computed_tokens = req.num_prompt_tokens
            except Exception as e:
                # The prompt's KV never arrived: prefill it here (slower, same answer) rather
                # than failing the request.
                log.warning("KV pull for %s failed (%s); prefilling locally", rid, e)
                self.connector.metrics.local_prefill_fallbacks.inc()
            self.scheduler.add_running(req)

    def _release_remote(self, req: Request) -> None:
        if self.connector is not None:  # an empty pull only releases the remote pin
            self.connector.start_pull(req.kv_transfer_params, [], [])

    # -- prefill side: finished requests ----------------------------------------------------------

    def pin(self, req: Request) -> dict:
        """Move a finished prefill's prompt blocks to the pin table; return kv_transfer_params."""
        # The scheduler left the request's block references in place (keep_blocks). Only prompt
        # blocks are offered: the first token's KV was never computed here.
        n_blocks = -(-req.num_prompt_tokens // self.bm.block_size)
        block_ids, extra = req.block_ids[:n_blocks], req.block_ids[n_blocks:]
        self.bm.unpin(extra)
        req.block_ids = []
        return self.connector.pin(req.request_id, block_ids, req.num_prompt_tokens, req.output_token_ids[0])

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
