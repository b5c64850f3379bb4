"""`llama3_json`: Llama 3.1/3.2's JSON tool calls, `{"name": ..., "parameters": {...}}`, the
whole reply (optionally after `<|python_tag|>`, several separated by `;`). A reply that starts
otherwise is plain content and streams as it is generated; one that starts like a call is held
until the end, because only the end says whether it was one."""

from __future__ import annotations

import json

from pdserve.worker.server.tool_parsers.base import (Parsed, ToolCallParseError, ToolCallStream, ToolParser,
                                                     call_from_json, held_back, loads_lenient)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonStream(ToolCallStream):
    def __init__(self) -> None:
        self.buf = ""
        self.mode: str | None = None  # None: undecided; "content"; "call"

    def feed(self, text: str) -> Parsed:
        if self.mode == "content":
            return Parsed(content=text)
        self.buf += text
        if self.mode == "call":
            return Parsed()
        head = self.buf.lstrip()
        if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG) or held_back(head, PYTHON_TAG) == len(head):
            return Parsed()  # only whitespace, or maybe the start of the tag: undecided
        self.mode = "call" if head.startswith(("{", PYTHON_TAG)) else "content"
        if self.mode == "content":
            out, self.buf = self.buf, ""
            return Parsed(content=out)
        return Parsed()

    def finish(self) -> Parsed:
        text, self.buf = self.buf, ""
        if self.mode != "call":
            return Parsed(content=text)
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        try:
            return Parsed(calls=[call_from_json(obj, "parameters") for obj in _objects(body)])
        except ToolCallParseError:
            return Parsed(content=text)  # looked like a call, was not: the model's words as they are


def _objects(body: str) -> list:
    """`{...}; {...}` (or one object) → the decoded objects."""
    dec = json.JSONDecoder()
    objs, i = [], 0
    while i < len(body):
        try:
            obj, i = dec.raw_decode(body, i)
        except ValueError:
            # The last call may lack its closing brackets (cut short, or a named call whose
            # grammar ends with its parameters): closed, as hermes does.
            obj, i = loads_lenient(body[i:]), len(body)
        objs.append(obj)
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    if not objs:
        raise ToolCallParseError("empty tool call")
    return objs


class Llama3JsonParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream()

    arguments_key = "parameters"

    def forced_prefix(self, function_name: str | None) -> str:
        if function_name is None:
            return ""  # the whole reply is the call object
        return '{"name": ' + json.dumps(function_name) + ', "parameters": '

    def system_prompt(self, tools: list[dict]) -> str:
        listed = "\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                f"value}}. Do not use variables.\n\n{listed}")

    def render_calls(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps({"name": c["function"]["name"], "parameters": c["function"]["arguments"]},
                                    ensure_ascii=False) for c in calls)

    def render_result(self, content: str) -> str:
        return content
