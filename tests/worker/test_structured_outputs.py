"""Structured outputs: response_format (json_object, json_schema), vLLM's guided_* and
structured_outputs, as a token mask in the sampler.

A tiny random-weight checkpoint emits garbage, which is what makes the mask observable: without
it nothing it writes is JSON; with it every output must validate against its schema
(jsonschema), every guided_choice output is one of the choices and every guided_regex output
matches. Both grammar engines run under the engine; the server is a real `pdserve worker` called
by the real `openai` client (create, beta parse, streaming) and langchain-openai's
`with_structured_output`.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch

from pdserve.protocol.errors import APIError
from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest
from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.engine.llm_engine import LLMEngine
from pdserve.worker.request.sampling_params import SamplingParams, StructuredOutputSpec
from pdserve.worker.structured.structured_output import BACKENDS, GrammarError, apply_grammar_masks
from tests.checkpoints import _config as checkpoint_config
from tests.worker.test_server_harness import WorkerProcess

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "member": {"type": "boolean"}}}
ENUMS = {"type": "object", "additionalProperties": False, "required": ["mood", "tags"],
         "properties": {"mood": {"enum": ["happy", "sad", "calm"]},
                        "tags": {"type": "array", "maxItems": 3,
                                 "items": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}}
PHONE = r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}"
CHOICES = ["positive", "negative", "neutral", "it depends"]


def _spec(kind, value):
    return StructuredOutputSpec(kind, json.dumps(value, separators=(",", ":")) if kind == "json" else value)


# ---- the request fields --------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,expected", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json", '{"type":"object"}', "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"},
                                                                 "strict": True}}},
     ("json", '{"type":"integer"}', "response_format")),
    ({"guided_json": '{"type": "string"}'}, ("json", '{"type":"string"}', "guided_json")),
    ({"guided_regex": "a+"}, ("regex", "a+", "guided_regex")),
    ({"guided_choice": ["x", "y"]}, ("choice", ("x", "y"), "guided_choice")),
    ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"', "guided_grammar")),
    ({"structured_outputs": {"choice": ["x"]}}, ("choice", ("x",), "structured_outputs.choice")),
    ({"structured_outputs": {"json": {"type": "null"}}}, ("json", '{"type":"null"}', "structured_outputs.json")),
])
def test_fields_read_as_one_constraint(fields, expected):
    for req in (CompletionRequest(prompt="p", **fields), ChatCompletionRequest(messages=[{"role": "user",
                                                                                         "content": "p"}], **fields)):
        req.check_unsupported()
        assert req.structured_output() == expected


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "response_format.json_schema.schema"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1]"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
])
def test_malformed_fields_are_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="p", **fields).check_unsupported()
    assert e.value.status == 400 and e.value.param == param


def test_structured_output_and_forced_tool_call_conflict():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "p"}], tools=[tool], tool_choice="required",
                                guided_regex="a")
    with pytest.raises(APIError) as e:
        req.check_unsupported()
    assert e.value.param == "guided_regex"


# ---- the engine, both grammar engines ------------------------------------------------------------------

@pytest.fixture(scope="module")
def padded_checkpoint(tmp_path_factory, default_model_dir):
    """The embedding is 64 rows wider than the tokenizer (as padded vocabularies are)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("ckpt-padded")
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(checkpoint_config("llama", len(tok) + 64), dtype=torch.float32).save_pretrained(
        out
    )
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, padded_checkpoint):
    return LLMEngine(EngineConfig(model=str(padded_checkpoint), device="cpu", max_model_len=512),
                     structured_outputs_backend=request.param)


def _check(kind, value, text):
    if kind == "json":
        jsonschema.validate(json.loads(text), value)
    elif kind == "regex":
        assert re.fullmatch(value, text), text
    else:
        assert text in value, text


CASES = [("json", PERSON), ("json", ENUMS), ("json", {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                      "required": ["ok"], "additionalProperties": False}),
         ("regex", PHONE), ("regex", r"(yes|no)!{1,3}"), ("choice", CHOICES),
         ("choice", ["a.b (c)", "x|y+", "[z] 1-2/3", "back\\slash"])]  # regex metacharacters are literal


def test_every_output_obeys_its_grammar(engine):
    tok = engine.tokenizer
    prompts = [tok.encode(p) for p in ("Describe a person.", "Hi", "The weather today is")]
    params, expected = [], []
    for kind, value in CASES:
        for i, temperature in enumerate((0.0, 1.0, 1.5)):
            params.append(SamplingParams(max_tokens=120, temperature=temperature, seed=i,
                                         structured=_spec(kind, tuple(value) if kind == "choice" else value)))
            expected.append((kind, value))
    outs = engine.generate([prompts[i % 3] for i in range(len(params))], params)
    for (kind, value), out in zip(expected, outs):
        assert out[-1] in engine.model_config.eos_token_ids  # finished by the grammar, not by length
        _check(kind, value, tok.decode(out, skip_special_tokens=True))
    # Without the grammar the same model writes no JSON at all: the mask is what made it.
    plain = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0))
    for out in plain:
        with pytest.raises(ValueError):
            json.loads(tok.decode(out, skip_special_tokens=True))


def test_mask_excludes_the_embeddings_padding(engine):
    """logit_bias pushes a padding id (past the tokenizer) to the top; the grammar still wins."""
    pad = len(engine.tokenizer) + 3
    assert pad < engine.model_config.vocab_size
    free = engine.generate([engine.tokenizer.encode("x")], SamplingParams(max_tokens=3, temperature=0,
                                                                         logit_bias=((pad, 100.0),)))[0]
    assert free == [pad] * 3
    out = engine.generate([engine.tokenizer.encode("x")], SamplingParams(
        max_tokens=40, temperature=0, logit_bias=((pad, 100.0),), structured=_spec("regex", "[a-c]{2,5}")))[0]
    assert pad not in out and re.fullmatch("[a-c]{2,5}", engine.tokenizer.decode(out, skip_special_tokens=True))


def test_the_matcher_consumes_a_handed_over_token(engine):
    """As a P/D decode worker does: the first output arrives appended, not sampled here; the
    matcher catches up before the next mask (here the second token must close the choice)."""
    tok = engine.tokenizer
    spec = _spec("choice", ("ab", "ac"))
    req_params = SamplingParams(max_tokens=8, temperature=0, structured=spec)
    (first,) = tok.encode("a")
    matcher = engine.structured_outputs.matcher(spec)
    logits = torch.zeros(1, engine.model_config.vocab_size)

    class R:  # the two attributes apply_grammar_masks reads
        grammar, output_token_ids = matcher, [first]

    apply_grammar_masks(logits, [R])
    allowed = {tok.decode([t]) for t in torch.nonzero(logits[0] == 0).flatten().tolist()}
    assert allowed and allowed <= {"b", "c"}
    assert req_params.modifies_logits


def test_an_invalid_spec_is_refused_at_add_request(engine):
    for spec in (StructuredOutputSpec("regex", "a(b", "guided_regex"),
                 StructuredOutputSpec("json", '{"type":"no-such-type"}', "guided_json"),
                 StructuredOutputSpec("grammar", "root ::= missing_rule", "guided_grammar")):
        with pytest.raises(GrammarError) as e:  # a ValueError with .param: the server's 400
            engine.add_request("bad", [1, 2, 3], SamplingParams(structured=spec))
        assert e.value.param == spec.param
    assert not engine.has_work()


# ---- closed schemas: no key the schema does not declare (issue 23, item 9) --------------------------------

ARGS = {"type": "object", "required": ["city"],  # a tool's parameters as clients write them: no additionalProperties
        "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["C", "F"]},
                       "where": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90,
                                                                          "maximum": 90}}}}}
CALL = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": ARGS},  # a forced call's
        "required": ["name", "arguments"], "additionalProperties": False}                       # (plan_tools)


def _undeclared(value, schema) -> list[str]:
    """Keys of `value` (recursively) that its schema's properties do not declare."""
    if not isinstance(value, dict):
        return []
    props = schema.get("properties", {})
    return [k for k in value if k not in props] + [u for k, v in value.items() if k in props
                                                   for u in _undeclared(v, props[k])]


def test_close_schema():
    from pdserve.worker.structured.closed_schema import close_schema

    assert close_schema({"type": "object"}) == {"type": "object"}  # any object stays any object
    closed = close_schema(ARGS)
    assert closed["additionalProperties"] is False and closed["properties"]["where"]["additionalProperties"] is False
    assert "additionalProperties" not in ARGS  # a copy
    assert close_schema({"properties": {"a": {}}, "additionalProperties": True})["additionalProperties"] is True
    assert close_schema({"prefixItems": [{"type": "integer"}]})["items"] is False
    anyof = close_schema({"anyOf": [{"properties": {"a": {}}}], "$defs": {"D": {"properties": {"b": {}}}}})
    assert anyof["anyOf"][0]["additionalProperties"] is False and anyof["$defs"]["D"]["additionalProperties"] is False
    allof = close_schema({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in s for s in allof["allOf"])  # each branch names only its part


@pytest.mark.parametrize("schema", [ARGS, CALL], ids=["response_format", "forced_call"])
def test_undeclared_keys_are_never_written(engine, schema):
    """xgrammar's strict mode and llguidance alike: many seeds of a random model, hot, and every
    output is a complete object of declared keys only (an open grammar lets it invent keys,
    whose names are unbounded strings: it then also runs out of tokens)."""
    tok = engine.tokenizer
    seeds = range(12)
    params = [SamplingParams(max_tokens=100, temperature=1.2, seed=s, structured=_spec("json", schema)) for s in seeds]
    for out in engine.generate([tok.encode("Weather?")] * len(params), params):
        assert out[-1] in engine.model_config.eos_token_ids, tok.decode(out)
        value = json.loads(tok.decode(out, skip_special_tokens=True))
        jsonschema.validate(value, schema)
        assert not _undeclared(value, schema), value


def test_additional_properties_are_a_worker_switch(engine):
    """--structured-outputs-allow-additional-properties restores JSON Schema's open reading."""
    from pdserve.worker.structured.structured_output import StructuredOutputs

    tok, eos = engine.tokenizer, engine.model_config.eos_token_ids
    spec = _spec("json", ARGS)
    # xgrammar's compact JSON is `, `/`: `-separated, llguidance's `,`/`:`.
    seps = (", ", ": ") if engine.structured_outputs.backend == "xgrammar" else (",", ":")

    def accepts(so, value) -> bool:
        m = so.matcher(spec)
        m.advance(tok.encode(json.dumps(value, separators=seps), add_special_tokens=False) + [eos[0]])
        return m.terminated and not m.failed

    declared, extra = {"city": "Rome", "unit": "C"}, {"city": "Rome", "properties": {"x": 1}}
    nested = {"city": "Rome", "where": {"lat": 4, "lon": 5}}
    strict = engine.structured_outputs
    assert not strict.allow_additional_properties  # the default
    open_ = StructuredOutputs(tok, engine.model_config.vocab_size, eos, strict.backend,
                              allow_additional_properties=True)
    assert accepts(strict, declared) and not accepts(strict, extra) and not accepts(strict, nested)
    assert accepts(open_, declared) and accepts(open_, extra) and accepts(open_, nested)


def test_a_missing_engine_fails_at_start_naming_the_flag(monkeypatch, engine):
    from pdserve.protocol.flags import ConfigError
    from pdserve.worker.structured.structured_output import StructuredOutputs

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # what an environment without the wheel imports
    with pytest.raises(ConfigError) as e:
        StructuredOutputs(engine.tokenizer, engine.model_config.vocab_size, (2,), "xgrammar")
    assert e.value.flag == "--structured-outputs-backend" and "pdserve[xgrammar]" in str(e.value)


# ---- through a real worker: openai and langchain-openai ------------------------------------------------

@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", "tiny", "--max-model-len", "512",
                       "--tool-call-parser", "hermes", "--log-level", "warning") as w:
        yield w


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Tell me about someone."}]
STRICT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_openai_json_schema_strict(client, seed):
    temperature = 0 if seed is None else 1.0
    r = client.chat.completions.create(model="tiny", messages=ASK, response_format=STRICT, max_tokens=120,
                                       temperature=temperature, seed=seed)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_openai_json_schema_streamed_equals_whole(client):
    whole = client.chat.completions.create(model="tiny", messages=ASK, response_format=STRICT, max_tokens=120,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, response_format=STRICT, max_tokens=120,
                                                 temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_openai_beta_parse(client):

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        legs: int = Field(ge=0, le=8)
        tags: list[Literal["small", "loud"]] = Field(max_length=2)

    parse = getattr(getattr(client, "beta", client).chat.completions, "parse", None) or client.chat.completions.parse
    r = parse(model="tiny", messages=ASK, response_format=Pet, max_tokens=120, temperature=0)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet)
    jsonschema.validate(json.loads(r.choices[0].message.content), Pet.model_json_schema())


def test_json_object_on_completions(client):
    # json_object allows any object; strings are unbounded, so sample until a few close (seeded).
    done = 0
    for seed in range(6):
        r = client.completions.create(model="tiny", prompt="JSON:", max_tokens=200, temperature=1.0, seed=seed,
                                      extra_body={"response_format": {"type": "json_object"}})
        text, reason = r.choices[0].text, r.choices[0].finish_reason
        if reason == "stop":
            assert isinstance(json.loads(text), dict)
            done += 1
        else:  # cut by max_tokens: still a prefix of an object
            assert text.startswith("{")
    assert done >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_guided_choice_and_regex(client, stream):
    for seed in range(4):
        for extra, check in (({"guided_choice": CHOICES}, lambda t: t in CHOICES),
                             ({"guided_regex": PHONE}, lambda t: re.fullmatch(PHONE, t)),
                             ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES)):
            r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=40, temperature=1.0, seed=seed,
                                          stream=stream, extra_body=extra)
            text = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
            assert check(text), (extra, text)


def test_guided_grammar(client):
    grammar = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, temperature=0,
                                       extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", r.choices[0].message.content)


@pytest.mark.parametrize("extra,param", [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
     "response_format"),
    ({"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_specs_are_openai_400s(worker, client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=5, extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    # Streamed too: refused before the stream starts, never an error inside a 200.
    r = httpx.post(f"{worker.url}/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True, **extra},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert httpx.get(f"{worker.url}/health").status_code == 200


def test_langchain_with_structured_output(worker):

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Review(BaseModel):
        """A product review."""
        sentiment: Literal["positive", "negative"]
        stars: int = Field(ge=1, le=5)

    llm = ChatOpenAI(model="tiny", base_url=f"{worker.url}/v1", api_key="x", temperature=0, max_tokens=80,
                     max_retries=0)
    review = llm.with_structured_output(Review, method="json_schema", strict=True).invoke("Review this phone.")
    assert isinstance(review, Review)
    mood = {"title": "Mood", "description": "How it feels.", **ENUMS}  # a plain JSON schema: a dict comes back
    as_dict = llm.with_structured_output(mood, method="json_schema", strict=True).invoke("How do you feel?")
    jsonschema.validate(as_dict, ENUMS)


def test_forced_tool_calls_carry_only_declared_arguments(worker, client):
    """langchain's bind_tools(tool_choice="any") (a `required` call) and a named tool_choice: the
    arguments hold the tool's declared keys only, whatever the seed (issue 23: a forced call
    came back as {'city': 'Paris', 'properties': {...}})."""
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """Get the current weather in a city."""
        return "sunny"

    for seed in range(4):
        llm = ChatOpenAI(model="tiny", base_url=f"{worker.url}/v1", api_key="x", temperature=1.2, seed=seed,
                         max_tokens=100, max_retries=0)
        (call,) = llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?").tool_calls
        assert call["name"] == "get_weather" and set(call["args"]) == {"city"}, call
        r = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=100, temperature=1.2, seed=seed,
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (named,) = r.choices[0].message.tool_calls
        args = json.loads(named.function.arguments)
        jsonschema.validate(args, ARGS)
        assert not _undeclared(args, ARGS), args
