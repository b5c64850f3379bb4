"""`openai` (tool calls) and `openai_gptoss` (reasoning): gpt-oss's harmony output, read from the
decoded text with its special tokens kept (the chat layer asks the detokenizer for them).

A harmony reply is a run of messages; the prompt ends with `<|start|>assistant`, so the reply
opens inside the first one's header:

    <|channel|>analysis<|message|>chain of thought<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

A header is the text up to `<|message|>`: the role (after `<|start|>`), `<|channel|>NAME`, a
recipient `to=NAME` (before or after the channel) and a `<|constrain|>` type. A body ends at
`<|end|>`, `<|return|>` or `<|call|>` (or at a new `<|start|>`). Per channel:

- `analysis`: reasoning (`reasoning_content`), streamed as it is generated;
- `final`, and `commentary` without a recipient (a preamble meant for the user): content, streamed;
- a message with a recipient (`to=functions.NAME`): a tool call named NAME (`functions.` dropped),
  its body the JSON arguments, emitted once the body ends. When the request offered no tools the
  body is content instead (nothing asked for calls).

A reply cut mid-message (max_tokens) keeps what was generated: reasoning and content as far as
they go; a call whose arguments are whole JSON but for missing closing brackets is still a call,
else its text is content. Text before any header (a model that ignores the format) is content.
Special-token markers never reach the client; a partial marker at the end of an increment is
held until the next one says what it is.
"""

from __future__ import annotations

import json
import re

from pdserve.worker.server.tool_parsers.base import (Parsed, ToolCallParseError, ToolCallStream, ToolParser,
                                                     call_from_json, held_back, loads_lenient)

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                                         "<|constrain|>", "<|return|>", "<|call|>")
# The tokens a tokenizer must have for these parsers (checked at start, worker/server/main.py).
HARMONY_TOKENS = (START, END, MESSAGE, CHANNEL, RETURN, CALL)
_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_BODY_ENDS = (END, RETURN, CALL, START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_ANY_MARKER = re.compile("|".join(re.escape(m) for m in _MARKERS))


def _held(text: str) -> int:
    return max(held_back(text, m) for m in _MARKERS)


class HarmonyStream(ToolCallStream):
    def __init__(self, calls: bool = True) -> None:
        self.calls = calls  # False: a message to a recipient is content (no tools were offered)
        self.buf = ""
        self.in_header = True  # the prompt ended with `<|start|>assistant`: a header comes first
        self.call_body = ""
        self.started = False  # a header has been seen: bare text is no longer "before the format"
        self.kind = "content"  # the open body's: "reasoning" | "content" | "call"
        self.recipient = ""

    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while True:
            if self.in_header:
                i = self.buf.find(MESSAGE)
                if i < 0:
                    # A header has no user-visible text; keep it (bounded by max_tokens) until it ends.
                    return out
                self._open(self.buf[:i])
                self.buf = self.buf[i + len(MESSAGE):]
                self.in_header = False
            j, end = min(((self.buf.find(m), m) for m in _BODY_ENDS if m in self.buf), default=(-1, ""))
            if j < 0:
                if self.kind != "call":  # reasoning and content stream; a call waits for its end
                    keep = _held(self.buf)
                    self._body(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            self._body(out, self.buf[:j])
            self._close(out)
            self.buf = self.buf[j + (0 if end == START else len(end)):]
            self.in_header = True

    @property
    def in_reasoning(self) -> bool:
        return not self.in_header and self.kind == "reasoning"

    def _open(self, header: str) -> None:
        if START in header:  # a new message's role line: only what follows the last START counts
            header = header[header.rindex(START) + len(START):]
        self.started = True
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        name = channel.group(1) if channel else ""
        self.recipient = recipient.group(1) if recipient else ""
        if self.recipient and self.calls:
            self.kind = "call"
        elif name == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _body(self, out: Parsed, text: str) -> None:
        if self.kind == "reasoning":
            out.reasoning += text
        elif self.kind == "content":
            out.content += text
        else:
            self.call_body += text

    def _close(self, out: Parsed) -> None:
        if self.kind != "call":
            return
        body, self.call_body = self.call_body, ""
        name = self.recipient.removeprefix("functions.")
        try:
            args = loads_lenient(body) if body.strip() else {}
            out.calls.append(call_from_json({"name": name, "arguments": args}, "arguments"))
        except ToolCallParseError:  # not a call after all: its words, as written
            out.content += body

    def finish(self) -> Parsed:
        out = Parsed()
        if self.in_header:
            rest = self.buf
            # Before any header: the model's words (it ignored the format); a cut header: nothing.
            if not self.started and MESSAGE not in rest and CHANNEL not in rest:
                out.content = _ANY_MARKER.sub("", rest)
        else:
            self._body(out, _ANY_MARKER.sub("", self.buf))
            self._close(out)
        self.buf, self.in_header = "", True
        return out


class HarmonyParser(ToolParser):
    """`--tool-call-parser openai` (vLLM's name for harmony's function calls)."""

    name = "openai"
    arguments_key = "arguments"
    harmony = True
    # Harmony names the tool in the header: `required` over several tools would need a grammar
    # over special tokens; named (or required over one tool) forces the header instead.
    forces_any_tool = False

    def stream(self, calls: bool = True) -> HarmonyStream:
        return HarmonyStream(calls)

    def forced_prefix(self, function_name: str | None) -> str:
        if function_name is None:
            raise ValueError("harmony calls are forced by name")
        return f"{CHANNEL}commentary to=functions.{function_name} {CONSTRAIN}json{MESSAGE}"

    def system_prompt(self, tools: list[dict]) -> str:
        # Only for a template that ignores tools (gpt-oss's renders them itself): harmony's
        # developer-message form, in TypeScript-like signatures kept simple as JSON schemas.
        lines = ["# Tools", "", "## functions", "", "namespace functions {", ""]
        for t in tools:
            fn = t["function"]
            if fn.get("description"):
                lines.append(f"// {fn['description']}")
            lines.append(
                f"type {fn['name']} = (_: {json.dumps(fn.get('parameters') or {}, ensure_ascii=False)}) => any;"
            )
            lines.append("")
        lines.append("} // namespace functions")
        return "\n".join(lines)

    def render_calls(self, calls: list[dict]) -> str:
        return "".join(f"{START}assistant{CHANNEL}commentary to=functions.{c['function']['name']} {CONSTRAIN}json"
                       f"{MESSAGE}{json.dumps(c['function']['arguments'], ensure_ascii=False)}{CALL}" for c in calls)

    def render_result(self, content: str) -> str:
        return content


REASONING_PARSERS = ("openai_gptoss",)


def missing_tokens(tokenizer) -> list[str]:
    """Harmony's special tokens that `tokenizer` lacks (all of them for any non-gpt-oss model)."""
    vocab = tokenizer.get_vocab()
    return [t for t in HARMONY_TOKENS if t not in vocab]
