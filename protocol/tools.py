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

from pydantic import BaseModel, ConfigDict, Field

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
