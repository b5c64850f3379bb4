"""The OpenAI Responses API (`POST /v1/responses`) as a thin layer over chat completions.

A Responses request becomes a chat request (`to_chat`), goes wherever a chat request goes (the
worker's chat route; on the router, the whole P/D path), and the chat answer is mapped back
(`from_chat`): a JSON answer to one `response` object, a chat stream to Responses' typed
events (`response.created` … `response.output_text.delta` … `response.completed`). Worker and
router share this module, so both speak the same Responses dialect.

Supported: text `input` (a string, or message items with text parts), `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `stream`, and chat's extras (`seed`, `top_k`, …)
passed through. Not yet, each a 400 naming the field: tools and function-call items, images and
files, `previous_response_id` (nothing is stored), non-text `text.format`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool
from starlette.responses import Response

from pdserve.protocol.errors import bad_request
from pdserve.protocol.sse import SSEResponse

TEXT_PARTS = ("input_text", "output_text", "text")
# Responses fields with no chat counterpart that cost nothing to accept.
_DROPPED = ("input", "instructions", "max_output_tokens", "store", "metadata", "text", "reasoning", "truncation",
            "previous_response_id", "tools", "tool_choice", "parallel_tool_calls", "include", "background")


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
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None


def _messages(req: ResponsesRequest) -> list[dict]:
    msgs = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return msgs + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind != "message":
            raise bad_request(f"input items of type {kind!r} are not supported yet (text messages only)", f"input.{i}")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                    raise bad_request(f"only text content parts are supported (got {part.get('type')!r})",
                                      f"input.{i}.content.{j}")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str) or item.get("role") not in ("user", "assistant", "system", "developer"):
            raise bad_request("an input message needs a role (user, assistant, system, developer) and text content",
                              f"input.{i}")
        msgs.append({"role": item["role"], "content": content})
    if not msgs:
        raise bad_request("input must not be empty", "input")
    return msgs


def to_chat(body: dict) -> dict:
    """The chat request a Responses request means (400 for what has no meaning here yet)."""
    from pdserve.protocol.body import validate

    req = validate(ResponsesRequest, body)
    if req.tools:
        raise bad_request("tools on /v1/responses are not supported yet; use /v1/chat/completions", "tools")
    if req.previous_response_id:
        raise bad_request("previous_response_id is not supported: this server stores no responses",
                          "previous_response_id")
    fmt = (req.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        raise bad_request("text.format other than text is not supported yet", "text.format")
    chat = {k: v for k, v in body.items() if k not in _DROPPED}
    chat["messages"] = _messages(req)
    if req.max_output_tokens is not None:
        chat["max_completion_tokens"] = req.max_output_tokens
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    return chat


# ---- answers ---------------------------------------------------------------------------------

def _response(rid: str, body: dict, status: str, output: list, usage: dict | None, finish: str | None) -> dict:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "model": body.get("model"), "output": output, "parallel_tool_calls": True,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tool_choice": "auto",
            "tools": [], "text": {"format": {"type": "text"}}, "usage": usage, "metadata": {}}


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def _message(mid: str, text: str, status: str) -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _usage(chat_usage: dict | None) -> dict | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def from_chat(response: Response, body: dict) -> Response:
    """Map a 200 chat answer (JSON or SSE) back to the Responses shape."""
    rid, mid = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    if isinstance(response, SSEResponse):
        out = SSEResponse(_events(response.body_iterator, body, rid, mid), on_close=response.on_close)
        response.on_close = None
        for k, v in response.headers.items():
            if k.lower().startswith("x-"):
                out.headers[k] = v
        return out
    chat = json.loads(response.body)
    choice = chat["choices"][0]
    finish = choice.get("finish_reason")
    text = choice["message"].get("content") or ""
    answer = _response(rid, body, _status(finish), [_message(mid, text, "completed")], _usage(chat.get("usage")),
                       finish)
    out = Response(json.dumps(answer), media_type="application/json")
    for k, v in response.headers.items():
        if k.lower().startswith("x-"):
            out.headers[k] = v
    return out


def _sse(kind: str, seq: int, data: dict) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, "sequence_number": seq, **data}).encode() + b"\n\n"


async def _events(chat: AsyncIterator[bytes], body: dict, rid: str, mid: str) -> AsyncIterator[bytes]:
    """Chat chunks (whole SSE events) in, Responses events out."""
    seq = 0
    text, finish, usage = [], None, None

    def ev(kind: str, **data) -> bytes:
        nonlocal seq
        seq += 1
        return _sse(kind, seq - 1, data)

    loc = {"item_id": mid, "output_index": 0, "content_index": 0}
    yield ev("response.created", response=_response(rid, body, "in_progress", [], None, None))
    yield ev("response.in_progress", response=_response(rid, body, "in_progress", [], None, None))
    yield ev("response.output_item.added", output_index=0,
             item={"type": "message", "id": mid, "status": "in_progress", "role": "assistant", "content": []})
    yield ev("response.content_part.added", **loc, part={"type": "output_text", "text": "", "annotations": []})
    try:
        async for block in chat:
            for raw in block.split(b"\n\n"):
                if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                    continue
                chunk = json.loads(raw[6:])
                if "error" in chunk:  # the chat stream broke after its 200
                    err = chunk["error"]
                    yield ev("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                    failed = _response(rid, body, "failed", [_message(mid, "".join(text), "incomplete")], None, None)
                    failed["error"] = {"code": err.get("code") or "server_error", "message": err.get("message")}
                    yield ev("response.failed", response=failed)
                    return
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or []:
                    delta = (c.get("delta") or {}).get("content")
                    if delta:
                        text.append(delta)
                        yield ev("response.output_text.delta", **loc, delta=delta, logprobs=[])
                    finish = c.get("finish_reason") or finish
    finally:
        await chat.aclose()
    full = "".join(text)
    yield ev("response.output_text.done", **loc, text=full, logprobs=[])
    yield ev("response.content_part.done", **loc, part={"type": "output_text", "text": full, "annotations": []})
    item = _message(mid, full, "completed")
    yield ev("response.output_item.done", output_index=0, item=item)
    status = _status(finish)
    yield ev(f"response.{status}", response=_response(rid, body, status, [item], _usage(usage), finish))
