"""The bounded chat-template sandbox (protocol/template_sandbox.py) as a unit: templates
render as transformers renders them; every kind of runaway work ends as a RenderBoundError
within its bounds (a template that could not escape Jinja's sandbox still cannot escape it)."""

from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError, TemplateError
from transformers import AutoTokenizer

from pdserve.protocol.errors import APIError
from pdserve.protocol.requests import ChatCompletionRequest
from pdserve.protocol.chat_render import ChatTemplates
from pdserve.protocol.template_sandbox import BoundedEnvironment, RenderBoundError

MAX_CHARS = 100_000
TIMEOUT_S = 0.5

# Features Hub templates use (transformers' additions included), rendered like transformers does.
TEMPLATES = {
    "roles and tojson": "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% if m.tool_calls %}"
    "{{ m.tool_calls | tojson(indent=2) }}{% endif %}</{{ m.role }}>\n{% endfor %}"
    "{% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}",
    "namespace and loop controls": "{% set ns = namespace(sys='') %}{% for m in messages %}{% if m.role == 'system' %}"
    "{% set ns.sys = m.content %}{% continue %}{% endif %}{{ loop.index }}:{{ m.content }}"
    "{% if loop.last %}{% break %}{% endif %}{% endfor %}[{{ ns.sys }}]{{ bos_token }}",
    "macros, blocks, generation": "{% macro turn(m) %}[{{ m.role | upper }}] {{ m.content }}{% endmacro %}"
    "{% set head %}{{ eos_token }}{% endset %}{{ head }}{% for m in messages %}"
    "{% generation %}{{ turn(m) }}{% endgeneration %}{% endfor %}{{ flavour | default('plain') }}",
    "format, join, replace": "{{ messages | map(attribute='content') | join(' | ') }}{{ '%s/%d' % ('a', 2) }}"
    "{{ '{}-{}'.format('x', 'y') }}{{ (messages | last).content.replace('?', '!') }}"
    "{{ messages[0].content ~ '!' }}{{ dict(a=1) | tojson }}",
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "user", "content": "And Rome?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

# Runaway work, each ended by a bound: "size" before it is built, "time" at the deadline.
RUNAWAY = {
    "repeat": ("{{ 'x' * 10**9 }}", "size"),
    "huge integer": ("{{ 10 ** (10 ** 8) }}", "size"),
    "squaring": (
        "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
        "size",
    ),
    "range": ("{% for i in range(10**9) %}{% endfor %}", "size"),
    "nested loops": ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "time"),
    "loops over data": ("{% set s = 'ab' * 40000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "time"),
    "doubling with ~": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "size",
    ),
    "doubling with +": (
        "{% set ns = namespace(s=[1]) %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "size",
    ),
    "ljust": ("{{ 'x'.ljust(10**9) }}", "size"),
    "center filter": ("{{ 'x' | center(1000000000) }}", "size"),
    "percent width": ("{{ '%1000000000s' % 'x' }}", "size"),
    "percent arguments": ("{{ '%s' * 10 % (('x' * 90000,) * 10) }}", "size"),
    "format width": ("{{ '{:>1000000000}'.format('x') }}", "size"),
    "replace": ("{{ ('x' * 1000).replace('x', 'y' * 1000) }}", "size"),
    "replace filter": ("{{ ('x' * 1000) | replace('x', 'y' * 1000) }}", "size"),
    "join method": ("{{ ('y' * 1000).join(['a'] * 1000) }}", "size"),
    "join filter": ("{{ (['a' * 1000] * 1000) | join }}", "size"),
    "expandtabs": ("{{ ('\t' * 10000).expandtabs(1000) }}", "size"),
    "indent": ("{{ ('a\n' * 5000) | indent(100) }}", "size"),
    "output": ("{% for i in range(99999) %}{{ 'abcdefgh' * 100 }}{% endfor %}", "size"),
    "macro buffers": (
        "{% macro m() %}{% for i in range(99999) %}{{ 'a' * 1000 }}{% endfor %}{% endmacro %}"
        "{% for i in range(99999) %}{% set x = m() %}{% endfor %}",
        "size",
    ),
    "set block buffers": ("{% for i in range(99999) %}{% set x %}{{ 'a' * 99999 }}{% endset %}{% endfor %}", "size"),
}
# Refused outright: not available in chat templates, or Python's internals.
REFUSED = {
    "lipsum": "{{ lipsum(10**6) }}",
    "pprint": "{{ [1] | pprint }}",
    "tojson indent": "{{ messages | tojson(indent=1000) }}",
    "sum of lists": "{{ ([[1] * 1000] * 1000) | sum(start=[]) }}",
    "class": "{{ messages.__class__.__mro__ }}",
    "namespace internals": "{% set ns = namespace(_x=1) %}",
    "raise_exception": "{{ raise_exception('roles must alternate') }}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def templates(tokenizer, trust: bool = True) -> ChatTemplates:
    return ChatTemplates(tokenizer, 1024, MAX_CHARS, TIMEOUT_S, trust_requests=trust)


@pytest.mark.parametrize("source", TEMPLATES.values(), ids=list(TEMPLATES))
@pytest.mark.parametrize("continue_final", [False, True])
def test_renders_as_transformers_does(tokenizer, source, continue_final):
    messages = MESSAGES + [{"role": "assistant", "content": "It is"}] if continue_final else MESSAGES
    kw = dict(tools=TOOLS, add_generation_prompt=not continue_final, continue_final_message=continue_final)
    ours = templates(tokenizer).render(source, "chat_template", messages, variables={"flavour": "salty"}, **kw)
    theirs = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False, flavour="salty", **kw)
    assert ours == theirs


def test_the_models_template_renders_as_transformers_does(tokenizer):
    body = ChatCompletionRequest(messages=MESSAGES[:2] + [{"role": "assistant", "content": "Sunny."}] + MESSAGES[3:])
    t = templates(tokenizer, trust=False)
    source, param = t.source(body, None)
    assert param is None and source == tokenizer.chat_template
    messages = [m.for_template(i) for i, m in enumerate(body.messages)]
    ours = t.render(source, None, messages, tools=None, add_generation_prompt=True, continue_final_message=False,
                    variables=None)
    assert ours == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("source,kind", RUNAWAY.values(), ids=list(RUNAWAY))
def test_runaway_work_ends_at_a_bound(source, kind):
    env = BoundedEnvironment()
    with pytest.raises(RenderBoundError) as e:
        env.render(env.from_string(source), {}, MAX_CHARS, TIMEOUT_S)
    assert e.value.kind == kind


@pytest.mark.parametrize("source", REFUSED.values(), ids=list(REFUSED))
def test_unavailable_and_internal_things_are_refused(source):
    env = BoundedEnvironment()
    with pytest.raises((SecurityError, TemplateError, RecursionError)):
        env.render(env.from_string(source), {"messages": MESSAGES}, MAX_CHARS, TIMEOUT_S)


def test_client_templates_need_the_operators_trust(tokenizer):
    body = ChatCompletionRequest(messages=MESSAGES, chat_template="{{ messages | length }}")
    with pytest.raises(APIError) as e:
        templates(tokenizer, trust=False).source(body, None)
    assert e.value.status == 400 and e.value.code == "untrusted_chat_template" and e.value.param == "chat_template"
    assert templates(tokenizer).source(body, None) == ("{{ messages | length }}", "chat_template")
