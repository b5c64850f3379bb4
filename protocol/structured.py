"""The request fields that ask for structured output, and how they read as one constraint.

Accepted, as OpenAI and vLLM accept them (chat and completions alike):
  response_format      {"type": "text"} | {"type": "json_object"}
                       | {"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}
  guided_json          a JSON schema (object or JSON text)            vLLM's older extras
  guided_regex         a regular expression the whole output matches
  guided_choice        a list of strings; the output is one of them
  guided_grammar       a GBNF grammar (`root ::= ...`)
  structured_outputs   {"json" | "regex" | "choice" | "grammar" | "json_object": ...}   vLLM's newer object

At most one may constrain a request. `structured_output()` checks the shape and returns
(kind, value, param): kind in json | regex | choice | grammar; value the schema as JSON text, the
regex, the tuple of choices or the grammar; param the field it came from, named by every 400
about it. Compiling (is the schema valid? the regex?) is the worker's, which answers 400 too.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from pdserve.protocol.errors import bad_request

ANY_JSON_OBJECT = '{"type":"object"}'  # json_object: any JSON object, as a schema
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(f"{param} is not valid JSON", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    # Compact text, keys in the caller's order (the order fields are generated in).
    return json.dumps(schema, separators=(",", ":"))


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return value


def _choices(value: Any, param: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings", param)
    return tuple(value)


def _response_format(rf: dict) -> tuple[str, Any, str] | None:
    param = "response_format"
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json", ANY_JSON_OBJECT, param
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad_request("response_format.json_schema must be an object with name and schema",
                              "response_format.json_schema")
        if not isinstance(js.get("name"), str) or not js["name"]:
            raise bad_request("response_format.json_schema.name must be a non-empty string",
                              "response_format.json_schema.name")
        if "schema" not in js:
            raise bad_request("response_format.json_schema.schema is required", "response_format.json_schema.schema")
        return "json", _schema_text(js["schema"], "response_format.json_schema.schema"), param
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format.type")


def _structured_outputs(so: dict) -> tuple[str, Any, str] | None:
    given = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise bad_request(f"structured_outputs takes one of {', '.join(STRUCTURED_KEYS)}, got {', '.join(given)}",
                          "structured_outputs")
    if not given:
        return None
    key = given[0]
    param = f"structured_outputs.{key}"
    value = so[key]
    if key == "json":
        return "json", _schema_text(value, param), param
    if key == "json_object":
        return "json", ANY_JSON_OBJECT, param
    if key == "choice":
        return "choice", _choices(value, param), param
    return key, _string(value, param), param


class StructuredOutputFields(BaseModel):
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_output(self) -> tuple[str, Any, str] | None:
        """(kind, value, param) of the one constraint asked for, or None (400 if malformed)."""
        found = []
        if self.response_format is not None:
            spec = _response_format(self.response_format)
            if spec is not None:
                found.append(spec)
        if self.guided_json is not None:
            found.append(("json", _schema_text(self.guided_json, "guided_json"), "guided_json"))
        if self.guided_regex is not None:
            found.append(("regex", _string(self.guided_regex, "guided_regex"), "guided_regex"))
        if self.guided_choice is not None:
            found.append(("choice", _choices(self.guided_choice, "guided_choice"), "guided_choice"))
        if self.guided_grammar is not None:
            found.append(("grammar", _string(self.guided_grammar, "guided_grammar"), "guided_grammar"))
        if self.structured_outputs is not None:
            spec = _structured_outputs(self.structured_outputs)
            if spec is not None:
                found.append(spec)
        if len(found) > 1:
            names = ", ".join(p.split(".")[0] for _, _, p in found)
            raise bad_request(f"only one structured output constraint may be given, got {names}", found[1][2])
        return found[0] if found else None
