"""What every tool-call parser provides, and the streaming state machine they share.

A parser turns generated text into content and tool calls. It does so incrementally
(`ToolCallStream.feed` per decoded piece, `finish` at the end), and the non-streamed answer is
the same machine run over the whole text, so a streamed and a non-streamed request can never
disagree. Text that might be the start of a call marker is held back until it is clear
whether it is one; a call is emitted once it is complete (its arguments arrive in one
increment, not token by token).

A parser also knows how its model family writes calls, so the worker can (a) render tools and
past calls for chat templates that know nothing of tools (`system_prompt`, `render_call`,
`render_result`) and (b) force a call: the assistant's reply starts with the opening of one
(`forced_prefix`) and the grammar engine masks the rest to the call's JSON (plan.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.protocol.tools import ToolCall


class ToolCallParseError(ValueError):
    """A call block whose contents are not a valid call."""


@dataclass
class Parsed:
    """What one feed/finish produced, in order: content text first, then complete calls.
    `reasoning`: a reasoning channel's text (harmony's analysis), for `reasoning_content`."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning: str = ""

    def __iadd__(self, other: "Parsed") -> "Parsed":
        self.content += other.content
        self.calls.extend(other.calls)
        self.reasoning += other.reasoning
        return self


def call_from_json(obj: Any, args_key: str) -> ToolCall:
    """`{"name": ..., args_key: {...}}` → ToolCall, or ToolCallParseError."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallParseError(f"a tool call must be an object with a string 'name', got {obj!r:.200}")
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            raise ToolCallParseError(f"the arguments of {obj['name']!r} are not JSON: {args!r:.200}") from None
    if not isinstance(args, dict):
        raise ToolCallParseError(f"the arguments of {obj['name']!r} must be an object, got {args!r:.200}")
    return ToolCall.of(obj["name"], args)


class ToolCallStream:
    """One choice's incremental parse. Subclasses implement `feed` and `finish`."""

    # Inside a reasoning body (harmony's analysis) after the last feed: what counts a token as
    # reasoning (usage's reasoning_tokens) even when the feed released no text yet.
    in_reasoning = False

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError


class ToolParser:
    """A model family's tool-call format (one module each, registered by name)."""

    name: str = ""
    harmony = False  # reads harmony's special tokens: the detokenizer keeps them (chat.py)
    forces_any_tool = True  # tool_choice "required" over several tools can be forced (plan.py)

    def stream(self) -> ToolCallStream:
        raise NotImplementedError

    def extract(self, text: str) -> Parsed:
        s = self.stream()
        out = s.feed(text)
        out += s.finish()
        return out

    arguments_key = "arguments"  # what the call object names its arguments

    def forced_prefix(self, function_name: str | None) -> str:
        """Assistant text that opens a call: up to the call object (any tool), or up to the
        value of `arguments_key` (`function_name`'s call). The grammar takes it from there."""
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        raise NotImplementedError

    def render_calls(self, calls: list[dict]) -> str:
        """Past assistant calls (OpenAI shape, arguments already a dict) as the model writes them."""
        raise NotImplementedError

    def render_result(self, content: str) -> str:
        raise NotImplementedError


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (held until known)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def loads_lenient(text: str) -> Any:
    """JSON, or JSON whose only fault is missing closing brackets at the end (a small model's
    usual slip, or a reply cut by max_tokens right after the arguments): closed and parsed.
    Anything else is a ToolCallParseError."""
    try:
        return json.loads(text)
    except ValueError as e:
        first = e
    stack, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                break
    else:
        if stack and not in_str:
            try:
                return json.loads(text.rstrip().rstrip(",") + "".join(reversed(stack)))
            except ValueError:
                pass
    raise ToolCallParseError(f"a tool call is not JSON ({first}): {text.strip()!r:.200}")
