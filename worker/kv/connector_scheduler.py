"""KVConnectorScheduler: the scheduler-side half of P/D KV transfer, along vLLM v1's lines.

The scheduler owns every request and every block; this half only answers its questions and
records, as orders in `KVConnectorMetadata`, what the worker-side half (`connector.KVConnector`)
must do: pulls and releases on the decode side, pins and their progress on the prefill side. It
never calls the worker half: it knows this worker's transfer side as plain facts (`KVEndpoint`),
mints a pin's transfer token itself and writes the params that describe it. It does no I/O and
runs on the engine's step thread.

  new_request(req)                   on arrival: a prefill for a remote decode runs one token; a
                                     decode handed a prefill worker's params starts from its first token
  can_admit(req)                     at admission: a prefill for a remote decode waits while pins are at the cap
  get_num_new_matched_tokens(req, n) at admission: prompt tokens to pull beyond the n cached here, and
                                     whether the request waits for them (WAITING_FOR_REMOTE_KVS)
  update_state_after_alloc(req, n)   its blocks are allocated: record the pull (or a bare release)
  build_connector_meta()             the orders so far (the engine takes them after schedule()
                                     and after the step's results, before any output leaves)
  pins_freed(rids)                   the worker half reported those pins gone (read, released, expired)
  load_failed(req)                   a pull failed: counted; the scheduler prefills the rest locally
  request_finished(req)              keep the blocks for a remote reader? and the params saying where
                                     (only for a prefill that stopped at its length: see there)

Streamed hand-off (`stream_kv`, docs/architecture.md). Prefill side: the request's whole prompt
gets its blocks at admission and they are pinned at once (`announced`: the engine sends those
params out before the first chunk runs); `chunk_cap` cuts its steps (--kv-stream-split);
`after_step` makes each step's computed blocks readable; `request_finished` records the first
token (or cancels the pin). Decode side: the request waits for its pull even when every block
is cached here, since the first token comes with the pull's end (`first_token_arrived`).

A hybrid KV cache (a model with sliding-window layers, docs/kv-cache.md) hands off every prompt
block of the full group and only the sliding group's blocks from the window of the decode side's
first query on (`_handoff`): one list, full blocks first, so the transports move "block i of a
list" as for a plain cache. Streamed, the full blocks become readable as chunks complete and the
sliding tail when the prompt is done (`_ready`); no step's blocks are offered layer by layer
(`computing`): a one-group block's slices are its group's layers, not the model's the layer clock
counts.

A decode request that never pulls (it finished on its handed-over token, was aborted while
queued, or its whole prompt was in our prefix cache) still releases the prefill worker's pin,
so that worker frees its blocks now rather than at TTL.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import replace

from pdserve.protocol.kv_transfer import (PARAM, PREFILL_MAX_TOKENS, STREAM_UNSUPPORTED, KVTransferParams,
                                          KVTransferParamsError, is_remote_decode, is_streamed, prefix_source,
                                          wants_remote_decode, wants_stream_kv)
from pdserve.worker.kv import registry
from pdserve.worker.kv.connector_meta import KVConnectorMetadata, KVLoad, KVPin
from pdserve.worker.kv.endpoint import KVEndpoint
from pdserve.worker.kv.peer_policy import PeerNotAllowed
from pdserve.worker.kv.prompt_binding import bind_token, prompt_digest, token_digest
from pdserve.worker.request.request import Request, RequestError, RequestStatus

log = logging.getLogger(__name__)

# At most this share of the KV cache is held for remote decode workers at once.
MAX_PINNED_FRACTION = 0.5


class KVConnectorScheduler:
    def __init__(self, block_size: int, vocab_size: int, max_model_len: int, endpoint: KVEndpoint | None = None,
                 stream_chunk_tokens: int = 0, stream_split: str = "tail", step_budget: int = 0):
        """`endpoint`: this worker's transfer side (`KVConnector.endpoint()`), or None where no
        transport runs (then remote decodes prefill locally and prefills for a remote decode are
        served plainly). `step_budget`: tokens a step may compute (a prefill with at most this
        many left, and no streamed split, ends in its next step)."""
        self.block_size, self.vocab_size, self.max_model_len = block_size, vocab_size, max_model_len
        self._endpoint = endpoint
        self._can_send = endpoint is not None and endpoint.serves
        self._hybrid = endpoint is not None and endpoint.layout.hybrid  # hand-offs list the sliding tail
        self._pinned: dict[str, int] = {}  # prefill side: pins ordered and not reported gone -> their blocks
        self._num_pinned = 0
        self.stream_chunk_tokens, self.stream_split = stream_chunk_tokens, stream_split
        self.step_budget = step_budget
        self._unpulled: set[str] = set()  # remote decodes whose prefill worker still pins their prompt
        self._streaming: set[str] = set()  # prefill side: streamed hand-offs not finished yet
        self.announced: list[Request] = []  # prefill side: pinned at admission; their params go out now
        self._awaiting_first: set[str] = set()  # decode side: streamed hand-offs whose first token is to come
        self._meta = KVConnectorMetadata()
        self._next_log = 0.0  # rate limit of the empty-allowlist error
        # Whole requests handed a peer's pin of a prefix (PrefixPull): request -> (the pin's params,
        # the prompt tokens its whole blocks cover here), until admission decides pull or recompute;
        # then, for a pull, until it lands or fails.
        self._prefixes: dict[str, tuple[KVTransferParams, int]] = {}
        self._prefix_pulls: dict[str, tuple[KVTransferParams, int]] = {}

    # -- arrival --------------------------------------------------------------------------------

    def check_params(self, kv: KVTransferParams, prompt_token_ids: list[int]) -> None:
        """Decode side: refuse malformed, incompatible or foreign params before anything is
        allocated. Shape and internal consistency were checked by the one parse (protocol/kv_transfer.py);
        what needs this worker and this prompt is checked here, each thing once."""
        try:
            kv.check_compatible(len(prompt_token_ids), self.block_size, self.vocab_size)
        except KVTransferParamsError as e:
            raise RequestError(PARAM, str(e)) from None
        ep = self._endpoint
        if kv.stream_kv and (ep is None or ep.policy.empty):
            # Its first token comes with the pull: a worker that pulls from no one cannot serve it.
            raise RequestError(PARAM, f"{PARAM} of a streamed hand-off need a decode worker that pulls KV "
                                      f"(--kv-transfer and --kv-peer-allow naming the prefill worker)",
                               STREAM_UNSUPPORTED)
        if ep is None:
            return  # prefilled locally: the remote layout does not matter
        if kv.kv_layout != ep.layout and kv.stream_kv:
            # A streamed hand-off's first token comes with the pull, which cannot happen: the
            # router then hands over the final params instead, which prefill locally (below).
            raise RequestError(PARAM, f"{PARAM} of a streamed hand-off describe KV layout {str(kv.kv_layout)!r} but "
                                      f"this worker's is {str(ep.layout)!r}: it cannot read that KV",
                               STREAM_UNSUPPORTED)
        # Another layout (dtype, fp8 scales, shape, block size) is a deployment mismatch, never
        # the client's fault: new_request prefills such a request here instead of pulling.
        # The pin's own check (on pull) is what holds against forgery; this one answers 400 early.
        if token_digest(kv.transfer_token) != prompt_digest(prompt_token_ids):
            raise RequestError(PARAM, f"{PARAM} were issued for a different prompt")
        if ep.policy.empty:
            return  # a worker that pulls from no one prefills locally (new_request); never the client's fault
        try:
            ep.allowed_peer(kv)
        except (PeerNotAllowed, ValueError) as e:
            raise RequestError(PARAM, str(e)) from None

    def check_prefix(self, src: KVTransferParams, prompt_token_ids: list[int]) -> None:
        """A whole request handed a peer's prefix pin: the pin must be of a prefix of this prompt
        (its transfer token is bound to that prefix's digest; the peer checks it again on every
        read). Anything else about it (this worker's layout, its allowlist, a block size of
        another deployment) only makes this worker recompute the prefix (new_request)."""
        n = src.num_prompt_tokens
        if n > len(prompt_token_ids) or token_digest(src.transfer_token) != prompt_digest(prompt_token_ids[:n]):
            raise RequestError(PARAM, f"{PARAM}.prefix_from was issued for a prompt that is not a prefix of this one")

    def _take_prefix(self, req: Request, src: KVTransferParams) -> None:
        """A request handed a peer's prefix pin: keep it for admission, or release it now where
        this worker cannot or must not read it (then the prefix is recomputed here)."""
        ep, bs = self._endpoint, self.block_size
        if ep is None:
            return  # no transport here: nothing to pull with, nor to release with (the pin expires)
        # Whole blocks, and never the prompt's last token: a request computes at least one token here.
        tokens = min(src.num_prompt_tokens, req.num_prompt_tokens - 1) // bs * bs
        try:
            ep.allowed_peer(src)
        except (PeerNotAllowed, ValueError) as e:
            log.warning("prefix pin of %s names a peer this worker may not contact (%s): recomputing",
                        req.request_id, e)
            return
        usable = (tokens > 0 and not ep.policy.empty and src.kv_layout == ep.layout and not self._hybrid
                  and src.lora_name == req.lora_name and req.params.prompt_logprobs is None)
        if usable:
            self._prefixes[req.request_id] = (src, tokens)
        else:
            self._meta.releases.append(src)

    def new_request(self, req: Request) -> None:
        p = req.kv_transfer_params
        if not p:
            return
        if (source := prefix_source(p)) is not None:  # a whole request's, or a prefill's
            self._take_prefix(req, source)
        if wants_remote_decode(p):
            # Prefill side: one token, then (if we can serve reads) the blocks wait for the decode worker.
            # min_tokens cut as the router's prefill_request cuts it: EOS stays barred from the
            # first token when the client asked for at least one.
            req.params = replace(req.params, max_tokens=PREFILL_MAX_TOKENS,
                                 min_tokens=min(req.params.min_tokens, PREFILL_MAX_TOKENS))
            if wants_stream_kv(p) and self._can_send:
                self._streaming.add(req.request_id)
        elif is_streamed(p):  # decode side, announced early: check_params saw a transport and peers
            self._awaiting_first.add(req.request_id)
            self._unpulled.add(req.request_id)
        elif is_remote_decode(p):
            # Decode side: the prefill worker's first token is an output the caller already has.
            req.token_ids.append(p.first_token_id)
            req.num_emitted_tokens = 1
            if self._endpoint is None:
                return
            if p.kv_layout != self._endpoint.layout:
                # Bytes of another layout would decode as garbage: refuse the hand-off, prefill
                # here (same answer, slower) and let the prefill worker free its pin now.
                self._endpoint.metrics.local_prefill_fallbacks.inc()
                self._meta.releases.append(p)
                now = time.monotonic()
                if now >= self._next_log:
                    self._next_log = now + 60.0
                    log.error("KV hand-off refused: the prefill worker's KV layout is %r, this worker's %r (layers x "
                              "kv heads x head dim : dtype[@fp8 scales] : block size[:w<window>/<sliding layers>]; "
                              "--kv-cache-dtype, --block-size and --disable-hybrid-kv-cache-manager must match "
                              "between prefill and decode): prefilling locally",
                              str(p.kv_layout), str(self._endpoint.layout))
                return
            if self._endpoint.policy.empty:  # a `both` worker started without peers (it logged an error)
                self._endpoint.metrics.local_prefill_fallbacks.inc()
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
        if req.request_id in self._prefixes or req.request_id in self._prefix_pulls:
            return self._prefix_matched(req, num_computed_tokens)
        if req.request_id not in self._unpulled:
            return 0, False
        n = max(0, req.num_prompt_tokens - num_computed_tokens)
        return n, n > 0 or req.request_id in self._awaiting_first  # the first token comes with the pull

    def _prefix_matched(self, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """A peer's prefix pin at admission: pull the blocks it has beyond our own hits if the
        pull is estimated cheaper than computing them (prefix_cost.py), else release it. Decided
        once: a request that waits for blocks comes back here with its choice made."""
        rid = req.request_id
        decided = rid in self._prefix_pulls
        src, tokens = self._prefix_pulls[rid] if decided else self._prefixes.pop(rid)
        n = tokens - num_computed_tokens
        pull = n > 0 and (decided or self._endpoint.metrics.prefix_cost.choose_pull(
            n, n // self.block_size * self._endpoint.block_bytes))
        if not pull:
            self._prefix_pulls.pop(rid, None)
            self._meta.releases.append(src)
            return 0, False
        self._prefix_pulls[rid] = (src, tokens)
        return n, True

    def pulled_tokens(self, req: Request) -> int:
        """The prompt tokens a landed pull of `req` computed: a prefix pull's prefix, else the prompt."""
        entry = self._prefix_pulls.pop(req.request_id, None)
        if entry is None:
            return req.num_prompt_tokens
        self._endpoint.metrics.prefix_cost.pulled_tokens.labels("landed").inc(entry[1] - req.num_cached_tokens)
        return entry[1]

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step computed `num_tokens` prompt tokens in `seconds`: the recompute side of the estimate."""
        if self._endpoint is not None:
            self._endpoint.metrics.prefix_cost.observe_prefill(num_tokens, seconds)

    def allocates_prompt(self, req: Request) -> bool:
        """Prefill side: a streamed hand-off's prompt gets every block at admission (pinned then)."""
        return req.request_id in self._streaming

    def chunk_cap(self, req: Request, n: int, computed: int) -> int:
        """Tokens of `req` to compute this step from `computed` on (`n` fit the budget). A streamed prefill is cut so
        the decode worker reads chunk k while chunk k+1 is computed. "tail": the last
        `stream_chunk_tokens` of the prompt run alone, so when the prefill ends only their bytes
        are left to move, at the cost of one step (on H200, cutting a 3000-token prompt into six
        512-token steps cost 35 ms of TTFT: every chunk re-reads the context through the paged
        attention path). "even": every chunk that long, for links slower than the prefill.
        "taper": chunks that halve towards the tail (taper_chunk), for links about as fast as
        the prefill computes KV."""
        c = self.stream_chunk_tokens
        if not c or req.request_id not in self._streaming:
            return n
        return stream_chunk(self.stream_split, n, req.num_prompt_tokens - computed, c)

    def preemptible(self, req: Request) -> bool:
        """A streamed prefill is never preempted: its pinned blocks may be under a reader. It
        holds every block it needs from admission, so it never waits for one either."""
        return req.request_id not in self._streaming

    def streams(self, items) -> bool:
        """Whether this step computed a chunk of a streamed prefill (the engine waits for the
        device before the chunk is made readable)."""
        return bool(self._streaming) and any(r.request_id in self._streaming for r, _ in items)

    def after_step(self, items, computed: list[int] | None = None) -> None:
        """Prefill side, after a step's KV is on the device: its full blocks are readable.
        `computed`: each item's computed count after that step (async scheduling, where the
        request's own count already includes a later step, still in flight); None: the request's."""
        if not self._streaming:
            return
        for i, (req, _) in enumerate(items):
            if req.request_id in self._streaming and not req.status.finished:
                n = req.num_computed_tokens if computed is None else computed[i]
                self._meta.advances.append((req.request_id, self._ready(req, n)))
                if self._last_step_next(req, n):
                    self._meta.last_steps.append(req.request_id)

    def computing(self, items) -> list[tuple[str, int]]:
        """Prefill side, before a step is launched: (request, leading blocks computed once it ends)
        of each streamed prefill it computes a chunk of. Their layers are readable as the step
        writes them (pins.PinTable.computing); the step's collection makes them whole (after_step)."""
        out = []
        if self._hybrid:  # the layer clock counts model layers; a block's slices are one group's
            return out
        for req, n in items:
            if req.request_id in self._streaming and not req.status.finished:
                done = req.num_computed_tokens + n
                last = done >= req.num_prompt_tokens  # the prompt's last block is whole: no more of it is computed
                out.append((req.request_id, -(-req.num_prompt_tokens // self.block_size) if last
                            else done // self.block_size))
        return out

    def _ready(self, req: Request, computed: int) -> int:
        """Leading blocks of `req`'s hand-off list (`_handoff`) readable once `computed` tokens
        are: the full prompt blocks so far; a hybrid list's sliding tail only once the prompt is."""
        if self._hybrid and computed >= req.num_prompt_tokens:
            return self._endpoint.layout.handoff_blocks(req.num_prompt_tokens)
        return computed // self.block_size

    def _last_step_next(self, req: Request, computed: int) -> bool:
        """Whether the step after the one that computed up to `computed` ends the prompt (chunk_cap;
        without a split, the step budget: other requests' tokens may still push it a step later)."""
        return 0 < req.num_prompt_tokens - computed <= (self.stream_chunk_tokens or self.step_budget)

    def awaits_first_token(self, req: Request) -> bool:
        return req.request_id in self._awaiting_first

    def first_token_arrived(self, req: Request) -> None:
        self._awaiting_first.discard(req.request_id)

    def cancel_load(self, req: Request) -> None:
        """Decode side: `req` was aborted while its pull runs: stop the pull between chunks."""
        self._awaiting_first.discard(req.request_id)
        self._meta.cancels.append(req.request_id)

    def can_admit(self, req: Request) -> bool:
        """Prefill side: hold back a prefill for a remote decode while pinned blocks are at the
        cap. Pins live until released or expired; unbounded, a flood of prefill-only requests
        would hold the whole cache. Waiting (not refusing) keeps the router's contract: a
        prefill answer always carries params. With nothing pinned, anything is admitted."""
        p = req.kv_transfer_params
        if not (wants_remote_decode(p) and self._can_send):
            return True
        need = self._endpoint.layout.handoff_blocks(req.num_prompt_tokens)
        return self._num_pinned == 0 or self._num_pinned + need <= self._endpoint.num_blocks * MAX_PINNED_FRACTION

    def update_state_after_alloc(self, req: Request, num_external_tokens: int) -> None:
        if req.request_id in self._prefix_pulls:
            src, tokens = self._prefix_pulls[req.request_id]
            bs = self.block_size
            first, last = (tokens - num_external_tokens) // bs, tokens // bs
            self._meta.loads.append(KVLoad(req.request_id, src, list(range(first, last)), req.block_ids[first:last],
                                           prompt_digest(req.token_ids[:src.num_prompt_tokens])))
            if req.request_id not in self._streaming:
                return
            # A streamed prefill's pin goes out now too; its readable blocks are the local hits
            # (num_computed_tokens) until the pull lands and the steps after it advance the pin.
        if req.request_id in self._streaming:
            self._announce(req)
            return
        if req.request_id not in self._unpulled:
            return
        self._unpulled.discard(req.request_id)
        if num_external_tokens == 0 and req.request_id not in self._awaiting_first:  # every block was cached here
            self._meta.releases.append(req.kv_transfer_params)
            return
        bs = self.block_size
        first = (req.num_prompt_tokens - num_external_tokens) // bs  # cached tokens are whole blocks
        last = -(-req.num_prompt_tokens // bs)
        indices, dst = list(range(first, last)), req.block_ids[first:last]
        if self._hybrid:  # the sliding tail: remote list position last + (j - start) holds sliding block j
            start = self._endpoint.layout.sliding_start(req.num_prompt_tokens)
            tail = range(max(first, start), last)
            indices += [last + j - start for j in tail]
            dst += [req.sliding_block_ids[j] for j in tail]
        self._meta.loads.append(KVLoad(req.request_id, req.kv_transfer_params, indices, dst,
                                       prompt_digest(req.token_ids[:req.num_prompt_tokens])))

    def _announce(self, req: Request) -> None:
        """Prefill side, at admission: pin every prompt block now (the prefix-cache hits are
        readable already) and hand the params out before the first chunk is computed."""
        req.kv_transfer_params_out = self._pin(req, ready=req.num_computed_tokens // self.block_size)
        if self._last_step_next(req, req.num_computed_tokens):  # the prompt runs in one step
            self._meta.last_steps.append(req.request_id)
        self.announced.append(req)

    def _pin(self, req: Request, ready: int | None = None, first_token_id: int | None = None) -> KVTransferParams:
        """Order a pin of `req`'s prompt blocks and return the params that describe it. Only
        prompt blocks are offered: the first token's KV is never computed on the prefill side."""
        blocks = self._handoff(req)
        digest = prompt_digest(req.token_ids[:req.num_prompt_tokens])
        token = bind_token(secrets.token_urlsafe(24), digest)
        self._meta.pins.append(KVPin(req.request_id, list(blocks), token, digest, ready))
        self._pinned[req.request_id] = len(blocks)
        self._num_pinned += len(blocks)
        return self._endpoint.params(req.request_id, blocks, req.num_prompt_tokens, token, first_token_id,
                                     stream_kv=ready is not None, lora_name=req.lora_name,
                                     lora_path=req.lora_path)

    def _handoff(self, req: Request) -> list[int]:
        """The blocks a hand-off of `req`'s prompt lists: every prompt block (the full group's, for
        a hybrid cache), then a hybrid cache's sliding blocks that the decode side's first query
        reads (KVLayout.handoff_blocks). Those before it are not moved: no later query reads them."""
        n_blocks = -(-req.num_prompt_tokens // self.block_size)
        blocks = req.block_ids[:n_blocks]
        if self._hybrid:
            blocks = blocks + req.sliding_block_ids[self._endpoint.layout.sliding_start(req.num_prompt_tokens):n_blocks]
        return blocks

    def pins_freed(self, request_ids: list[str]) -> None:
        """The worker half reported these pins gone (released by their reader, cancelled, or expired)."""
        for rid in request_ids:
            self._num_pinned -= self._pinned.pop(rid, 0)

    def unpin(self, request_id: str, token: str) -> None:
        """This worker itself knows no decode worker will read a pin it handed out (the answer's
        first token hit a stop string, which only the detokenizer sees): release it now."""
        self._meta.unpins.append((request_id, token))

    def build_connector_meta(self) -> KVConnectorMetadata:
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def load_failed(self, req: Request) -> None:
        # The prompt's KV never arrived: prefill it here (slower, same answer) rather than fail.
        log.warning("KV pull for %s failed; prefilling locally", req.request_id)
        if (entry := self._prefix_pulls.pop(req.request_id, None)) is not None:
            self._endpoint.metrics.prefix_cost.pulled_tokens.labels("failed").inc(entry[1] - req.num_cached_tokens)
        self._endpoint.metrics.local_prefill_fallbacks.inc()

    # -- finish -----------------------------------------------------------------------------------

    def request_finished(self, req: Request) -> tuple[bool, KVTransferParams | None]:
        """(keep the blocks until the worker half reports this request finished sending, params)."""
        self._awaiting_first.discard(req.request_id)
        if (entry := self._prefixes.pop(req.request_id, None)) is not None:
            self._meta.releases.append(entry[0])  # ended before admission decided: nobody reads the pin
        self._prefix_pulls.pop(req.request_id, None)  # a pull under way releases the pin when it ends
        if req.request_id in self._streaming:
            return self._streamed_finished(req)
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
        return True, self._pin(req, first_token_id=req.output_token_ids[0])

    def _streamed_finished(self, req: Request) -> tuple[bool, KVTransferParams | None]:
        self._streaming.discard(req.request_id)
        early = req.kv_transfer_params_out
        if early is None:  # ended before admission: nothing was pinned
            return False, None
        if req.request_id not in self._pinned:
            # The decode side released the pin and it is gone (its request was aborted): nobody
            # reads these blocks, and no report of the pin is to come: free them now.
            return False, None
        if req.status is RequestStatus.FINISHED_LENGTH:
            # Every block readable, the TTL starts. The final params are a plain hand-off's, good
            # for a decode worker that pulls after the prefill (the router's fallback).
            self._meta.finishes.append((req.request_id, req.output_token_ids[0]))
            return True, replace(early, first_token_id=req.output_token_ids[0],
                                 expires_at=time.time() + self._endpoint.pin_ttl, stream_kv=False)
        # Aborted, or the first token ended the request: readers are told, and the blocks wait
        # for no lease to hold them before they are freed (get_finished reports it).
        self._meta.cancelled_pins.append(req.request_id)
        return True, None


def resolve_split(split: str, transport: str | None) -> str:
    """--kv-stream-split auto: what the transport named says suits it (KVTransport.stream_split:
    taper over TCP, tail over NIXL); tail without one (e.g. a bench's aggregated stack)."""
    if split != "auto":
        return split
    return registry.transport_class(transport).stream_split if transport in registry.names() else "tail"


def stream_chunk(split: str, n: int, left: int, tail: int) -> int:
    """Tokens of a streamed prefill's next step, `n` fitting the step budget and `left` of the
    prompt still to compute (chunk_cap's cut; the benches model the same cut with it)."""
    if split == "even":
        return min(n, tail)
    if split == "taper":
        return min(n, taper_chunk(left, tail))
    return min(n, left - tail) if left > tail else min(n, left)


def taper_chunk(left: int, tail: int) -> int:
    """The next chunk of a prompt with `left` tokens to compute, cut so the chunks halve towards
    the tail: ..., 4·tail, 2·tail, tail, with the first chunk taking the rest and never smaller
    than the one after it (3000 tokens, tail 512: 1464, 1024, 512), but under two tails, where
    the head is what the tail leaves, as "tail" cuts it (513: 1, 512). Each chunk's bytes then move
    while the next, half as large, is computed: on a link about as fast as the prefill makes KV
    (TCP) that hides most of the transfer, in log2(prompt / tail) extra steps, where "tail" leaves
    the whole head's bytes for the last step and "even" costs a step per tail-sized chunk.
    Stateless: the same answer for whatever is left, so a step the budget cut short is fine."""
    if left <= tail:
        return left
    k = 1  # the last k chunks: tail * (2**k - 1) tokens; grow while the head stays the largest
    while left - tail * (2 ** (k + 1) - 1) >= tail * 2 ** k:
        k += 1
    return left - tail * (2 ** k - 1)
