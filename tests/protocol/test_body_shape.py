"""A body's shape is measured in its raw bytes before it is parsed (protocol/body.py, issue 44):
the measure agrees with what json.loads then makes, for any JSON (strings full of quotes,
backslashes, brackets and commas included), and a body over a bound is refused without an
object per value."""

from __future__ import annotations

import json
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from pdserve.protocol.body import MAX_DEPTH, _structure, _too_deep, _values, check_shape, parse_object
from pdserve.protocol.errors import APIError

# Strings made of the characters a scanner could trip on.
TRICKY = st.text(st.sampled_from(['"', "\\", "[", "]", "{", "}", ",", ":", "a", " ", "\n", "é", "😀"]), max_size=8)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TRICKY,
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TRICKY, inner, max_size=5),
                    max_leaves=40)


def depth(v) -> int:
    if isinstance(v, list):
        return 1 + max(map(depth, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(depth, v.values()), default=0)
    return 0


def count(v) -> int:
    """Values: containers, their elements and their members."""
    if isinstance(v, list):
        return 1 + sum(map(count, v))
    if isinstance(v, dict):
        return 1 + sum(map(count, v.values()))
    return 1


def without_strings(raw: bytes) -> bytes:
    """The reference: a byte-by-byte scanner that knows where strings and escapes are."""
    out, inside, escaped = bytearray(), False, False
    for b in raw:
        if inside:
            if escaped:
                escaped = False
            elif b == ord("\\"):
                escaped = True
            elif b == ord('"'):
                inside = False
        elif b == ord('"'):
            inside = True
        else:
            out.append(b)
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(JSON, st.booleans())
def test_the_structure_is_the_json_without_its_strings(value, ascii_only):
    raw = json.dumps(value, ensure_ascii=ascii_only).encode()
    structure = _structure(raw)
    assert structure == without_strings(raw)
    assert count(value) <= _values(structure) <= 2 * count(value)
    assert _too_deep(structure) == (depth(value) > MAX_DEPTH)


@pytest.mark.parametrize("levels", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 100_000])
def test_depth_is_exact_at_the_bound(levels):
    value = ["x"]
    for _ in range(levels - 1):
        value = [value, {"k": "]]]"}]
    raw = json.dumps(value).encode() if levels < 1000 else b"[" * levels + b"]" * levels
    assert _too_deep(_structure(raw)) == (levels > MAX_DEPTH)


def test_unbalanced_brackets_are_left_to_the_parser_unless_there_are_many():
    assert not _too_deep(_structure(b'{"a": [1}'))
    assert _too_deep(_structure(b"[" * 100_000))
    with pytest.raises(APIError, match="not valid JSON"):
        parse_object(b'{"a": [1}')


@pytest.mark.parametrize("raw,code", [
    (b'{"x": [' + b",".join([b"[]"] * 2_600_000) + b"]}", "too_many_values"),  # 7.8 MB of empty lists
    (b'{"prompt": [' + b",".join([b"0"] * 4_000_000) + b"]}", "too_many_values"),  # 8 MB of token ids
    (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too_deep"),
])
def test_a_body_over_a_bound_is_refused_without_an_object_per_value(raw, code):
    tracemalloc.start()
    try:
        with pytest.raises(APIError) as e:
            parse_object(raw, max_values=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert e.value.status == 400 and e.value.code == code
    assert peak < 6 * len(raw)  # a few copies of the bytes (json.loads of the lists: ~24x, in objects)


def test_commas_and_brackets_inside_strings_do_not_count():
    text = json.dumps({"prompt": "a, [b], {c}, " * 200_000}).encode()
    check_shape(text, max_values=10)  # 600,000 commas and brackets, all inside one string
    assert parse_object(text, max_values=10)["prompt"].startswith("a, [b]")


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "hi \\ud800 there"}', "prompt"),
    (b'{"stop": ["ok", "\\udfff"]}', "stop.1"),
    (b'{"a": "\xed\xa0\x80"}', "a"),  # a surrogate's UTF-8 bytes (json.loads takes them: 'surrogatepass')
    (b'{"\\ud800": 1}', None),
])
def test_lone_surrogates_are_refused_naming_the_field(raw, param):
    with pytest.raises(APIError) as e:
        parse_object(raw)
    assert e.value.code == "invalid_unicode" and e.value.param == param


def test_surrogate_pairs_and_escaped_backslashes_are_text():
    assert parse_object(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800"}') == {"a": "😀", "b": "\\ud800"}
