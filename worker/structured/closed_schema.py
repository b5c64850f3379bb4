"""JSON schemas read as closed: an object lists its keys, an array its items, unless it says otherwise.

JSON Schema's own default is open (`additionalProperties` absent = any extra key allowed), so a
grammar built from `{"properties": {"city": ...}}` lets a model write `{"city": "Paris",
"properties": {...}}`: a forced tool call then hands the tool an argument it never declared.
xgrammar compiles schemas in "strict mode" by default (absent = false), as vLLM and OpenAI's
strict structured outputs do; llguidance follows the standard. One rule for both engines, chosen
per worker: `--structured-outputs-allow-additional-properties` (off by default) restores the
standard reading; otherwise xgrammar keeps strict mode and llguidance gets the schema rewritten
here, with the keyword made explicit wherever xgrammar's strict mode would assume it:

  an object with `properties` (or `patternProperties`) and no `additionalProperties` /
  `unevaluatedProperties`                                  -> "additionalProperties": false
  an array with `prefixItems` and no `items`               -> "items": false

`{"type": "object"}` with no properties stays any object (json_object mode relies on that, and
xgrammar's strict mode leaves it open too). The branches of an `allOf` are left open: each one
names only its part of the keys, and closing them separately would leave no key allowed.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems", "contains", "not", "if",
        "then", "else", "propertyNames", "unevaluatedItems")
_LIST = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_schema(schema: Any) -> Any:
    """A copy of `schema` with undeclared object keys and array items refused (see above)."""
    return _close(schema, closable=True)


def _close(s: Any, closable: bool) -> Any:
    if not isinstance(s, dict):
        return s  # true / false schemas, or malformed input the engine reports itself
    out = dict(s)
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = _close(out[k], True)
    for k in _LIST:
        if isinstance(out.get(k), list):
            out[k] = [_close(x, True) for x in out[k]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_close(x, False) for x in out["allOf"]]
    for k in _MAP:
        if isinstance(out.get(k), dict):
            out[k] = {name: _close(x, True) for name, x in out[k].items()}
    if closable:
        if (("properties" in out or "patternProperties" in out)
                and "additionalProperties" not in out and "unevaluatedProperties" not in out):
            out["additionalProperties"] = False
        if "prefixItems" in out and "items" not in out:
            out["items"] = False
    return out
