"""The router's prompt tokens for a chat are the worker's (one renderer, protocol/chat_render.py):
for requests with tools, chat_template_kwargs and the generation-prompt fields too, so KV-aware
routing hashes the prefix the worker computes and caches. Each case also renders differently
without those fields: a router that ignored them would fail here."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pdserve.protocol.chat_render import ChatTemplates
from pdserve.protocol.request_limits import RequestLimits
from pdserve.router.intake import intake
from pdserve.router.prompt import PromptTokenizer
from pdserve.worker.server.chat import render_prompt
from pdserve.worker.server.tool_parsers.plan import plan_tools

# A template in the shape of Qwen3's: tools in a system turn, a thinking switch, a past call's
# arguments read as an object.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "({{ t.function.parameters | tojson }}){% endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments.city }}</call>{% endfor %}"
    "<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


@pytest.fixture(scope="module")
def tokenizer_dir(default_model_dir, tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.chat_template = TEMPLATE
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return out


def routed(body: dict):
    """The request as the router carries it (router/intake.py)."""
    return intake(json.dumps({"model": "m", **body}).encode(), "chat", RequestLimits()).request


@pytest.fixture(scope="module")
def router(tokenizer_dir) -> PromptTokenizer:
    return PromptTokenizer(str(tokenizer_dir))


@pytest.fixture(scope="module")
def worker(tokenizer_dir) -> ChatTemplates:
    """A worker's templating (--tool-call-parser hermes --enable-auto-tool-choice)."""
    return ChatTemplates(AutoTokenizer.from_pretrained(tokenizer_dir), 2048, 1 << 20, 10.0, trust_requests=False)


def worker_tokens(templates: ChatTemplates, body: dict) -> list[int]:
    request = routed(body)
    return render_prompt(templates, request, plan_tools(request, "hermes", True), "hermes")


@pytest.mark.parametrize("body", [
    {"messages": ASK, "tools": [WEATHER]},
    {"messages": HISTORY, "tools": [WEATHER], "tool_choice": "auto"},
    {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": ASK, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": ASK + [{"role": "assistant", "content": "It is"}], "continue_final_message": True,
     "add_generation_prompt": False},
], ids=["tools", "tool-history", "kwargs", "tools+kwargs", "continue-final"])
def test_the_routers_prompt_tokens_are_the_workers(router, worker, body):
    tokens = router(routed(body))
    assert tokens is not None and tokens == worker_tokens(worker, body)
    assert tokens != router(routed({"messages": body["messages"]}))  # the fields change the prompt
