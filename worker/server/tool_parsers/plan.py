"""How one chat request uses tools: which parser reads its output, what the template sees,
and what `tool_choice` forces.

- `none` (or no tools): the template gets no tools and the output is plain content.
- `auto`: needs `--enable-auto-tool-choice` and `--tool-call-parser` (vLLM's rule); the model
  decides, the parser finds the calls.
- `required` / named: needs `--tool-call-parser`. The assistant's reply is started with the
  opening of a call in the parser's format (for a named tool, up to its arguments), and the
  grammar engine masks the rest to JSON of the tool's `parameters` schema (named) or to one
  `{"name": <an offered tool>, "arguments": ...}` object (required), as vLLM forces these
  choices with structured outputs. The result is still checked: a reply cut by `max_tokens`
  inside the call is no valid call, a 422 `tool_call_invalid`, never passed off as one. (422,
  not 5xx: the same request would fail the same way on any worker, so a router must not retry.)

A chat template that knows tools (it mentions `tools`) gets them as `tools=` and the messages
as transformers' convention has them (`tool_calls[].function.arguments` as an object). One that
does not (SmolLM2's, say) would silently drop them, so the parser's own format is rendered
instead: the tools in a system message, past calls and tool results as the model writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.protocol.chat_render import knows_tools, offered_tools, with_tools
from pdserve.protocol.errors import APIError, bad_request
from pdserve.protocol.tools import NamedToolChoice
from pdserve.worker.request.sampling_params import StructuredOutputSpec
from pdserve.worker.server.tool_parsers import Parsed, ToolParser, get_parser


@dataclass(frozen=True)
class ToolPlan:
    parser: ToolParser | None = None  # None: the output is content only
    forced_prefix: str = ""  # prepended to the reply by the prompt, and to the parsed text
    required: bool = False
    name: str | None = None  # tool_choice named this function
    tools: list[dict] | None = None  # for the template
    parallel: bool = True  # parallel_tool_calls=false: only the first call of a reply is kept
    grammar: StructuredOutputSpec | None = None  # a forced call: what follows forced_prefix
    calls: bool = True  # False: a harmony reply parsed for its channels, no tools offered (calls are content)

    def stream(self):
        if self.parser is None:
            return None
        s = self.parser.stream(self.calls) if self.parser.harmony else self.parser.stream()
        if self.forced_prefix:
            s.feed(self.forced_prefix)  # inside a call block: nothing comes out
        return s

    def check(self, parsed: Parsed) -> None:
        """A forced choice whose output is not a call (of the named tool) is an error."""
        if not self.required:
            return
        if not parsed.calls:
            raise APIError(422, "tool_choice requires a tool call, but the model's output is not a valid one "
                                f"(cut by max_tokens?): {parsed.content!r:.300}",
                           "tool_choice", "tool_call_invalid")
        allowed = {t["function"]["name"] for t in self.tools or []}
        if any(c.function.name not in allowed for c in parsed.calls):
            raise APIError(422, f"tool_choice allows {sorted(allowed)}, but the model called "
                                f"{[c.function.name for c in parsed.calls]}", "tool_choice", "tool_call_invalid")


def plan_tools(body, parser_name: str | None, auto_enabled: bool) -> ToolPlan:
    choice = body.tool_choice
    if not body.tools or choice == "none":
        return ToolPlan()
    tools = offered_tools(body)
    if choice is None or choice == "auto":
        if not (auto_enabled and parser_name):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                              "to be set on the worker", "tool_choice")
        return ToolPlan(get_parser(parser_name), tools=tools, parallel=body.parallel_tool_calls)
    if not parser_name:
        raise bad_request(f"tool_choice {_show(choice)} requires --tool-call-parser to be set on the worker",
                          "tool_choice")
    if body.n > 1:
        raise bad_request("tool_choice required or named supports n=1 only", "n")
    parser = get_parser(parser_name)
    name = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if name is None and not parser.forces_any_tool:
        if len(tools) != 1:
            raise bad_request(f'tool_choice "required" with --tool-call-parser {parser_name} needs exactly one tool '
                              "(or a named tool_choice)", "tool_choice")
        name = tools[0]["function"]["name"]  # required over one tool is that tool's named call
    if name is not None:
        tools = [t for t in tools if t["function"]["name"] == name]
        schema = _arguments_schema(tools[0])
    else:  # one call object of any offered tool, its properties in the order the model writes them
        schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                              parser.arguments_key: _arguments_schema(t)},
                             "required": ["name", parser.arguments_key], "additionalProperties": False}
                            for t in tools]}
    grammar = StructuredOutputSpec("json", json.dumps(schema, separators=(",", ":")), "tool_choice")
    return ToolPlan(parser, parser.forced_prefix(name), True, name, tools, body.parallel_tool_calls, grammar)


def _arguments_schema(tool: dict) -> dict:
    """A tool's `parameters`; arguments are an object even when it declares none."""
    return tool["function"].get("parameters") or {"type": "object"}


def _show(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def template_input(messages: list[dict], plan: ToolPlan, chat_template: str | None,
                   fallback_parser: ToolParser | None) -> tuple[list[dict], dict]:
    """The messages and extra apply_chat_template kwargs for this request."""
    msgs, kwargs = with_tools(plan.tools)(messages, chat_template)
    parser = plan.parser or fallback_parser
    if knows_tools(chat_template) or parser is None:
        return msgs, kwargs
    out = []
    for m in msgs:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = parser.render_calls(m.pop("tool_calls"))
            m["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
        elif m["role"] == "tool":
            m = {"role": "user", "content": parser.render_result(m.get("content") or "")}
        out.append(m)
    if plan.tools:
        prompt = parser.system_prompt(plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended by calling; a cut-off reply stays "length"."""
    return "tool_calls" if called and reason == "stop" else reason


def complete_message(plan: ToolPlan, text: str) -> tuple[str | None, list[dict] | None]:
    """A whole reply's content and tool_calls (OpenAI shape), or APIError for a forced miss."""
    return complete_reply(plan, text)[:2]


def _whole(plan: ToolPlan, text: str) -> Parsed:
    s = plan.stream()
    parsed = s.feed(text)
    parsed += s.finish()
    return parsed


def _emitted_by_prefill(plan: ToolPlan, handed: str) -> Parsed:
    """What a prefill worker's answer already returned of the handed-over first token's text
    (its own parse of that one token, finished): the decode worker leaves it out."""
    return _whole(plan, handed) if handed else Parsed()


def complete_reply(plan: ToolPlan, text: str, handed: str = "") -> tuple[str | None, list[dict] | None, str | None]:
    """complete_message, and the reply's reasoning (harmony's analysis channel) or None.
    `handed`: on a P/D decode worker, the first token's text (the prefill's; `text` follows it):
    parsed as the reply's start, so a harmony header begun by the first token is read whole, and
    what the prefill's answer returned of it is left out (the router puts the two together)."""
    if plan.parser is None:
        return text, None, None
    parsed = _whole(plan, handed + text)
    if handed:
        before = _emitted_by_prefill(plan, handed)
        parsed.content = parsed.content.removeprefix(before.content)
        parsed.reasoning = parsed.reasoning.removeprefix(before.reasoning)
    plan.check(parsed)
    reasoning = parsed.reasoning or None
    if not parsed.calls:  # a harmony reply's content is its final channel; other formats' the text as is
        return (parsed.content if plan.parser.harmony else text), None, reasoning
    calls = parsed.calls if plan.parallel else parsed.calls[:1]
    return parsed.content.strip() or None, [c.model_dump() for c in calls], reasoning


def _reasoning_feed(stream, text: str):
    """`stream.feed(text)`, and whether the piece counts as reasoning: it released reasoning
    text or left the parser inside a reasoning body. Counted per piece of the engine's output
    (a token, or a few), as vLLM counts gpt-oss's by the harmony parser's channel per token:
    the analysis header's `<|message|>` counts, its `<|end|>` and the next header do not."""
    parsed = stream.feed(text)
    return parsed, bool(parsed.reasoning) or stream.in_reasoning


def reasoning_tokens(plan: ToolPlan, pieces: list[str], num_tokens: list[int], handed: str = "") -> int:
    """How many of a whole reply's tokens are reasoning (usage's reasoning_tokens); `pieces` the
    reply's text as the engine released it, `num_tokens` each piece's tokens; `handed` as in
    complete_reply (its token is the prefill's to count)."""
    s = plan.stream()
    if s is None:
        return 0
    s.feed(handed)
    return sum(n for text, n in zip(pieces, num_tokens) if _reasoning_feed(s, text)[1])


class StreamedCalls:
    """One streamed choice: text in, content and OpenAI tool-call increments out."""

    def __init__(self, plan: ToolPlan, handed: str = ""):
        self.plan = plan
        self.stream = plan.stream()
        self.num_calls = 0
        self.reasoning = ""  # the last feed's reasoning text (harmony's analysis channel)
        self.reasoning_tokens = 0  # so far (usage's completion_tokens_details)
        self.skip = Parsed()  # text the prefill's answer returned that this stream still holds back
        self.prime(handed)

    def prime(self, handed: str) -> None:
        """On a P/D decode worker: the handed-over first token's text (complete_reply's `handed`),
        read as the reply's start and sent by no one twice: what the prefill returned of it is
        skipped when this stream releases it."""
        if self.stream is None or not handed:
            return
        now = self.stream.feed(handed)  # dropped: the prefill's answer carried it
        before = _emitted_by_prefill(self.plan, handed)
        self.skip = Parsed(content=before.content[len(now.content):], reasoning=before.reasoning[len(now.reasoning):])

    def _unskipped(self, parsed: Parsed) -> Parsed:
        for field in ("content", "reasoning"):
            text, held = getattr(parsed, field), getattr(self.skip, field)
            n = min(len(text), len(held)) if held.startswith(text) or text.startswith(held) else 0
            setattr(parsed, field, text[n:])
            setattr(self.skip, field, held[n:] if n else held if not text else "")  # read otherwise: not again
        return parsed

    def feed(self, text: str, finished: bool, num_tokens: int = 0) -> tuple[str, list[dict]]:
        if self.stream is None:
            return text, []
        parsed, thinking = _reasoning_feed(self.stream, text)
        self.reasoning_tokens += num_tokens if thinking else 0
        if finished:
            parsed += self.stream.finish()
        parsed = self._unskipped(parsed)
        self.reasoning = parsed.reasoning
        if finished:
            if self.num_calls == 0:
                self.plan.check(parsed)
        deltas = []
        for call in parsed.calls if self.plan.parallel else parsed.calls[:1 - min(self.num_calls, 1)]:
            # OpenAI's increments: the first names the call, the next carries its arguments.
            deltas.append({"index": self.num_calls, "id": call.id, "type": "function",
                           "function": {"name": call.function.name, "arguments": ""}})
            deltas.append({"index": self.num_calls, "function": {"arguments": call.function.arguments}})
            self.num_calls += 1
        return parsed.content, deltas
