"""One client request, from its bytes to what the router sends workers: parsed, mapped, validated,
bounded, and re-serialised at most once (issue 44).

    raw bytes ─▶ shape counted (protocol/body.py) ─▶ json.loads ─▶ Responses: items bounded,
             mapped onto chat ─▶ client kv_transfer_params dropped ─▶ the worker's own model
             validates it ─▶ request limits (protocol/request_limits.py) ─▶ the request, as that
             model, goes on through the router; raw = its fields the client set (`exclude_unset`)
             as JSON, what workers are sent: the client's own bytes when they are exactly that
             (no unknown field, nothing dropped or changed), else serialised once

So a worker is sent what was validated, never a client's unknown fields (a field of 2.6 M empty
lists is not carried on to every hop), with every field it understands as the client gave it
(exclude_unset keeps explicit nulls, and leaves defaults to the worker). All of it is CPU in
proportion to the body: a large one's `intake` runs on a thread (router/offload.py), so the
event loop, /health and every other request go on meanwhile.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from pdserve.protocol.body import parse_object, validate
from pdserve.protocol.errors import APIError
from pdserve.protocol.continuation import PARAM as CONTINUATION
from pdserve.protocol.kv_transfer import PARAM as KV_TRANSFER_PARAMS
from pdserve.protocol.request_limits import RequestLimits
from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest, GenerationRequest
from pdserve.protocol.responses_api import as_chat
from pdserve.router.prompt import count_prompt_tokens

_ABSENT = object()


class Intake(NamedTuple):  # (a tuple: made per request, ~0.5 µs cheaper than a frozen dataclass)
    route: str  # "chat" or "completions" (a Responses request is a chat one from here on)
    request: GenerationRequest  # validated, its model set: every worker call is built from it
    raw: bytes  # its fields the client set, as JSON: sent as-is to a worker that serves the request whole
    fields: dict | None  # those fields as a dict (`raw` before serialising: read-only, shared); None: not made,
    # as they are the client's own (`raw` is its bytes)
    responses: dict | None  # a Responses request's fields its answer repeats (responses_api.echoed)
    estimated_tokens: int  # its prompt tokens as router/prompt.py estimates them (no tokenizer)

    @property
    def model(self) -> str:
        return self.request.model


def intake(raw: bytes, route: str, limits: RequestLimits) -> Intake:
    """The request a client sent to `route` ("chat", "completions", "responses"), or a 400 saying
    what is wrong with it, before any worker is called."""
    obj = parse_object(raw, limits.body_values)
    responses = None
    if route == "responses":  # mapped onto chat here, so it takes the chat path, P/D included
        (obj, responses), route = as_chat(obj, limits), "chat"
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required and must be a string", param="model")
    # Only the router may steer KV transfer: a client's params are dropped; nor continue a stream
    # (router/migration.py).
    dropped = obj.pop(KV_TRANSFER_PARAMS, _ABSENT) is not _ABSENT
    dropped = obj.pop(CONTINUATION, _ABSENT) is not _ABSENT or dropped
    # The worker's own models: what it would refuse as malformed is refused here, before any
    # worker is called (its semantic checks, such as context length, stay with it).
    req = validate(ChatCompletionRequest if route == "chat" else CompletionRequest, obj)
    limits.check(req)
    # What was validated is what the client sent, field for field: its bytes are that JSON already
    # (UTF-8, an object from its first byte to its last, as the splices of router/call.py and
    # migration need), so they are not serialised again.
    fields = None if _dumps_as_given(req, obj) else req.model_dump(exclude_unset=True)
    as_sent = (responses is None and not dropped and (fields is None or fields == obj)
               and raw[:1] == b"{" and raw[-1:] == b"}")
    if not as_sent and fields is None:  # serialised after all: the dump is kept for what reads it
        fields = req.model_dump(exclude_unset=True)
    body = raw if as_sent else json.dumps(fields).encode()
    return Intake(route, req, body, fields, responses, count_prompt_tokens(req, None))


def _validated_fields(model) -> frozenset[str]:
    return frozenset(f for d in model.__pydantic_decorators__.field_validators.values() for f in d.info.fields)


_SCALARS = frozenset((str, int, float, bool, type(None)))
_SCALARS_OR_LIST = _SCALARS | {list}
# Fields whose own validator may return another value than it was given.
_REVALUED = {model: _validated_fields(model) for model in (ChatCompletionRequest, CompletionRequest)}


def _dumps_as_given(req: GenerationRequest, obj: dict) -> bool:
    """Whether `req.model_dump(exclude_unset=True) == obj`, known without the dump (~3 µs): every
    key of `obj` a field that `req` kept, and every value a JSON scalar or a list of scalars
    (strict validation keeps those equal), none of a field with a validator of its own. A nested
    object (messages, tools, response_format) leaves it to the dump: a model there drops keys."""
    if obj.keys() != req.model_fields_set or not _REVALUED[type(req)].isdisjoint(obj):
        return False
    kinds = set(map(type, obj.values()))
    if kinds <= _SCALARS:
        return True
    if not kinds <= _SCALARS_OR_LIST:
        return False
    return all(set(map(type, value)) <= _SCALARS for value in obj.values() if type(value) is list)
