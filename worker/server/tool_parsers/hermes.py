"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, as written by
Hermes-tuned models and the Qwen2.5 / Qwen3 chat templates (tool results go back inside
`<tool_response>` in a user turn). Text outside the blocks is the message's content."""

from __future__ import annotations

import json

from pdserve.worker.server.tool_parsers.base import (Parsed, ToolCallParseError, ToolCallStream, ToolParser,
                                                     call_from_json, held_back, loads_lenient)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream(ToolCallStream):
    def __init__(self) -> None:
        self.buf = ""  # text not yet emitted: a possible OPEN's start, or an open block's body
        self.in_call = False
        self.any_call = False

    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while True:
            if not self.in_call:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = held_back(self.buf, OPEN)
                    out.content += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out.content += self.buf[:i]
                self.buf, self.in_call = self.buf[i + len(OPEN):], True
            j = self.buf.find(CLOSE)
            if j < 0:
                return out
            try:
                out.calls.extend(_parse(self.buf[:j]))
                self.any_call = True
            except ToolCallParseError:  # not a call after all: the model's words, as written
                out.content += OPEN + self.buf[:j + len(CLOSE)]
            self.buf, self.in_call = self.buf[j + len(CLOSE):], False
            if self.any_call:  # whitespace between calls is not content
                self.buf = self.buf.lstrip()

    def finish(self) -> Parsed:
        """An unclosed block (max_tokens, or a stop string ate the CLOSE) still counts when it
        holds a whole call; otherwise its text is returned as content."""
        out = Parsed()
        if self.in_call:
            try:
                out.calls.extend(_parse(self.buf))
            except ToolCallParseError:
                out.content = OPEN + self.buf
        else:
            out.content = self.buf
        self.buf, self.in_call = "", False
        if self.any_call or out.calls:
            out.content = out.content.strip()
        return out


def _parse(body: str) -> list:
    """A block holds one call object, or a list of them (SmolLM2 writes `[{...}, ...]`)."""
    obj = loads_lenient(body)
    return [call_from_json(o, "arguments") for o in (obj if isinstance(obj, list) else [obj])]


class HermesParser(ToolParser):
    name = "hermes"

    def stream(self) -> HermesStream:
        return HermesStream()

    def forced_prefix(self, function_name: str | None) -> str:
        if function_name is None:
            return OPEN + "\n"
        return OPEN + "\n" + '{"name": ' + json.dumps(function_name) + ', "arguments": '

    def system_prompt(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def render_calls(self, calls: list[dict]) -> str:
        return "\n".join(OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                    "arguments": c["function"]["arguments"]},
                                                   ensure_ascii=False) + "\n" + CLOSE for c in calls)

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
