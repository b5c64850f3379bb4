"""Hypothesis strategies from JSON Schema, for fuzzing the HTTP endpoints.

Covers the subset pydantic emits for the worker's request models (`$ref` into `$defs`,
`anyOf`, `enum`/`const`, scalar bounds, arrays, objects with required/optional properties and
free-form `additionalProperties`). Written here because hypothesis-jsonschema does not work
with current hypothesis releases and schemathesis is not a dependency.

`overrides` replaces the strategy of a top-level property by name: the fuzz test uses it to
keep the *cost* of a valid request bounded (n, max_tokens) while every other field stays wild.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# Integers well past int64 on both sides: seeds, token ids and limits must be refused, not crash.
_INTS = st.one_of(st.integers(-3, 300), st.integers(-(2**70), 2**70))
_FLOATS = st.one_of(st.floats(-3, 3), st.floats(allow_nan=False, allow_infinity=False))
# Text a client can send in JSON but a tokenizer may not take: lone UTF-16 surrogates (a str
# that cannot be UTF-8 encoded), NUL, astral characters. json.dumps escapes them as \uXXXX.
_ODD = st.sampled_from(["\ud800", "\udfff", "\udc00x", "\x00", "\U0001F600", "\ufffe"])


def _text(min_size: int = 0, max_size: int = 40) -> st.SearchStrategy:
    plain = st.text(min_size=min_size, max_size=max_size)
    # Rare per string (a body holds many strings): most generated requests must still run.
    odd = st.builds(lambda a, odd, b: a + odd + b, st.text(max_size=8), _ODD, st.text(max_size=8))
    return st.integers(0, 11).flatmap(lambda k: odd if k == 0 else plain)


_TEXT = _text()

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | _INTS | _FLOATS | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=12,
)


def from_schema(schema: dict, overrides: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy:
    return _Builder(schema.get("$defs", {})).build(schema, overrides or {})


class _Builder:
    def __init__(self, defs: dict[str, dict]):
        self.defs = defs

    def build(self, s: Any, overrides: dict[str, st.SearchStrategy] | None = None) -> st.SearchStrategy:
        if s is True or s == {}:
            return JSON_VALUES
        if "$ref" in s:
            return st.deferred(lambda: self.build(self.defs[s["$ref"].rsplit("/", 1)[1]]))
        if "const" in s:
            return st.just(s["const"])
        if "enum" in s:
            return st.sampled_from(s["enum"])
        for key in ("anyOf", "oneOf"):
            if key in s:
                return st.one_of([self.build(sub) for sub in s[key]])
        kind = s.get("type")
        if isinstance(kind, list):
            return st.one_of([self.build({**s, "type": k}) for k in kind])
        if kind == "string":
            return _text(s.get("minLength", 0), s.get("maxLength", 40))
        if kind == "integer":
            lo = s.get("minimum", s["exclusiveMinimum"] + 1 if "exclusiveMinimum" in s else None)
            hi = s.get("maximum", s["exclusiveMaximum"] - 1 if "exclusiveMaximum" in s else None)
            return _INTS if lo is None and hi is None else st.integers(lo, hi)
        if kind == "number":
            return st.floats(s.get("minimum"), s.get("maximum"), allow_nan=False, allow_infinity=False)
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            items = self.build(s.get("items", {}))
            lo = s.get("minItems", 0)
            return st.lists(items, min_size=lo, max_size=max(lo, min(s.get("maxItems", 4), 4)))
        if kind == "object":
            return self._object(s, overrides or {})
        return JSON_VALUES

    def _object(self, s: dict, overrides: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
        props = s.get("properties", {})
        required = set(s.get("required", ()))

        def strategy(name: str) -> st.SearchStrategy:
            return overrides[name] if name in overrides else self.build(props[name])

        fixed = st.fixed_dictionaries({n: strategy(n) for n in props if n in required},
                                      optional={n: strategy(n) for n in props if n not in required})
        extra = s.get("additionalProperties")
        if not props or isinstance(extra, dict) or extra is True:
            values = JSON_VALUES if extra in (None, True) else self.build(extra)
            return st.tuples(fixed, st.dictionaries(_TEXT, values, max_size=3)).map(lambda t: {**t[1], **t[0]})
        return fixed
