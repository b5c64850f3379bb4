"""A request inside the engine, and the one place its state changes."""

from __future__ import annotations

import enum
import time

from pdserve.protocol.kv_transfer import KVTransferParams, parse_kv_transfer_params
from pdserve.worker.request.isolation import isolated
from pdserve.worker.request.sampling_params import SamplingParams


class RequestError(ValueError):
    """The request cannot be served as given (maps to HTTP 400); `param` names the field."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class RequestFailed(Exception):
    """The engine could not process this request (its own work in a step raised: request/isolation.py);
    the engine and every other request carry on. The server answers 500 `request_failed`."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)admission: new, preempted (to be recomputed), or its remote KV arrived
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # owns blocks that a pull from a prefill worker is filling
    RUNNING = "running"  # owns KV blocks and is scheduled every step
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its own processing failed (Request.failure says why); the engine lives on

    def __init__(self, value: str):
        # An attribute of each member, not a property: read for every request of every step.
        self.finished = value in ("stop", "length", "abort", "error")


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), kv_transfer_params=None, continued: list[int] = ()):
        """`continued`: output tokens another worker generated (a migrated stream,
        protocol/continuation.py): appended as outputs the caller already has, so everything
        keyed by the output (its count, penalties, min_tokens, the grammar, seeded positions)
        goes on from them; the prefill computes their KV with the prompt's."""
        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids: list[int] = [*prompt_token_ids, *continued]  # prompt + outputs
        self.num_computed_tokens = 0  # tokens whose KV is in the cache (or is being written by a step in flight)
        # Async scheduling: tokens sampled by steps still in flight, not yet read back to the host.
        # They come after `token_ids`; the next step reads the newest from the device (model_runner.py).
        self.num_in_flight = 0
        self.block_ids: list[int] = []
        # A model with sliding-window layers (attention/kv_groups.py): their block table, the same
        # length as block_ids, entries outside the window released (the null block's id) up to
        # `num_released_sliding`. Empty for every other model.
        self.sliding_block_ids: list[int] = []
        self.num_released_sliding = 0
        self.num_hashed_blocks = 0  # leading full blocks registered in the prefix cache
        # The LoRA adapter it runs (--enable-lora; None: the base model). It seeds the block hash
        # chain (block_manager.lora_hash_root): KV computed under one adapter is never another's.
        self.lora_name: str | None = None
        self.lora_path: str | None = None  # where this worker read it from: a hand-off names it
        self.block_hashes: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache at first admission
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        # Parsed once (the server does; a dict from a direct caller is parsed here): KVTransferParams on
        # a decode worker, RemoteDecodeRequest on a prefill worker, or None.
        self.kv_transfer_params = parse_kv_transfer_params(kv_transfer_params)
        # Set when it finishes as the prefill of a remote decode: where a decode worker pulls its KV.
        self.kv_transfer_params_out: KVTransferParams | None = None
        self.arrival_time = time.monotonic()
        # Latency stamps (time.monotonic()), each set once; the engine reports them with the first output.
        self.admitted_time: float | None = None  # first given its blocks: RUNNING or WAITING_FOR_REMOTE_KVS
        self.first_scheduled_time: float | None = None  # first RUNNING: vLLM's queue time ends here
        self.kv_landed_time: float | None = None  # the scheduler learnt that its remote KV pull landed
        self.waits_reported = False  # the engine reported them (with its first output with tokens, or final one)
        self.num_emitted_tokens = len(continued)  # outputs already reported to the caller
        # A streamed hand-off prefilled here after its pull failed: its first sampled token is the
        # prefill worker's (the caller has it), reported as handed over, not emitted (scheduler).
        self.hands_over_first = False
        # structured_output.GrammarMatcher when params.structured is set (the engine makes it).
        self.grammar = None
        # params.allowed_token_ids on the logits' device, made at its first step (logits_processors.py).
        self.allowed_token_index = None
        # Why this request's own work in a step raised (request/isolation.py): set once, on the
        # step thread; the scheduler then ends it as FINISHED_ERROR without that step's token.
        self.failure: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Known tokens plus those in flight: what the scheduler plans the next step from."""
        return len(self.token_ids) + self.num_in_flight

    @property
    def next_output_index(self) -> int:
        """Index in the output of the token the next sampling draws (seeded streams, min_tokens)."""
        return self.num_output_tokens + self.num_in_flight

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def set_status(self, status: RequestStatus) -> None:
        """The only place a request's state changes (the scheduler and `check_stop` call it), so
        the first admission and first scheduling are stamped here, whichever path admits it."""
        self.status = status
        if status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS) and self.admitted_time is None:
            self.admitted_time = time.monotonic()
        if status is RequestStatus.RUNNING and self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()

    def check_stop(self, max_model_len: int) -> bool:
        """After appending a token (none if the request failed): decide whether it is done."""
        if self.failure is not None:
            self.set_status(RequestStatus.FINISHED_ERROR)
            return True
        last = self.token_ids[-1]
        n = self.num_output_tokens
        if self.grammar is not None:
            # The grammar is complete (its EOS consumed), or a token outside it arrived: stop,
            # as vLLM does. Advancing here also consumes a handed-over first token (P/D).
            with isolated(self, "structured output"):
                self.grammar.advance(self.output_token_ids)
            if self.failure is not None:
                self.set_status(RequestStatus.FINISHED_ERROR)
                return True
            if self.grammar.terminated or self.grammar.failed:
                self.set_status(RequestStatus.FINISHED_STOPPED)
                return True
        if n >= self.params.min_tokens:
            if last in self.eos_token_ids:
                self.set_status(RequestStatus.FINISHED_STOPPED)
                return True
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                self.set_status(RequestStatus.FINISHED_STOPPED)
                return True
        if n >= self.params.max_tokens or self.num_tokens >= max_model_len:
            self.set_status(RequestStatus.FINISHED_LENGTH)
            return True
        return False
