"""Continuous batching with a per-step token budget.

Each step: running requests first (decodes before unfinished prefill chunks), then waiting
requests in arrival order, until the token budget or the sequence limit is spent. Prompts
longer than the remaining budget are prefilled in chunks across steps. When a running
request needs a block and none is free, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
(its full blocks usually come straight back from the prefix cache).

With policy "priority" (vLLM's `--scheduling-policy priority`) the waiting queue is kept in
(priority, arrival) order instead, lower priority values first, a preempted request going back
to its place in that order; and the victim of a preemption is the least urgent running request
(highest priority value, latest arrival). The head of the queue still blocks those behind it
when it cannot be admitted: a more urgent request is never overtaken by a less urgent one.

The scheduler is the only owner of requests and blocks. P/D transfer plugs in through the
KV connector's scheduler-side hooks (vLLM v1's shape): at admission the connector may claim
prompt tokens that a prefill worker holds; the request then gets all its blocks and waits in
WAITING_FOR_REMOTE_KVS while the worker-side half pulls into them, and rejoins the front of
the queue when the pull lands (or fails: the rest is prefilled here). When a request
finishes, the connector may keep its blocks for a remote decode worker's read; they are
freed when the worker side reports the read released (or expired).

States (each change goes through `Request.set_status`):

    WAITING ──admit──▶ RUNNING ──stop/length──▶ FINISHED_*
       │  ▲              │
       │  └──preempt─────┘
       └──remote KV──▶ WAITING_FOR_REMOTE_KVS ──pull landed or failed──▶ WAITING (front)
    any ──abort──▶ FINISHED_ABORTED (blocks mid-pull are freed when the pull reports)

A request admitted with host-tier hits (--kv-offloading-size) gets its blocks and the copies back
ordered, then waits out this step at the front of the queue, holding its blocks: the copies run
beside this step's forward instead of before it, and the request runs from the next schedule on
(whose step waits for them on the device). Its restored blocks are published then.

Async scheduling (engine.py): step n+1 is scheduled before step n's tokens reach the host.
`advance()` applies a launched step's computed counts at once and counts each sampled token as
in flight (`Request.num_in_flight`), so the next `schedule()` plans a decode of that token;
`update(..., advanced=True)` later appends the real tokens and checks stops. A request whose
in-flight token ends it by length is not scheduled again; one that turns out to have stopped
was scheduled one step too many, and that step's token is dropped. A request preempted with a
token in flight is not readmitted until the token has arrived (its recompute needs it).
"""

from __future__ import annotations

import time
from collections import deque

from pdserve.worker.engine.block_manager import BlockManager
from pdserve.worker.executor.scheduled_batch import ScheduledBatch
from pdserve.worker.kv.connector_meta import KVConnectorOutput
from pdserve.worker.kv.connector_scheduler import KVConnectorScheduler
from pdserve.worker.request.request import Request, RequestStatus


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, connector: KVConnectorScheduler | None = None, policy: str = "fcfs",
                 max_loras: int = 0):
        """`connector`: the KV connector's scheduler half; by default one without an endpoint (no
        transport: nothing pinned or pulled, a remote prefill's params prefilled here).
        `max_loras`: LoRA adapters' GPU slots (0: no adapters served): requests holding blocks
        never run more distinct adapters than that, so every step's adapters fit the slots."""
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.connector = connector or KVConnectorScheduler(block_manager.block_size, 0, max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_remote_kvs: dict[str, Request] = {}  # own blocks a pull is filling
        self.sending: dict[str, Request] = {}  # finished; blocks kept for a remote decode worker's read
        self.num_preemptions = 0
        self.max_loras = max_loras
        # LoRA: the adapters of the running and of the waiting requests at the last schedule(),
        # each name once (vllm:lora_requests_info; read from the metrics thread, replaced whole).
        self.lora_adapters: tuple[list[str], list[str]] = ([], [])
        self.by_priority = policy == "priority"
        # Host tier: requests admitted with restores, their blocks not yet published
        # (publish_restored when they run), and those held out of the last schedule's step.
        self.restoring: set[str] = set()
        self.held_for_restore: list[Request] = []
        if block_manager.host_tier is not None:  # about one step's blocks stored ahead of eviction
            block_manager.store_ahead_blocks = block_manager.blocks_needed(max_num_batched_tokens)

    def _enqueue(self, req: Request, preempted: bool = False) -> None:
        """Into the waiting queue: FCFS at the back (a preempted request at the front); by
        priority at its place in (priority, arrival) order."""
        if not self.by_priority:
            (self.waiting.appendleft if preempted else self.waiting.append)(req)
            return
        key = _urgency(req)
        for i, other in enumerate(self.waiting):
            if key < _urgency(other):
                self.waiting.insert(i, req)
                return
        self.waiting.append(req)

    def add(self, req: Request) -> bool:
        """Queue a new request. False: it finished on arrival (a handed-over first token ended it)."""
        self.connector.new_request(req)
        if req.num_output_tokens and req.check_stop(self.max_model_len):
            self._free(req)
            return False
        req.set_status(RequestStatus.WAITING)
        self._enqueue(req)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_remote_kvs)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_remote_kvs)

    @property
    def num_sending_blocks(self) -> int:
        null = getattr(self.bm, "null_block", None)  # a hybrid cache's: not a held block
        return sum(len(r.block_ids) + sum(1 for b in r.sliding_block_ids if b != null) for r in self.sending.values())

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        if self.bm.windowed:  # sliding layers' blocks behind every window: free before anyone allocates
            for req in self.running:
                self.bm.release_outside_window(req)
        # Decodes first, so long prompts arriving never stall streams already producing tokens.
        order = sorted(self.running, key=lambda r: r.num_scheduled_tokens - r.num_computed_tokens > 1)
        bs, windowed, chunk_cap = self.bm.block_size, self.bm.windowed, self.connector.chunk_cap  # per request
        for req in order:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if req.num_in_flight and self._ends_by_length(req):
                continue  # its token in flight is its last: nothing more to compute
            computed = req.num_computed_tokens
            n = chunk_cap(req, min(req.num_scheduled_tokens - computed, budget), computed)
            if windowed:  # a shorter chunk before any preemption
                n = self.bm.fit_chunk(req, computed, n) or n
            elif len(req.block_ids) * bs >= computed + n:
                # Within the blocks it owns (most decode steps): what can_allocate / allocate
                # would find, without the calls.
                if n:
                    scheduled.append((req, n))
                    budget -= n
                continue
            while not self.bm.can_allocate(req, computed + n):
                victim = self._pick_victim(exclude=scheduled)
                if victim is None or victim is req:
                    n = 0
                    if victim is req:
                        self._preempt(req)
                    break
                self._preempt(victim)
            if n == 0:
                continue
            self.bm.allocate(req, computed + n)
            scheduled.append((req, n))
            budget -= n

        held: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_in_flight:
                break  # preempted while its last token was in flight: recomputed once it arrived
            if not self.connector.can_admit(req):
                break  # its blocks would be pinned past the cap: wait for remote readers to release
            if req.lora_name is not None and not self._lora_fits(req.lora_name):
                break  # FCFS: its adapter waits for a GPU slot (a running adapter's requests to end)
            fresh = not req.block_ids  # else its KV arrived from a prefill worker (all, or the cached part)
            # Prompt logprobs need every prompt position's logits: no cached blocks for those.
            cached = self.bm.lookup_prefix(req) if fresh and req.params.prompt_logprobs is None else []
            # The host tier's hits after the device's: new device blocks, copied back before this
            # step's forward, then counted as computed like the device hits.
            restored = self.bm.lookup_host(req, cached) if fresh and req.params.prompt_logprobs is None else []
            start = (len(cached) + len(restored)) * self.bm.block_size if fresh else req.num_computed_tokens
            num_remote, load_async = 0, False
            if fresh:
                num_remote, load_async = self.connector.get_num_new_matched_tokens(req, start)
            n = min(req.num_tokens - start, budget)
            whole = load_async
            n = self.connector.chunk_cap(req, n, start)
            whole = whole or self.connector.allocates_prompt(req)
            # A pull writes every prompt block at once, so a request waiting for one gets them all
            # now; so does a streamed prefill (its blocks are pinned at admission).
            if self.bm.windowed and not whole:
                n = self.bm.fit_chunk(req, start, n, cached) or n
            need = req.num_tokens if whole else start + n
            # A pull into a hybrid cache writes the sliding group's window only: no blocks before it.
            skip = self.bm.groups.first_needed_block(req.num_prompt_tokens, self.bm.block_size) \
                if load_async and self.bm.windowed else 0
            if not self.bm.can_allocate(req, need, cached, skip):
                break  # FCFS: don't let later requests overtake the head of the queue
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # count the prompt once, not on every recompute
                req.num_cached_tokens = start
                self.bm.record_query(req.num_prompt_tokens, start - len(restored) * self.bm.block_size)
                if self.bm.host_tier is not None:
                    device = len(cached) * self.bm.block_size
                    self.bm.record_host_query(req.num_prompt_tokens - device, start - device)
            if fresh:
                self.bm.take_cached(req, cached)
            self.bm.allocate(req, need, skip)
            if restored:
                self.bm.restore(req, len(cached), restored)
                self.restoring.add(req.request_id)
            if fresh:
                self.connector.update_state_after_alloc(req, num_remote)
            if load_async:
                req.set_status(RequestStatus.WAITING_FOR_REMOTE_KVS)
                self.waiting_for_remote_kvs[req.request_id] = req
                continue
            if restored:  # runs once its copies landed: from the next step on (module docstring)
                held.append(req)
                continue
            if req.request_id in self.restoring:  # its restored blocks are read from this step on
                self.restoring.discard(req.request_id)
                self.bm.publish_restored(req)
            req.set_status(RequestStatus.RUNNING)
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(held))  # they hold their blocks: first next time
        self.held_for_restore = held
        scheduled.sort(key=lambda item: item[1] > 1)
        self._note_lora_adapters()
        meta = self.connector.build_connector_meta()
        # The host tier's copies, before this batch's forward; where a pull or a pin made here
        # must not wait for that forward (or there is none: pulls alone), the engine carries
        # them out before it applies the connector's orders (LLMEngine._copy_tiers_first).
        return ScheduledBatch(scheduled, meta, self.bm.take_tier_ops())

    def _lora_fits(self, name: str) -> bool:
        """Admitting a request of adapter `name` keeps the distinct adapters within the slots."""
        active = {r.lora_name for r in self.running if r.lora_name}
        active |= {r.lora_name for r in self.waiting_for_remote_kvs.values() if r.lora_name}
        return name in active or len(active) < self.max_loras

    def _pick_victim(self, exclude) -> Request | None:
        taken = {id(r) for r, _ in exclude}
        if self.by_priority:
            candidates = [r for r in self.running if id(r) not in taken and self.connector.preemptible(r)]
            return max(candidates, key=_urgency, default=None)
        for req in reversed(self.running):
            if id(req) not in taken and self.connector.preemptible(req):
                return req
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free_request(req)
        req.set_status(RequestStatus.WAITING)
        self._enqueue(req, preempted=True)
        self.num_preemptions += 1

    def _ends_by_length(self, req: Request) -> bool:
        """Its tokens in flight reach max_tokens or the context limit (the last one ends it)."""
        return (req.next_output_index >= req.params.max_tokens
                or req.num_scheduled_tokens >= self.max_model_len)

    def advance(self, batch: ScheduledBatch, samples: set[str]) -> list[int]:
        """Async scheduling, at launch: the step's tokens count as computed and each request in
        `samples` has one more token in flight. Returns each item's computed count after the
        step, for `update(..., advanced=...)`."""
        after = []
        for req, n in batch.items:
            req.num_computed_tokens += n
            after.append(req.num_computed_tokens)
            if req.request_id in samples:
                req.num_in_flight += 1
        return after

    def update(self, batch: ScheduledBatch, sampled: dict[str, int],
               advanced: list[int] | None = None) -> list[Request]:
        """Advance computed counts, append sampled tokens; return requests that finished.
        `advanced`: the step went through `advance()` at launch (these are its computed counts);
        a request that finished since then drops its token here."""
        finished, stopped_waiting = [], []
        register, max_len, waiting = self.bm.register_computed, self.max_model_len, RequestStatus.WAITING  # per item
        for i, (req, n) in enumerate(batch.items):
            token = sampled.get(req.request_id)
            if advanced is None:
                req.num_computed_tokens += n
                register(req)
            else:
                if token is not None:
                    req.num_in_flight -= 1
                if req.status.finished:  # stopped by an earlier step's token, or aborted: drop this one
                    continue
                # Blocks known to hold this step's tokens; a later step in flight has not made its own known.
                register(req, advanced[i])
            if token is None:  # a prefill chunk that did not reach the end of the sequence
                continue
            if req.failure is None:  # a request whose sampling failed ends without its token (check_stop)
                req.token_ids.append(token)
            if req.status is waiting:  # preempted while in flight: recomputed with it
                if req.check_stop(max_len):  # unless it ends the request
                    self.waiting.remove(req)
                    self._free(req)
                    stopped_waiting.append(req)
                continue
            if req.check_stop(max_len):
                finished.append(req)
        # Streamed prefills: this step's blocks are readable (its own computed counts: under
        # async scheduling a later step in flight has advanced the requests already).
        self.connector.after_step(batch.items, advanced)
        for req in finished:
            self.running.remove(req)
            self._free(req)
        self._note_lora_adapters()
        return finished + stopped_waiting

    def _note_lora_adapters(self) -> None:
        if self.max_loras:
            self.lora_adapters = (list(dict.fromkeys(r.lora_name for r in self.running if r.lora_name)),
                                  list(dict.fromkeys(r.lora_name for r in self.waiting if r.lora_name)))

    def update_from_kv_xfer(self, out: KVConnectorOutput) -> list[Request]:
        """Apply what the connector's worker side reports: reads released, pulls landed or failed.
        Returns the streamed hand-offs that got their first token now (finished ones included:
        the caller reports them), and those that never will (finished, aborted)."""
        self.connector.pins_freed(out.finished_sending)
        for rid in out.finished_sending:
            req = self.sending.pop(rid, None)
            if req is not None:
                self.bm.free_request(req)
        arrived, reported = [], []
        for rid, ok in [(r, True) for r in out.finished_recving] + [(r, False) for r in out.failed_recving]:
            req = self.waiting_for_remote_kvs.pop(rid, None)
            if req is None:
                continue
            if req.status.finished:  # aborted while the pull was writing its blocks
                self.bm.free_request(req)
                continue
            if self.connector.awaits_first_token(req):
                token = out.first_tokens.get(rid)
                if token is None and not ok and rid not in out.stopped_recving:
                    # The pull failed before the prefill's first token came (a timeout, a lost
                    # peer), but the prefill may still finish and the router then streams that
                    # token. Prefill here: the first token sampled equals it (same model, same
                    # seed) and is handed over when sampled, not emitted twice.
                    self.connector.first_token_arrived(req)
                    req.num_emitted_tokens = 1
                    req.hands_over_first = True
                else:
                    reported.append(req)
                    if not self._take_first_token(req, token):
                        continue
            if ok:  # the prompt, or a prefix a peer held (the rest is prefilled here)
                req.num_computed_tokens = self.connector.pulled_tokens(req)
                req.kv_landed_time = time.monotonic()
                if self.bm.windowed:
                    # The pull brought the sliding group's window only: its blocks before it were
                    # never written and must not be published (register_computed) or read. Null.
                    self.bm.release_outside_window(req)
            else:  # only its prefix-cache hits are computed; the rest is prefilled here
                self.connector.load_failed(req)
                if self.bm.windowed:
                    # Its sliding table has null entries the pull was not to write (allocate's
                    # sliding_from), which a local prefill would: start afresh (its hits come back).
                    self.bm.free_request(req)
            req.set_status(RequestStatus.WAITING)
            arrived.append(req)
        self.waiting.extendleft(reversed(arrived))  # they hold their blocks: run them first
        return reported

    def _take_first_token(self, req: Request, token: int | None) -> bool:
        """A streamed hand-off's first token, sampled by the prefill worker, arrived with its
        pull: appended as an output the caller already has. False: the request ended here (the
        prefill never finished for us, or that token ends it)."""
        self.connector.first_token_arrived(req)
        if token is None:
            req.set_status(RequestStatus.FINISHED_ABORTED)
            self._free(req)
            return False
        req.token_ids.append(token)
        req.num_emitted_tokens = 1
        if req.check_stop(self.max_model_len):
            self._free(req)
            return False
        return True

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End `req` early (abort): out of the queues, its blocks freed or handed to the connector."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.restoring.discard(req.request_id)  # its restored blocks go back unpublished
        req.set_status(status)
        if req.request_id not in self.waiting_for_remote_kvs:  # else freed when its pull reports
            self._free(req)
        else:
            self.connector.cancel_load(req)  # a streamed pull stops between chunks

    def _free(self, req: Request) -> None:
        keep, params = self.connector.request_finished(req)
        req.kv_transfer_params_out = params
        if keep:
            if self.bm.windowed:  # the pin lists the sliding group's window only: the rest goes now
                self.bm.release_outside_window(req)
            self.sending[req.request_id] = req
        else:
            self.bm.free_request(req)


def _urgency(req: Request) -> tuple[int, float]:
    """Sort key of the priority policy: the smaller, the sooner."""
    return req.params.priority, req.arrival_time
