"""Continuous batching with a per-step token budget.

Each step: running requests first (decodes before unfinished prefill chunks), then waiting
requests in arrival order, until the token budget or the sequence limit is spent. Prompts
longer than the remaining budget are prefilled in chunks across steps. When a running
request needs a block and none is free, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
(its full blocks usually come straight back from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pdserve.worker.block_manager import BlockManager
from pdserve.worker.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    # (request, number of new tokens to compute this step), decode-like (1 token) ones first.
    items: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    def __bool__(self) -> bool:
        return bool(self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        req.set_status(RequestStatus.WAITING)
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """Admit a request that already owns its blocks (its KV arrived from a prefill worker)."""
        req.set_status(RequestStatus.RUNNING)
        self.running.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        # Decodes first, so long prompts arriving never stall streams already producing tokens.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        for req in order:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.bm.can_allocate(req, req.num_computed_tokens + n):
                victim = self._pick_victim(exclude=scheduled)
                if victim is None or victim is req:
                    n = 0
                    if victim is req:
                        self._preempt(req)
                    break
                self._preempt(victim)
            if n == 0:
                continue
            self.bm.allocate(req, req.num_computed_tokens + n)
            scheduled.append((req, n))
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.bm.lookup_prefix(req) if req.num_computed_tokens == 0 else []
            start = len(cached) * self.bm.block_size
            n = min(req.num_tokens - start, budget)
            if not self.bm.can_allocate(req, start + n, cached):
                break  # FCFS: don't let later requests overtake the head of the queue
            self.waiting.popleft()
            if req.num_cached_tokens < 0:  # count the prompt once, not on every recompute
                req.num_cached_tokens = start
                self.bm.record_query(req.num_prompt_tokens, start)
            self.bm.take_cached(req, cached)
            self.bm.allocate(req, start + n)
            req.set_status(RequestStatus.RUNNING)
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n
        scheduled.sort(key=lambda item: item[1] > 1)
        return ScheduledBatch(scheduled)

    def _pick_victim(self, exclude) -> Request | None:
        taken = {id(r) for r, _ in exclude}
        for req in reversed(self.running):
            if id(req) not in taken:
                return req
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free_request(req)
        req.set_status(RequestStatus.WAITING)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch, sampled: dict[str, int]) -> list[Request]:
        """Advance computed counts, append sampled tokens; return requests that finished."""
        finished = []
        for req, n in batch.items:
            req.num_computed_tokens += n
            self.bm.register_computed(req)
            token = sampled.get(req.request_id)
            if token is None:  # a prefill chunk that did not reach the end of the sequence
                continue
            req.token_ids.append(token)
            if req.check_stop(self.max_model_len):
                finished.append(req)
        for req in finished:
            self.finish(req, req.status, free_blocks=not req.keep_blocks)
        return finished

    def finish(self, req: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """Remove `req` from the queues. free_blocks=False hands its blocks to the caller (KV pin)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if free_blocks:
            self.bm.free_request(req)
        req.set_status(status)
