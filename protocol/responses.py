"""Response bodies and stream chunks of the OpenAI endpoints, built by the worker and read (and,
for a P/D request, spliced) by the router.

Field order and nulls follow OpenAI's wire format: `logprobs` and `finish_reason` are always
present (null until known); `usage`, `kv_transfer_params` and an empty `delta`'s keys are left
out when there is nothing to say. Unknown fields are kept (`extra="allow"`), so whatever a
worker adds passes through the router unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def _is_none(value) -> bool:
    return value is None


def omitted(default=None):
    """A field left out of the JSON while it is None."""
    return Field(default, exclude_if=_is_none)


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")

    def sse(self) -> bytes:
        """One server-sent event carrying this object."""
        return b"data: " + self.model_dump_json().encode() + b"\n\n"


class Usage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: dict[str, Any] | None = omitted()  # reasoning_tokens (--reasoning-parser)
    prompt_tokens_details: dict[str, Any] | None = omitted()


class _Envelope(_Wire):
    """What every response and stream chunk carries around its choices, in OpenAI's key order;
    a subclass names its `object` and choice type (an override keeps the base's key position)."""

    id: str
    object: str
    created: int = 0
    model: str = ""
    choices: list
    usage: Usage | None = omitted()


# ---- /v1/completions ------------------------------------------------------------------------

class CompletionChoice(_Wire):
    """A choice of a response, and of a stream chunk (OpenAI uses one shape for both)."""

    index: int = 0
    text: str = ""
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token that ended it
    # vLLM's, when asked for (left out otherwise: this shape is every stream chunk's too).
    prompt_logprobs: list[dict[str, Any] | None] | None = omitted()


class CompletionResponse(_Envelope):
    object: str = "text_completion"
    choices: list[CompletionChoice]
    kv_transfer_params: dict[str, Any] | None = omitted()


class CompletionChunk(CompletionResponse):
    """Same shape as the response; a stream's last chunk (with include_usage) has no choices."""


# ---- /v1/chat/completions ---------------------------------------------------------------------

class AssistantMessage(_Wire):
    role: str = "assistant"
    content: str | None = ""
    # vLLM's field for a reasoning model's chain of thought (--reasoning-parser); absent otherwise.
    reasoning_content: str | None = omitted()


class ChatChoice(_Wire):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Envelope):
    object: str = "chat.completion"
    choices: list[ChatChoice]
    kv_transfer_params: dict[str, Any] | None = omitted()
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's (null unless asked for, as vLLM sends it)


class Delta(_Wire):
    """A chat stream's increment: `role` opens a choice, `content` continues it, `{}` ends it."""

    role: str | None = omitted()
    content: str | None = omitted()
    reasoning_content: str | None = omitted()


class ChatChunkChoice(_Wire):
    index: int = 0
    delta: Delta
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = omitted()


class ChatCompletionChunk(_Envelope):
    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


RESPONSES = {"chat": ChatCompletionResponse, "completions": CompletionResponse}
