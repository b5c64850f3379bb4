"""Tool calling on the wire: the `tools` a client offers, its `tool_choice`, and the
`tool_calls` an assistant answers with (whole, and as OpenAI's streamed increments).

The request side is validated here, by router and worker alike, so a malformed tool
definition is a 400 naming the field before any worker runs. The response side is what
`worker/server/tool_parsers/` produce from generated text.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from pdserve.protocol.errors import bad_request


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; passed to the template as given
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: the model must call that tool."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def check_tool_request(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    """Cross-field checks OpenAI makes: a choice needs tools, a named tool must exist."""
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", "tools")
    if choice is None or choice == "none":
        return
    if not tools:
        raise bad_request(f"tool_choice {_show(choice)} needs a non-empty 'tools'", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in 'tools'", "tool_choice")


def _show(choice: ToolChoice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.function.name)


# ---- past calls, in a request's history ------------------------------------------------------

def parse_arguments(arguments: Any) -> dict:
    """A past call's arguments as the object chat templates expect: OpenAI sends JSON text, some
    clients the object itself; none or "" is no arguments (vLLM's reading). Anything else is the
    client's error (ValueError saying why), never a crash in the template step: JSON text that
    does not parse, or that is not an object, or nests past the parser's recursion limit."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"the arguments are not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments must be a JSON object, got {type(arguments).__name__}")
    return arguments


class HistoryFunction(BaseModel):
    """The function of a call the assistant made earlier, as a client sends it back."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1)
    arguments: Any = Field(default_factory=dict)  # JSON text or an object; an object once validated

    @field_validator("arguments")
    @classmethod
    def _object(cls, value: Any) -> dict:
        try:
            return parse_arguments(value)
        except ValueError as e:
            # A custom error keeps the message whole, without pydantic's "Value error, " prefix.
            raise PydanticCustomError("tool_call_arguments", "{message}", {"message": str(e)}) from None


class HistoryToolCall(BaseModel):
    """One entry of a past assistant message's `tool_calls`. Validated with the request, by the
    router and the worker alike: a malformed entry (`[1]`, `"abc"`, no function, arguments that
    are not a JSON object) is a 400 naming it (`messages.2.tool_calls.0...`), not a worker error."""

    model_config = ConfigDict(extra="allow", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: HistoryFunction


# ---- responses ------------------------------------------------------------------------------

def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=new_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall

    @classmethod
    def of(cls, name: str, arguments: Any) -> "ToolCall":
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(function=FunctionCall(name=name, arguments=args))


def _is_none(value) -> bool:
    return value is None


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(None, exclude_if=_is_none)
    arguments: str | None = Field(None, exclude_if=_is_none)


class DeltaToolCall(BaseModel):
    """One streamed increment of one call: the first carries id, type and name (and maybe some
    arguments); the later ones carry only `index` and more `arguments` text."""

    index: int
    id: str | None = Field(None, exclude_if=_is_none)
    type: Literal["function"] | None = Field(None, exclude_if=_is_none)
    function: DeltaFunctionCall
