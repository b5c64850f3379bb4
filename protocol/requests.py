"""Request bodies of the OpenAI endpoints, as the router and the worker both read them.

The router validates a request with these models before anything is sent upstream; the
worker validates it again (it may be called directly) and refuses, with a 400 naming it, any
field it would otherwise silently ignore (`suffix`, `best_of` other than n: `check_unsupported`).
Structured outputs (`response_format`, vLLM's `guided_*` and `structured_outputs`) are read into
one (kind, value, param) triple by `structured_output()`; whether a schema or regex compiles
is the worker's grammar engine's call (worker/structured/structured_output.py). Unknown fields are ignored, as
OpenAI-compatible servers do, so newer
clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag, field_validator

from pdserve.protocol import chat_templates
from pdserve.protocol.continuation import Continuation
from pdserve.protocol.contract import COMPLETIONS_DEFAULT_MAX_TOKENS, MAX_LOGPROBS
from pdserve.protocol.errors import bad_request
from pdserve.protocol.kv_transfer import KVTransferField
from pdserve.protocol.structured import StructuredOutputFields
from pdserve.protocol.tools import HistoryToolCall, Tool, ToolChoice, check_tool_request

MAX_N = 128


def _prompt_form(value: Any) -> str:
    """Which form a prompt is in, from its first element: that form alone is validated (every
    element of it). A plain union would try each form on every element: on 4 M token ids, ten
    times the work and a validation error object per id for the forms that fail."""
    if isinstance(value, list) and value:
        first = value[0]
        return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"
    return "list[int]" if isinstance(value, list) else "str"


# A text, texts, token ids, or lists of token ids; the tags name the form in a 400's param, as
# pydantic's union members do (`prompt.list[int].3`). Validated, a list holds one form only.
Prompt = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("list[str]")],
                         Annotated[list[int], Tag("list[int]")], Annotated[list[list[int]], Tag("list[list[int]]")]],
                   Discriminator(_prompt_form)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class CommonRequest(StructuredOutputFields):
    """Fields both endpoints share. Strict, as OpenAI's API is: `"16"` is not an int nor `"yes"`
    a bool (an int is still a valid float)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False  # "yes" is a client bug, not true
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only these tokens
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's: each prompt token's logprob, rank and the top-N there (the first token's: null), in
    # the answer's `prompt_logprobs` (a completions choice's; a chat response's own). Not streamed.
    prompt_logprobs: int | None = None
    # vLLM's: lower is served sooner. Workers started with --scheduling-policy priority order
    # their queue by it; the router's flow control (router/flow_control/) maps it onto a band.
    priority: int = 0
    # P/D handshake (see kv_transfer.py): {"do_remote_decode": true} to a prefill worker (a
    # RemoteDecodeRequest once validated), the prefill's KVTransferParams to a decode worker.
    kv_transfer_params: KVTransferField = None
    # A stream continued from a lost worker's output (protocol/continuation.py); router only.
    continuation: Continuation | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        self.structured_output()  # the shape of response_format / guided_* (400 naming the field)
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
                                  "prompt_logprobs")
            if self.stream:
                raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")


class CompletionRequest(CommonRequest):
    prompt: Prompt
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids (the list itself, not a copy: validated, a
        prompt list is of one form, so its first element tells which)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ... reach the template as given

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # Typed, so a malformed one is a 400 here and never reaches the template step.
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[HistoryToolCall] | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        """`index`: this message's place in `messages`, for the `param` of a 400."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for i, part in enumerate(self.content):
                param = f"messages.{index}.content.{i}"
                if part.get("type") != "text":
                    raise bad_request(f"only text content parts are supported (got {part.get('type')!r})", param)
                if not isinstance(part.get("text"), str):
                    raise bad_request("a text content part needs 'text', a string", param)
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        elif self.content is None:
            msg["content"] = ""
        if msg["role"] == "developer":
            msg["role"] = "system"  # OpenAI's newer name; chat templates know "system"
        return msg


class ChatCompletionRequest(CommonRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: refused unless the worker trusts request templates
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" when tools are given (OpenAI's default)
    parallel_tool_calls: bool = True
    # OpenAI's reasoning models' knob; a template variable (gpt-oss's renders "Reasoning: high").
    # chat_template_kwargs.reasoning_effort, vLLM's other way to send it, wins when both are given.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    @property
    def template_variables(self) -> dict[str, Any] | None:
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @field_validator("chat_template_kwargs", "chat_template")
    @classmethod
    def _bounded(cls, value: Any, info) -> Any:
        return chat_templates.validated(value, info.field_name)

    def check_unsupported(self) -> None:
        super().check_unsupported()
        check_tool_request(self.tools, self.tool_choice)
        spec = self.structured_output()
        if spec is not None and self.tools and self.tool_choice not in (None, "auto", "none"):
            # A forced tool call is its own output format: two formats cannot both hold.
            raise bad_request(f"{spec[2]} cannot be combined with a forced tool call (tool_choice)", spec[2])
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# A generation request of either endpoint, as validated (a Responses request is a chat one by then).
GenerationRequest = ChatCompletionRequest | CompletionRequest
