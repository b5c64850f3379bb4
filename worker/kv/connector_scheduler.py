"""KVConnectorScheduler: the scheduler-side half of P/D KV transfer, along vLLM v1's lines.

The scheduler owns every request and every block; this half only answers its questions and
records what the worker-side half (`connector.KVConnector`) must do this step. It does no I/O
and runs on the engine's step thread.

  new_request(req)                   on arrival: a prefill for a remote decode runs one token; a
                                     decode handed a prefill worker's params starts from its first token
  can_admit(req)                     at admission: a prefill for a remote decode waits while pins are at the cap
  get_num_new_matched_tokens(req, n) at admission: prompt tokens to pull beyond the n cached here, and
                                     whether the request waits for them (WAITING_FOR_REMOTE_KVS)
  update_state_after_alloc(req, n)   its blocks are allocated: record the pull (or a bare release)
  build_connector_meta()             at the end of schedule(): this step's pulls and releases
  load_failed(req)                   a pull failed: counted; the scheduler prefills the rest locally
  request_finished(req)              keep the blocks for a remote reader? and the params saying where
                                     (only for a prefill that stopped at its length: see there)

A decode request that never pulls (it finished on its handed-over token, was aborted while
queued, or its whole prompt was in our prefix cache) still releases the prefill worker's pin,
so that worker frees its blocks now rather than at TTL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pdserve.protocol.kv_transfer import (PARAM, PREFILL_MAX_TOKENS, KVTransferParams, KVTransferParamsError,
                                          is_remote_decode, wants_remote_decode)
from pdserve.worker.kv.connector_meta import KVConnectorMetadata, KVLoad
from pdserve.worker.kv.peer_policy import PeerNotAllowed
from pdserve.worker.kv.prompt_binding import prompt_digest, token_digest
from pdserve.worker.request import Request, RequestError, RequestStatus

log = logging.getLogger(__name__)

# At most this share of the KV cache is held for remote decode workers at once.
MAX_PINNED_FRACTION = 0.5


class KVConnectorScheduler:
    def __init__(self, block_size: int, vocab_size: int, max_model_len: int, transfer=None):
        """`transfer`: this worker's `KVConnector`, or None where no transport runs (then remote
        decodes prefill locally and prefills for a remote decode are served plainly)."""
        self.block_size, self.vocab_size, self.max_model_len = block_size, vocab_size, max_model_len
        self._transfer = transfer
        self._can_send = transfer is not None and transfer.server is not None
        self._unpulled: set[str] = set()  # remote decodes whose prefill worker still pins their prompt
        self._meta = KVConnectorMetadata()
        self._next_log = 0.0  # rate limit of the empty-allowlist error

    # -- arrival --------------------------------------------------------------------------------

    def check_params(self, p: dict, prompt_token_ids: list[int]) -> None:
        """Decode side: refuse malformed, incompatible or foreign params before anything is
        allocated. Shape and internal consistency are KVTransferParams' (protocol/kv_transfer.py);
        what needs this worker and this prompt is checked here, each thing once."""
        try:
            kv = KVTransferParams.from_dict(p)
            kv.check_compatible(len(prompt_token_ids), self.block_size, self.vocab_size)
        except KVTransferParamsError as e:
            raise RequestError(PARAM, str(e)) from None
        if self._transfer is None:
            return  # prefilled locally: the remote layout does not matter
        if kv.kv_layout != self._transfer.layout:
            raise RequestError(PARAM, f"{PARAM} describe KV layout {kv.kv_layout!r} but this worker's is "
                                      f"{self._transfer.layout!r} (layers x kv heads x head dim : dtype : block "
                                      f"size must match between prefill and decode)")
        # The pin's own check (on pull) is what holds against forgery; this one answers 400 early.
        if token_digest(kv.transfer_token) != prompt_digest(prompt_token_ids):
            raise RequestError(PARAM, f"{PARAM} were issued for a different prompt")
        if self._transfer.policy.empty:
            return  # a worker that pulls from no one prefills locally (new_request); never the client's fault
        try:
            self._transfer.allowed_peer(p)
        except (PeerNotAllowed, ValueError) as e:
            raise RequestError(PARAM, str(e)) from None

    def new_request(self, req: Request) -> None:
        p = req.kv_transfer_params
        if not p:
            return
        if wants_remote_decode(p):
            # Prefill side: one token, then (if we can serve reads) the blocks wait for the decode worker.
            # min_tokens cut as the router's prefill_request cuts it: EOS stays barred from the
            # first token when the client asked for at least one.
            req.params = replace(req.params, max_tokens=PREFILL_MAX_TOKENS,
                                 min_tokens=min(req.params.min_tokens, PREFILL_MAX_TOKENS))
        elif is_remote_decode(p):
            # Decode side: the prefill worker's first token is an output the caller already has.
            req.token_ids.append(int(p["first_token_id"]))
            req.num_emitted_tokens = 1
            if self._transfer is None:
                return
            if self._transfer.policy.empty:  # a `both` worker started without peers (it logged an error)
                self._transfer.metrics.local_prefill_fallbacks.inc()
                now = time.monotonic()
                if now >= self._next_log:
                    self._next_log = now + 60.0
                    log.error("a P/D request came with kv_transfer_params but --kv-peer-allow is empty: prefilling "
                              "it here (a deployment mistake: name the prefill workers in --kv-peer-allow)")
                return
            self._unpulled.add(req.request_id)

    # -- admission --------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(prompt tokens to pull beyond the `num_computed_tokens` cached here, whether to wait for them)."""
        if req.request_id not in self._unpulled:
            return 0, False
        n = max(0, req.num_prompt_tokens - num_computed_tokens)
        return n, n > 0

    def can_admit(self, req: Request) -> bool:
        """Prefill side: hold back a prefill for a remote decode while pinned blocks are at the
        cap. Pins live until released or expired; unbounded, a flood of prefill-only requests
        would hold the whole cache. Waiting (not refusing) keeps the router's contract: a
        prefill answer always carries params. With nothing pinned, anything is admitted."""
        p = req.kv_transfer_params
        if not (wants_remote_decode(p) and self._can_send):
            return True
        pinned = self._transfer.pins.num_blocks()
        need = -(-req.num_prompt_tokens // self.block_size)
        return pinned == 0 or pinned + need <= self._transfer.num_blocks * MAX_PINNED_FRACTION

    def update_state_after_alloc(self, req: Request, num_external_tokens: int) -> None:
        if req.request_id not in self._unpulled:
            return
        self._unpulled.discard(req.request_id)
        if num_external_tokens == 0:  # every prompt block was a prefix-cache hit here
            self._meta.releases.append(req.kv_transfer_params)
            return
        bs = self.block_size
        first = (req.num_prompt_tokens - num_external_tokens) // bs  # cached tokens are whole blocks
        last = -(-req.num_prompt_tokens // bs)
        self._meta.loads.append(KVLoad(req.request_id, req.kv_transfer_params, list(range(first, last)),
                                       req.block_ids[first:last], prompt_digest(req.token_ids[:req.num_prompt_tokens])))

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def load_failed(self, req: Request) -> None:
        # The prompt's KV never arrived: prefill it here (slower, same answer) rather than fail.
        log.warning("KV pull for %s failed; prefilling locally", req.request_id)
        self._transfer.metrics.local_prefill_fallbacks.inc()

    # -- finish -----------------------------------------------------------------------------------

    def request_finished(self, req: Request) -> tuple[bool, dict | None]:
        """(keep the blocks until the worker half reports this request finished sending, params)."""
        if req.request_id in self._unpulled:
            self._unpulled.discard(req.request_id)
            self._meta.releases.append(req.kv_transfer_params)
            return False, None
        p = req.kv_transfer_params
        # Only a prefill cut at its one token goes on to a decode worker. One whose first token
        # ended the generation (EOS, a stop token id) is answered by this worker alone, and
        # the router calls no decode worker: a pin would hold blocks nobody reads until TTL.
        if not (wants_remote_decode(p) and self._can_send) or req.status is not RequestStatus.FINISHED_LENGTH:
            return False, None
        # Only prompt blocks are offered: the first token's KV was never computed here.
        n_blocks = -(-req.num_prompt_tokens // self.block_size)
        params = self._transfer.pin(req.request_id, req.block_ids[:n_blocks], req.num_prompt_tokens,
                                    req.output_token_ids[0], prompt_digest(req.token_ids[:req.num_prompt_tokens]))
        return True, params
