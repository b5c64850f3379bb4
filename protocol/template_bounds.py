"""What each operation of a chat template may build, checked before it is built, and the clock.

A render (template_sandbox.py) runs with `RenderBounds`: `max_chars`, the most characters any
value it builds, and its whole output, may have, and a deadline. The sandbox routes every piece
of work that can grow or take long through here:
- operators that build values (`*`, `**`, `+`, `%`, `~`): `check_binop`, `bounded_concat`,
  from their operands' sizes, so no single C call (which holds the GIL, stalling the event loop
  too) builds anything over `max_chars`; integers over `MAX_INT_BITS` likewise;
- `str` methods and filters that can build more than they are given (`ljust`, `replace`,
  `join`, `format`, `indent`, `tojson`'s indents, ...): `check_str_method`, `bounded_filter`,
  `BoundedFormatter`, `tojson`; every call's and filter's result is checked after it returns;
- output, top-level and into the buffers of macros and blocks (`OutputBuffer`), is counted;
- every loop step (`bounded_iter`), call and filter looks at the clock (loop steps and appends
  once per `CLOCK_EVERY`), so loops and recursion end at the deadline.
"""

from __future__ import annotations

import functools
import json
import re
import string
import time
from _string import formatter_field_name_split  # what jinja's sandboxed formatter uses
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import SecurityError

# Integers a template may build (a JSON number in the data has at most 4,300 digits: ~14,300 bits).
MAX_INT_BITS = 1 << 15
# `tojson`'s indent and separators: real templates use 2 or 4 and ", "; an indent is repeated per
# nesting level on every line, so it must stay small for the output to stay near the data's size.
MAX_JSON_INDENT = 16
# Checks of the clock on hot paths (loop steps, output appends) happen once per this many.
CLOCK_EVERY = 256
# Text written into buffers (macros, `{% set %}` blocks, filter and call blocks) over a render,
# in units of `max_chars`: a buffer's text is written again where the block is used, so this
# is a few times the output a prompt may have (nested macros), never a prompt's worth each time.
BUFFERED_FACTOR = 8


class RenderBoundError(SecurityError):
    """A render went over its `RenderBounds`. `kind`: "time" or "size"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class RenderBounds:
    max_chars: int
    deadline: float  # time.monotonic()
    output_chars: int = 0  # the render's output so far
    buffered_chars: int = 0  # everything written into buffers so far
    ticks: int = 0

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderBoundError("time", "the chat template took longer than its time bound to render")

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % CLOCK_EVERY == 0:
            self.check_time()

    def check_size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise RenderBoundError("size", f"the chat template built {what} of {n} characters or more; at most "
                                           f"{self.max_chars} fit this model's context")

    def add_output(self, text: Any) -> None:
        if isinstance(text, str):
            self.output_chars += len(text)
            self.check_size(self.output_chars, "a text")
        self.tick()

    def add_buffered(self, text: Any) -> None:
        if isinstance(text, str):
            self.buffered_chars += len(text)
            if self.buffered_chars > BUFFERED_FACTOR * self.max_chars:
                raise RenderBoundError("size", f"the chat template wrote more than {BUFFERED_FACTOR} times "
                                               f"{self.max_chars} characters into its blocks")
        self.tick()


_BOUNDS: ContextVar[RenderBounds] = ContextVar("pdserve_render_bounds")


@contextmanager
def bounded(max_chars: int, timeout_s: float) -> Iterator[RenderBounds]:
    """The bounds of the render run inside (on this thread or task: a context variable)."""
    b = RenderBounds(max_chars, time.monotonic() + timeout_s)
    token = _BOUNDS.set(b)
    try:
        yield b
    finally:
        _BOUNDS.reset(token)


def bounds() -> RenderBounds:
    try:
        return _BOUNDS.get()
    except LookupError:
        raise RuntimeError("a bounded template ran outside BoundedEnvironment.render") from None


def length(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _too_big_int() -> RenderBoundError:
    return RenderBoundError("size", f"the chat template built an integer of more than {MAX_INT_BITS} bits")


def check_value(value: Any, what: str = "a value") -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _too_big_int()
    bounds().check_size(length(value), what)
    return value


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Before `left <operator> right` (the sandbox's intercepted operators): its result's size."""
    b = bounds()
    if operator == "*":
        if _is_int(left) and _is_int(right):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _too_big_int()
        elif _is_int(right) or _is_int(left):
            seq, n = (left, right) if _is_int(right) else (right, left)
            b.check_size(length(seq) * max(n, 0), "a repeated value")
    elif operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
        if left.bit_length() * right > MAX_INT_BITS:
            raise _too_big_int()
    elif operator == "+":
        b.check_size(length(left) + length(right), "a joined value")
    elif operator == "%" and isinstance(left, str):
        check_percent(left, right)


def _is_int(x: Any) -> bool:
    return isinstance(x, int)


def text_size(value: Any, limit: int) -> int:
    """About how many characters `str(value)` has, walking containers only until past `limit`."""
    size, stack = 0, [value]
    while stack and size <= limit:
        v = stack.pop()
        if isinstance(v, str):
            size += len(v) + 2
        elif isinstance(v, dict):
            size += 2
            for k, item in v.items():
                stack.extend((k, item))
        elif isinstance(v, (list, tuple, set, frozenset)):
            size += 2 + len(v)
            stack.extend(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            size += v.bit_length() // 3 + 2
        else:
            size += 32  # floats, None, booleans, undefined: short
    return size


# printf-style conversions: `%(key)flags width .precision length type`.
_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def check_percent(fmt: str, args: Any) -> None:
    """`fmt % args` (the `%` operator, the `format` filter): widths and precisions stay within
    the bound, and so does the estimated result."""
    b = bounds()
    widths = 0
    for width, precision, _ in _PERCENT.findall(fmt):
        if width == "*" or precision == "*":
            raise SecurityError("'*' widths are not allowed in chat templates")
        widths += int(width or 0) + int(precision or 0)
        b.check_size(widths, "a formatted text")
    b.check_size(len(fmt) + widths + text_size(args, b.max_chars), "a formatted text")


class BoundedFormatter(string.Formatter):
    """`str.format` in the sandbox: fields through its attribute checks, widths bounded."""

    def __init__(self, env):  # the BoundedEnvironment: fields go through its attribute checks
        super().__init__()
        self._env = env
        self._built = 0

    def get_field(self, field_name, args, kwargs):
        first, rest = formatter_field_name_split(field_name)
        obj = self.get_value(first, args, kwargs)
        for is_attr, i in rest:
            obj = self._env.getattr(obj, i) if is_attr else self._env.getitem(obj, i)
        return obj, first

    def format_field(self, value, format_spec):
        b = bounds()
        b.check_size(sum(int(n) for n in re.findall(r"\d+", format_spec)), "a formatted field")
        out = super().format_field(value, format_spec)
        self._built += len(out)
        b.check_size(self._built, "a formatted text")
        return out


def check_str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
    """Before a call of a `str` method that can build more than it is given: its result's size.
    Returns the arguments to call it with (an iterable given to `join` is read once, here)."""
    s, name, b = method.__self__, method.__name__, bounds()
    if name in ("ljust", "rjust", "center", "zfill") and args and _is_int(args[0]):
        b.check_size(args[0], "a padded text")
    elif name == "expandtabs":
        size = kwargs.get("tabsize", args[0] if args else 8)
        b.check_size(len(s) + s.count("\t") * max(size if _is_int(size) else 0, 0), "an expanded text")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        n = len(s) + 1 if not old else s.count(old)
        if len(args) > 2 and _is_int(args[2]) and args[2] >= 0:
            n = min(n, args[2])
        b.check_size(len(s) + n * max(len(new) - len(old), 0), "a replaced text")
    elif name == "join" and args:
        items = list(bounded_iter(args[0]))
        b.check_size(sum(length(x) for x in items) + len(s) * max(len(items) - 1, 0), "a joined text")
        return (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        b.check_size(len(s) * max(longest, 1), "a translated text")
    return args


def bounded_iter(iterable: Iterable) -> Iterator:
    """A `for` loop's iterable (every loop of a template is compiled to go through this)."""
    b = bounds()
    for item in iterable:
        b.tick()
        yield item


def bounded_concat(values: list) -> str:
    """The `~` operator: every operand's text, joined once its size is known."""
    parts = [str(v) for v in values]
    bounds().check_size(sum(len(p) for p in parts), "a joined text")
    return "".join(parts)


class OutputBuffer(list):
    """The buffer of a macro, `{% set %}` block or filter block: its output counts too."""

    def append(self, item):
        bounds().add_buffered(item)
        super().append(item)

    def extend(self, items):
        items = list(items)
        for item in items:
            bounds().add_buffered(item)
        super().extend(items)


def bounded_filter(name: str, fn):
    """A filter with the deadline, its own size check where it can build more than it is given,
    and its result's size checked."""
    # Filters that receive a context or environment first (jinja's pass_* decorators) get it first.
    skip = 1 if hasattr(fn, "jinja_pass_arg") else 0

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        b = bounds()
        b.check_time()
        value, rest = (args[skip] if len(args) > skip else None), args[skip + 1:]
        if name in ("center", "indent", "truncate", "wordwrap", "batch", "slice", "round"):
            for a in (*rest, *kwargs.values()):
                if _is_int(a):
                    b.check_size(abs(a), f"the argument of '{name}'")
        if name == "indent":
            width = rest[0] if rest else kwargs.get("width", 4)
            per_line = len(width) if isinstance(width, str) else width if _is_int(width) else 0
            text = str(value)
            b.check_size(len(text) + (text.count("\n") + 1) * per_line, "an indented text")
        elif name == "wordwrap":
            wrap = rest[2] if len(rest) > 2 else kwargs.get("wrapstring")
            b.check_size(length(value) * (1 + (len(wrap) if isinstance(wrap, str) else 1)), "a wrapped text")
        elif name == "replace" and len(rest) >= 2:
            text = str(value)
            count = rest[2] if len(rest) > 2 else kwargs.get("count")
            check_str_method(text.replace, (str(rest[0]), str(rest[1]), *(() if count is None else (count,))), {})
        elif name == "join":
            items = list(bounded_iter(value))
            sep = rest[0] if rest else kwargs.get("d", "")
            b.check_size(text_size(items, b.max_chars) + length(sep) * max(len(items) - 1, 0), "a joined text")
            args = (*args[:skip], items, *rest)
        elif name == "format" and isinstance(value, str):
            check_percent(value, (*rest, *kwargs.values()))
        elif name == "list":
            b.check_size(length(value), "a list")
        elif name == "sum":
            # Summing lists or strings (a `start` of [] or "") copies the sum so far at every step,
            # all inside one C call: only numbers are summed in a chat template.
            start = rest[1] if len(rest) > 1 else kwargs.get("start", 0)
            if not isinstance(start, (int, float)):
                raise SecurityError("sum() adds numbers only in chat templates")
        return check_value(fn(*args, **kwargs), f"the result of '{name}'")

    return checked


def tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` (its own: no HTML escaping; indent, separators, sort_keys), bounded.
    Compact output is about the data's size (one C call); indented output grows with nesting,
    so it is built piece by piece and counted."""
    if indent is None and separators is None:
        return json.dumps(x, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    if (isinstance(indent, int) and not 0 <= indent <= MAX_JSON_INDENT) or \
            (isinstance(indent, str) and len(indent) > MAX_JSON_INDENT) or \
            any(len(str(s)) > MAX_JSON_INDENT for s in separators or ()):
        raise SecurityError(f"tojson's indent and separators are at most {MAX_JSON_INDENT} characters in chat "
                            "templates")
    b, parts, size = bounds(), [], 0
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    for chunk in encoder.iterencode(x):
        size += len(chunk)
        b.check_size(size, "a JSON text")
        b.tick()
        parts.append(chunk)
    return "".join(parts)


