"""The OpenAI Responses API (`POST /v1/responses`) as a thin layer over chat completions.

A Responses request becomes a chat request (`to_chat`), goes wherever a chat request goes (the
worker's chat route; on the router, the whole P/D path), and the chat answer is mapped back
(`from_chat`): a JSON answer to one `response` object, a chat stream to Responses' typed
events (`response.created` … `response.output_text.delta` … `response.completed`). Worker and
router share this module, so both speak the same Responses dialect.

Supported: `input` (a string, or message items with text parts; `function_call` and
`function_call_output` items, the turns of a tool call, become chat's assistant `tool_calls` and
`tool` messages), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`,
`text.format` (`json_schema`, `json_object`: chat's `response_format`, so the structured outputs
engine constrains the text), function `tools`, `tool_choice` and `parallel_tool_calls` (chat's,
so the worker's tool-call parser finds the calls; they come back as `function_call` output
items), and chat's extras (`seed`, `top_k`, ...) passed through. Not supported, each a 400
naming the field: built-in tools (web search, file search, ...), images and files,
`previous_response_id` (nothing is stored).

A reasoning model's chain of thought (chat's `reasoning_content`, --reasoning-parser) is a
`reasoning` output item before the message, its text one `reasoning_text` content part (as
OpenAI's types and vLLM's gpt-oss answers have it), streamed as `response.reasoning_text.delta`
events; usage's `output_tokens_details.reasoning_tokens` is chat's `completion_tokens_details`.
A reasoning item sent back as input (a conversation replayed from `response.output`) is the
next assistant turn's `reasoning_content`: the chat template decides what it keeps of it
(gpt-oss's renders it before a tool call of the last turn, and drops it elsewhere).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool
from starlette.responses import Response

from pdserve.protocol.errors import bad_request
from pdserve.protocol.request_limits import RequestLimits
from pdserve.protocol.sse import SSEResponse
from pdserve.protocol.tools import parse_arguments
from pdserve.protocol.yield_from import flat

TEXT_PARTS = ("input_text", "output_text", "text")
# Responses fields with no chat counterpart that cost nothing to accept.
# (`text`, `tools` and `tool_choice` are translated, not passed.)
_DROPPED = ("input", "instructions", "max_output_tokens", "store", "metadata", "text", "reasoning", "truncation",
            "previous_response_id", "tools", "tool_choice", "include", "background")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # chat's extras (seed, top_k, ...) pass through

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None


def _text(content: Any, param: str) -> str:
    """A message's or tool output's text: a string, or text parts joined."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") not in TEXT_PARTS
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(f"only text content parts are supported (got {_type_of(part)!r})", f"{param}.{j}")
            texts.append(part["text"])
        return "\n".join(texts)
    if not isinstance(content, str):
        raise bad_request("text content must be a string or a list of text parts", param)
    return content


def _type_of(part: Any) -> Any:
    return part.get("type") if isinstance(part, dict) else type(part).__name__


def _messages(req: ResponsesRequest) -> list[dict]:
    msgs = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return msgs + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "function_call":  # a call the model made: an assistant turn's tool_calls
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")) or not item["name"]:
                raise bad_request("a function_call item needs call_id, name and arguments (strings)", f"input.{i}")
            try:  # checked here too, so the 400 names the Responses item, not the chat message it becomes
                parse_arguments(item["arguments"])
            except ValueError as e:
                raise bad_request(f"input.{i}.arguments: {e}", f"input.{i}.arguments") from None
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and last.get("_open"):
                last.setdefault("tool_calls", []).append(call)  # one turn: its text and all its calls
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call], "_open": True})
            continue
        if kind == "reasoning":  # a past turn's chain of thought: the assistant turn that follows it
            msgs.append({"role": "assistant", "content": None, "reasoning_content": _reasoning_text(item, i),
                         "_open": True})
            continue
        if kind == "function_call_output":  # the caller's result of that call: a tool message
            if not isinstance(item.get("call_id"), str) or "output" not in item:
                raise bad_request("a function_call_output item needs call_id and output", f"input.{i}")
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(item["output"], f"input.{i}.output")})
            continue
        if kind != "message":
            raise bad_request(f"input items of type {kind!r} are not supported (messages, reasoning, function_call "
                              "and function_call_output)", f"input.{i}")
        if item.get("role") not in ("user", "assistant", "system", "developer") or "content" not in item:
            raise bad_request("an input message needs a role (user, assistant, system, developer) and text content",
                              f"input.{i}")
        text = _text(item["content"], f"input.{i}.content")
        last = msgs[-1] if msgs else None
        if (item["role"] == "assistant" and last is not None and last.get("_open") and last["content"] is None
                and not last.get("tool_calls")):
            last["content"] = text  # the answer its reasoning item led to: one turn
            continue
        msgs.append({"role": item["role"], "content": text, **({"_open": True} if item["role"] == "assistant" else {})})
    if not msgs:
        raise bad_request("input must not be empty", "input")
    for m in msgs:
        if m.pop("_open", None) and m["content"] is None and not m.get("tool_calls"):
            m["content"] = ""  # reasoning that led to nothing sent back: an empty turn
    return msgs


def _reasoning_text(item: dict, index: int) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary (what OpenAI returns)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise bad_request("a reasoning item's content and summary are lists of text parts", f"input.{index}")
    return "\n".join(p["text"] for p in parts)


def _response_format(text: dict | None) -> dict | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    fmt = (text or {}).get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise bad_request("text.format.name must be a non-empty string", "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema (an object)", "text.format.schema")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if fmt.get(k) is not None}}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, not {kind!r}", "text.format.type")


def _tools(tools: list[dict]) -> list[dict]:
    """Responses' flat function tools as chat's nested ones; built-in tools have no meaning here."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools of type {tool.get('type')!r} are not supported (function tools only)",
                              f"tools.{i}.type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict) -> str | dict:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                      "tool_choice")


def to_chat(body: dict) -> dict:
    """The chat request a Responses request means (400 for what has no meaning here)."""
    from pdserve.protocol.body import validate

    req = validate(ResponsesRequest, body)
    if req.previous_response_id:
        raise bad_request("previous_response_id is not supported: this server stores no responses",
                          "previous_response_id")
    chat = {k: v for k, v in body.items() if k not in _DROPPED}
    chat["messages"] = _messages(req)
    if (response_format := _response_format(req.text)) is not None:
        chat["response_format"] = response_format
    if req.tools:
        chat["tools"] = _tools(req.tools)
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    return chat


def as_chat(body: dict, limits: RequestLimits) -> tuple[dict, dict]:
    """A Responses request (parsed, not yet validated) as the router and the worker take it: its
    input items bounded (--max-input-items), the chat request it means, and the fields its answer
    repeats (`echoed`). The chat request is then validated and bounded like any other."""
    limits.check_input_items(body)
    return to_chat(body), echoed(body)


# ---- answers ---------------------------------------------------------------------------------

# What an answer repeats of its request (`_response`). Kept instead of the whole body, which may
# hold thousands of input items, for as long as the answer takes (a stream: minutes).
_ECHOED = ("model", "instructions", "max_output_tokens", "parallel_tool_calls", "temperature", "top_p",
           "tool_choice", "tools", "text")


def echoed(body: dict) -> dict:
    """The fields of a Responses request that `from_chat` puts in its answer."""
    return {k: body[k] for k in _ECHOED if k in body}


def _response(rid: str, body: dict, status: str, output: list, usage: dict | None, finish: str | None) -> dict:
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": body.get("model"), "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": {"format": fmt}, "usage": usage, "metadata": {}}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _message(mid: str, text: str, status: str) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning(rid: str, text: str, status: str) -> dict:
    """A chain of thought as a Responses output item: no summary (nothing writes one), the text
    as one reasoning_text part."""
    return {"type": "reasoning", "id": rid, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def _function_call(call_id: str | None, name: str | None, arguments: str, status: str) -> dict:
    """A chat tool call as a Responses output item: `call_id` is chat's call id, which a
    function_call_output item of the next request names."""
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _usage(chat_usage: dict | None) -> dict | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    thought = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": chat_usage["total_tokens"]}


def _copy_headers(src: Response, dst: Response) -> Response:
    for k, v in src.headers.items():
        if k.lower().startswith("x-"):
            dst.headers[k] = v
    return dst


def from_chat(response: Response, body: dict) -> Response:
    """Map a 200 chat answer (JSON or SSE) back to the Responses shape; `body` is the request, or
    its `echoed` fields."""
    rid = f"resp_{uuid.uuid4().hex}"
    if isinstance(response, SSEResponse):
        chat = flat(response.body_iterator)
        if response.on_chunk is not None:  # it sees the chat chunks, as it would have
            chat = _seen(chat, response.on_chunk)
        out = SSEResponse(_events(chat, body, rid), on_close=response.on_close)
        response.on_close = None
        return _copy_headers(response, out)
    chat = json.loads(response.body)
    choice = chat["choices"][0]
    finish = choice.get("finish_reason")
    message = choice["message"]
    text, calls = message.get("content") or "", message.get("tool_calls") or []
    reasoning = message.get("reasoning_content")
    output = [_reasoning(f"rs_{uuid.uuid4().hex}", reasoning, "completed")] if reasoning else []
    # A reply that only calls tools or only reasons (cut by max_output_tokens) has no message
    # item (as OpenAI answers); any other has one.
    if text or not (calls or reasoning):
        output.append(_message(f"msg_{uuid.uuid4().hex}", text, "completed"))
    output += [_function_call(c["id"], c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
    answer = _response(rid, body, _status(finish), output, _usage(chat.get("usage")), finish)
    return _copy_headers(response, Response(json.dumps(answer), media_type="application/json"))


def _sse(kind: str, seq: int, data: dict) -> bytes:
    return (
        f"event: {kind}\ndata: ".encode()
        + json.dumps({"type": kind, "sequence_number": seq, **data}).encode()
        + b"\n\n"
    )


class _Items:
    """The output items of a streamed response, in order, as events: a message opens at its
    first text and closes when a tool call starts (or at the end); each chat tool call (by its
    `index`) is one function_call item whose arguments arrive as deltas; a reasoning item opens
    at the first reasoning text and closes when anything else starts. Items are never
    interleaved: one is closed before the next is added, as OpenAI streams them."""

    def __init__(self, ev):
        self.ev = ev  # (kind, **data) -> the SSE bytes of one event, numbered
        self.done: list[dict] = []  # closed items, in output order
        self.open: dict | None = None  # the item being streamed
        self.parts: list[str] = []  # its text (a message) or arguments (a call)
        self.by_index: dict[int, dict] = {}  # chat tool-call index -> its item

    def _loc(self, **more) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.done), **more}

    def _add(self, item: dict) -> list[bytes]:
        """Close the open item, open `item` (its content empty until it is done)."""
        out = self.close()
        self.open, self.parts = item, []
        if "content" in item:
            item["content"] = []
        out.append(self.ev("response.output_item.added", output_index=len(self.done), item=item))
        return out

    def text(self, delta: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self._add(_message(f"msg_{uuid.uuid4().hex}", "", "in_progress"))
            out.append(self.ev("response.content_part.added", **self._loc(content_index=0),
                               part={"type": "output_text", "text": "", "annotations": []}))
        if delta:
            self.parts.append(delta)
            out.append(self.ev("response.output_text.delta", **self._loc(content_index=0), delta=delta, logprobs=[]))
        return out

    def reasoning(self, delta: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self._add(_reasoning(f"rs_{uuid.uuid4().hex}", "", "in_progress"))
        self.parts.append(delta)
        out.append(self.ev("response.reasoning_text.delta", **self._loc(content_index=0), delta=delta))
        return out

    def call(self, tc: dict) -> list[bytes]:
        out = []
        fn = tc.get("function") or {}
        if tc.get("index") not in self.by_index:
            out += self._add(_function_call(tc.get("id"), fn.get("name"), "", "in_progress"))
            self.by_index[tc.get("index")] = self.open
        if fn.get("arguments") and self.open is self.by_index[tc.get("index")]:
            self.parts.append(fn["arguments"])
            out.append(self.ev("response.function_call_arguments.delta", **self._loc(), delta=fn["arguments"]))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        if self.open is None:
            return []
        item, whole = self.open, "".join(self.parts)
        if item["type"] == "message":
            out = [self.ev("response.output_text.done", **self._loc(content_index=0), text=whole, logprobs=[]),
                   self.ev("response.content_part.done", **self._loc(content_index=0),
                           part={"type": "output_text", "text": whole, "annotations": []})]
            item = _message(item["id"], whole, status)
        elif item["type"] == "reasoning":
            out = [self.ev("response.reasoning_text.done", **self._loc(content_index=0), text=whole)]
            item = _reasoning(item["id"], whole, status)
        else:
            out = [self.ev("response.function_call_arguments.done", **self._loc(), name=item["name"],
                           arguments=whole)]
            item = {**item, "arguments": whole, "status": status}
        out.append(self.ev("response.output_item.done", output_index=len(self.done), item=item))
        self.done.append(item)
        self.open, self.parts = None, []
        return out

    def partial(self) -> list[dict]:
        """What exists so far (a broken stream's `response.failed`), the open item incomplete."""
        if self.open is None:
            return list(self.done)
        whole, kind = "".join(self.parts), self.open["type"]
        last = (_message(self.open["id"], whole, "incomplete") if kind == "message"
                else _reasoning(self.open["id"], whole, "incomplete") if kind == "reasoning"
                else {**self.open, "arguments": whole, "status": "incomplete"})
        return self.done + [last]


async def _seen(chunks: AsyncIterator[bytes], on_chunk: Callable[[bytes], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            on_chunk(chunk)
            yield chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def _events(chat: AsyncIterator[bytes], body: dict, rid: str) -> AsyncIterator[bytes]:
    """Chat chunks (whole SSE events) in, Responses events out."""
    seq = 0
    finish, usage = None, None

    def ev(kind: str, **data) -> bytes:
        nonlocal seq
        seq += 1
        return _sse(kind, seq - 1, data)

    items = _Items(ev)
    yield ev("response.created", response=_response(rid, body, "in_progress", [], None, None))
    yield ev("response.in_progress", response=_response(rid, body, "in_progress", [], None, None))
    try:
        async for block in chat:
            for raw in block.split(b"\n\n"):
                if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                    continue
                chunk = json.loads(raw[6:])
                if "error" in chunk:  # the chat stream broke after its 200
                    err = chunk["error"]
                    yield ev("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                    failed = _response(rid, body, "failed", items.partial(), None, None)
                    failed["error"] = {"code": err.get("code") or "server_error", "message": err.get("message")}
                    yield ev("response.failed", response=failed)
                    return
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or []:
                    delta = c.get("delta") or {}
                    if delta.get("reasoning_content"):  # before content: a chunk's reasoning came first
                        for b in items.reasoning(delta["reasoning_content"]):
                            yield b
                    if delta.get("content"):
                        for b in items.text(delta["content"]):
                            yield b
                    for tc in delta.get("tool_calls") or []:
                        for b in items.call(tc):
                            yield b
                    finish = c.get("finish_reason") or finish
    finally:
        await chat.aclose()
    if not items.done and items.open is None:
        for b in items.text(""):  # no text and no call: still the one (empty) message a text reply has
            yield b
    for b in items.close():
        yield b
    status = _status(finish)
    yield ev(f"response.{status}", response=_response(rid, body, status, items.done, _usage(usage), finish))
