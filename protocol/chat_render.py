"""A chat's prompt text: the model's chat template (or, where the operator allows it, the
client's) rendered over the request's messages in the bounded sandbox (template_sandbox.py).

One renderer for the worker and the router (`render_chat`): the worker renders the prompt it
runs; the router, with `--tokenizer`, renders the same text for its prefix hashes (KV-aware
routing), so both see the request's tools, `chat_template_kwargs` and generation-prompt fields
alike. What only the worker knows (its `--tool-call-parser`: how a template that does not know
tools gets them, and the opening of a forced call) comes in through `render_chat`'s `prepare`.

What a render sees is what transformers' `apply_chat_template` passes (the tokenizer's special
tokens, `messages`, `tools`, `documents`, `add_generation_prompt`, the request's
`chat_template_kwargs`), so a model's Hub template renders the prompt it was trained on; the
sandbox differs only in refusing work past its bounds. `max_chars` is the worker's
max_prompt_chars (worker/server/serving.py): no value a template builds, and not the prompt, may
be longer than the longest prompt that could fit --max-model-len. A render runs on a thread (the
caller's `off_loop`) and ends at `timeout_s` (--chat-template-timeout).

Failures are the request's, so 400s: a client template refused without
--trust-request-chat-template (`untrusted_chat_template`), one that does not compile, a template
that raises (`raise_exception`, wrong roles order), one over its bounds (a prompt too long for
the model is `context_length_exceeded`, as everywhere; a render out of time is
`chat_template_timeout`). They name the client's template param when it was the client's
template, else `messages`.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import jinja2

from pdserve.protocol import chat_templates
from pdserve.protocol.errors import APIError, bad_request
from pdserve.protocol.requests import ChatCompletionRequest
from pdserve.protocol.template_sandbox import BoundedEnvironment, RenderBoundError
from pdserve.protocol.tools import parse_arguments

log = logging.getLogger(__name__)

# transformers' marker for continue_final_message: rendered after the final message's content,
# then the prompt is cut where it appears, so the reply continues that text.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# Names a message's reasoning comes under; templates read the first (transformers aliases them).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Client templates compiled and kept (the model's own is one more entry).
COMPILED_CACHE = 16


class ChatTemplates:
    """One worker's chat templating: the model's template, the trust rule for a client's, the bounds."""

    def __init__(self, tokenizer, max_model_len: int, max_chars: int, timeout_s: float, trust_requests: bool):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_chars
        self.timeout_s = timeout_s
        self.trust_requests = trust_requests
        self._env = BoundedEnvironment()
        self._compile = functools.lru_cache(maxsize=COMPILED_CACHE + 1)(self._env.from_string)

    def source(self, body, tools: list[dict] | None) -> tuple[str, str | None]:
        """The template this request renders with, and the param naming it when it is the
        client's (None: the model's own)."""
        requested = chat_templates.requested_template(body.chat_template, body.chat_template_kwargs)
        if requested is not None:
            template, param = requested
            if not self.trust_requests:
                raise APIError(400, chat_templates.untrusted_message(param), param, "untrusted_chat_template")
            return template, param
        if self.tokenizer.chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        # A tokenizer with several named templates picks its tool-use one when tools are given.
        return self.tokenizer.get_chat_template(None, tools), None

    def render(self, source: str, client_param: str | None, messages: list[dict], *, tools: list[dict] | None,
               add_generation_prompt: bool, continue_final_message: bool, variables: dict | None) -> str:
        """The prompt text (any thread). `messages` are plain dicts (ChatMessage.for_template)."""
        param = client_param or "messages"
        variables = {k: v for k, v in (variables or {}).items() if k != "chat_template"}
        messages = [_alias_reasoning(m) for m in messages]
        if continue_final_message:
            final = messages[-1].get("content") or ""
            if "content" not in source:
                raise bad_request("continue_final_message: this chat template does not render a message's content",
                                  "continue_final_message")
            messages[-1] = {**messages[-1], "content": final + CONTINUE_TAG}
        try:
            template = self._compile(source)
            text = self._env.render(template, {
                **self.tokenizer.special_tokens_map, "documents": None, **variables,
                "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
            }, self.max_chars, self.timeout_s)
        except RenderBoundError as e:
            raise self._over_bounds(e, client_param) from None
        except jinja2.TemplateSyntaxError as e:
            raise bad_request(f"the chat template does not compile: {_said(e)}", param) from None
        except Exception as e:  # raise_exception(), wrong roles order, bad variables: the request's
            raise bad_request(f"the chat template rejected the messages: {type(e).__name__}: {_said(e)}",
                              param) from None
        if continue_final_message:
            text = _cut_at_tag(text, final)
        return text

    def _over_bounds(self, e: RenderBoundError, client_param: str | None) -> APIError:
        if e.kind == "time":
            log.warning("a chat template render ran out of its %.1f s bound (%s)", self.timeout_s,
                        "the client's template" if client_param else "the model's template")
            return APIError(400, f"{e} ({self.timeout_s:g} s, --chat-template-timeout)", client_param or "messages",
                            "chat_template_timeout")
        if client_param is not None:
            return APIError(400, f"{e}", client_param, "chat_template_too_large")
        # The model's own template builds what it is given: it was given too much for the model.
        return bad_request(
            f"This model's maximum context length is {self.max_model_len} tokens (--max-model-len), but the "
            f"messages make a prompt longer than that many tokens can hold ({e}); reduce the messages.",
            "messages", "context_length_exceeded")


# (messages as ChatMessage.for_template gives them, the template's source) -> the messages and
# the extra template kwargs (`tools`) the template gets.
Prepare = Callable[[list[dict], str], tuple[list[dict], dict]]


def offered_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The tools a request offers the model (none when `tool_choice` is "none"), as a template
    reads them. A forced choice may narrow them further (the worker's tool plan)."""
    if not body.tools or body.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def arguments_as_objects(msg: dict) -> dict:
    """OpenAI sends a past call's arguments as JSON text; templates expect an object. (A request's
    messages arrive parsed already, protocol/tools.py's HistoryToolCall; this takes plain dicts too.)"""
    calls = msg.get("tool_calls")
    if not calls:
        return msg
    fixed = []
    for i, c in enumerate(calls):
        fn = dict(c["function"])
        try:
            fn["arguments"] = parse_arguments(fn.get("arguments"))
        except ValueError as e:
            raise bad_request(f"tool call {fn.get('name')!r}: {e}", f"tool_calls.{i}.function.arguments") from None
        fixed.append({**c, "function": fn})
    return {**msg, "tool_calls": fixed}


def knows_tools(source: str | None) -> bool:
    """A template that mentions `tools` renders them itself (given as `tools=`)."""
    return "tools" in (source or "")


def with_tools(tools: list[dict] | None) -> Prepare:
    """The messages as transformers' convention has them, and `tools` for a template that
    knows them (one that does not drops them: only a tool parser can render them for it)."""
    def prepare(messages: list[dict], source: str) -> tuple[list[dict], dict]:
        msgs = [arguments_as_objects(m) for m in messages]
        return msgs, ({"tools": tools} if tools and knows_tools(source) else {})

    return prepare


def render_chat(templates: ChatTemplates, body: ChatCompletionRequest, tools: list[dict] | None,
                prepare: Prepare | None = None) -> str:
    """A chat request's prompt text (any thread). `tools`: those offered to the template (and
    to the choice of a tokenizer's tool-use template); `prepare`: the template's input from the
    messages, `with_tools(tools)` unless given."""
    source, client_param = templates.source(body, tools)
    messages, extra = (prepare or with_tools(tools))([m.for_template(i) for i, m in enumerate(body.messages)], source)
    if body.continue_final_message and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs a final assistant message", "messages")
    return templates.render(source, client_param, messages, tools=extra.get("tools"),
                            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                            continue_final_message=body.continue_final_message, variables=body.template_variables)


def _said(e: Exception) -> str:
    """An error's text for a 400, cut short (it may quote a template line or the data)."""
    text = str(e)
    return text if len(text) <= 500 else text[:500] + "..."


def _alias_reasoning(message: dict) -> dict:
    """A message's reasoning under every name templates read it by (as transformers passes it)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _cut_at_tag(text: str, final: str) -> str:
    """The prompt up to the end of the final message's content (transformers' way): the reply
    continues it instead of opening a new turn."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise bad_request("continue_final_message: the chat template does not render the final message's "
                          "content as given", "continue_final_message")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()

