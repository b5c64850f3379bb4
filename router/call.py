"""One client request on its way through the router, and a prefill's KV waiting for its decode
worker: what the orchestrator and the hand-offs (router/handoff/) pass between them."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.protocol.continuation import HEADER_TOKEN_IDS
from pdserve.protocol.contract import HEADER_REQUEST_ID
from pdserve.protocol.kv_transfer import PARAM as KV_TRANSFER_PARAMS
from pdserve.protocol.requests import CompletionRequest, GenerationRequest
from pdserve.router.policies import RoutingRequest
from pdserve.router.upstream import Upstream
from pdserve.router.workers import Worker


_PARAMS_KEY = f',"{KV_TRANSFER_PARAMS}":'.encode()


@dataclass
class Call:
    """One client request on its way through."""

    route: str  # "chat" or "completions"
    request: GenerationRequest  # as validated (router/intake.py), its model set
    raw: bytes  # its fields the client set, as a JSON object (forwarded as-is to a worker serving it whole)
    request_id: str
    routing: RoutingRequest
    started: float
    prompt_tokens: int = 0  # counted with the arrival (exact with --tokenizer, else estimated)
    disaggregated: bool = False
    moved: bool = False  # served whole by the other role after its own pool took nothing (fallback.py)
    accepted: bool = False  # a worker took it (its first 2xx): counted as an arrival
    tracks_tokens: bool = False  # workers report its token ids in the stream: it may migrate (migration.py)
    span: object = None  # its trace span (protocol/tracing.py), None with tracing off
    # `request.model_dump(exclude_unset=True)` (what `raw` serialises) with the request it was
    # made from, as intake made it: see fields().
    made_fields: tuple[GenerationRequest, dict] | None = None
    responses_body: dict | None = None  # a Responses API request's fields its answer echoes (responses_api.py)

    @property
    def model(self) -> str:
        return self.request.model

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def include_usage(self) -> bool:
        options = self.request.stream_options
        return bool(options and options.include_usage)

    @property
    def single_sequence(self) -> bool:
        """Whether the request generates exactly one sequence, the only shape a hand-off
        describes: one prompt's KV and one first token. A list of prompts or n > 1 (best_of) is
        served whole by one worker instead; so are `echo` (both legs would echo the prompt) and
        `prompt_logprobs` (they come from the prefill pass, which is the whole of the work)."""
        r = self.request
        if r.n != 1 or r.prompt_logprobs is not None:
            return False
        if not isinstance(r, CompletionRequest):
            return True
        if (r.best_of or 1) != 1 or r.echo:
            return False
        # A prompt list is one prompt only as token ids, or a list of one prompt. (Validated, a
        # list is of one form, so its first element tells which.)
        return isinstance(r.prompt, str) or len(r.prompt) == 1 or bool(r.prompt) and isinstance(r.prompt[0], int)

    def fields(self) -> dict:
        """The request's fields the client set, as a dict (read-only: shared), made once per
        request (intake made them already) and again only if `request` is replaced."""
        made = self.made_fields
        if made is None or made[0] is not self.request:
            made = self.made_fields = (self.request, self.request.model_dump(exclude_unset=True))
        return made[1]

    def headers(self) -> dict[str, str]:
        if self.tracks_tokens:
            return {"content-type": "application/json", HEADER_REQUEST_ID: self.request_id, HEADER_TOKEN_IDS: "1"}
        return {"content-type": "application/json", HEADER_REQUEST_ID: self.request_id}

    def decode_payload(self, kv_transfer_params: dict) -> bytes:
        """The client's request (as validated: `raw`, which carries no kv_transfer_params) with
        the prefill's params added: spliced into its JSON, not the body serialised again."""
        return self.raw[:-1] + _PARAMS_KEY + json.dumps(kv_transfer_params).encode() + b"}"


@dataclass
class PinnedKV:
    """A prefill's KV waiting for its decode worker. Once a decode worker may hold the params
    (`sent`), that worker reads or releases the pin; until then, giving up is the router's to
    report, or the blocks stay pinned until the TTL."""

    worker: Worker  # the prefill worker
    params: dict
    sent: bool = False

    def abandon(self, upstream: Upstream) -> None:
        """The router gives up on the hand-off: a pin no decode worker was sent is released."""
        if not self.sent:
            upstream.release_kv(self.worker, self.params)
            self.sent = True
