"""A Jinja sandbox whose renders are bounded in time and in the size of what they build.

Jinja's sandbox (transformers renders chat templates in `ImmutableSandboxedEnvironment`) stops
a template from reaching Python's internals, but not from asking for work: `{{ 'x' * 10**9 }}`
allocates a gigabyte in one C call that holds the GIL (so the event loop stalls too), nested
loops over `range(99999)` run for hours, and a string doubled in a namespace grows past memory.
The template may be the model's (its data, the messages, come from the client) or, where the
operator allows it, the client's own. Every render here has `RenderBounds`: a deadline and
`max_chars`, the most characters any value the template builds, and its whole output, may have.

How each kind of work is bounded, before it is done:
- operators that build values (`*`, `**`, `+`, `%`, `~`) check the size of their result from
  their operands' sizes, so no single C call builds anything larger than `max_chars` (integers:
  `MAX_INT_BITS`); so do the string methods and filters that can build more than they are given
  (`center`, `replace`, `join`, `format`, `tojson`'s indents, ...), and every call and filter
  result is checked after it returns;
- output, also into the buffers of macros, `{% set %}` blocks and filter blocks, is counted;
- every `for` loop, call and filter checks the deadline, so loops and recursion end there (an
  empty loop body included); single calls are bounded by their size, hence in time.
Nothing is evaluated at compile time (`optimized=False`: Jinja would otherwise fold constant
expressions, unchecked, while compiling). Filters no chat template needs and whose cost is hard
to bound (`pprint`, `urlize`) and the `lipsum` global are left out.

The globals and filters transformers adds for chat templates (`raise_exception`,
`strftime_now`, its `tojson`, a `dict` and `namespace` without type tricks, the `generation`
tag, loop controls) are provided, so Hub templates render as they do there.
"""

from __future__ import annotations

import functools
import json
import re
import string
import time
from _string import formatter_field_name_split  # what jinja's sandboxed formatter uses
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

# Integers a template may build (a JSON number in the data has at most 4,300 digits: ~14,300 bits).
MAX_INT_BITS = 1 << 15
# `tojson`'s indent and separators: real templates use 2 or 4 and ", "; an indent is repeated per
# nesting level on every line, so it must stay small for the output to stay near the data's size.
MAX_JSON_INDENT = 16
MAX_STRFTIME_FORMAT = 256
# Checks of the clock on hot paths (loop steps, output appends) happen once per this many.
CLOCK_EVERY = 256
# Text written into buffers (macros, `{% set %}` blocks, filter and call blocks) over a render,
# in units of `max_chars`: a buffer's text is written again where the block is used, so this
# is a few times the output a prompt may have (nested macros), never a prompt's worth each time.
BUFFERED_FACTOR = 8
_LOOP_FILTER, _CONCAT_FILTER = "_bounded_loop", "_bounded_concat"


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


def bounds() -> RenderBounds:
    try:
        return _BOUNDS.get()
    except LookupError:
        raise RuntimeError("a bounded template ran outside BoundedEnvironment.render") from None


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_value(value: Any, what: str = "a value") -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise RenderBoundError("size", f"the chat template built an integer of more than {MAX_INT_BITS} bits")
    bounds().check_size(_length(value), what)
    return value


def _is_int(x: Any) -> bool:
    return isinstance(x, int)


def _text_size(value: Any, limit: int) -> int:
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


def _check_percent(fmt: str, args: Any) -> None:
    """`fmt % args` (the `%` operator, the `format` filter): widths and precisions stay within
    the bound, and so does the estimated result."""
    b = bounds()
    widths = 0
    for width, precision, _ in _PERCENT.findall(fmt):
        if width == "*" or precision == "*":
            raise SecurityError("'*' widths are not allowed in chat templates")
        widths += int(width or 0) + int(precision or 0)
        b.check_size(widths, "a formatted text")
    b.check_size(len(fmt) + widths + _text_size(args, b.max_chars), "a formatted text")


class _BoundedFormatter(string.Formatter):
    """`str.format` in the sandbox: fields through its attribute checks, widths bounded."""

    def __init__(self, env: "BoundedEnvironment"):
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


def _check_str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
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
        items = list(_bounded_iter(args[0]))
        b.check_size(sum(_length(x) for x in items) + len(s) * max(len(items) - 1, 0), "a joined text")
        return (items, *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        b.check_size(len(s) * max(longest, 1), "a translated text")
    return args


def _bounded_iter(iterable: Iterable) -> Iterator:
    """A `for` loop's iterable (every loop of a template is compiled to go through this)."""
    b = bounds()
    for item in iterable:
        b.tick()
        yield item


def _bounded_concat(values: list) -> str:
    """The `~` operator: every operand's text, joined once its size is known."""
    parts = [str(v) for v in values]
    bounds().check_size(sum(len(p) for p in parts), "a joined text")
    return "".join(parts)


class _OutputBuffer(list):
    """The buffer of a macro, `{% set %}` block or filter block: its output counts too."""

    def append(self, item):
        bounds().add_buffered(item)
        super().append(item)

    def extend(self, items):
        items = list(items)
        for item in items:
            bounds().add_buffered(item)
        super().extend(items)


class _Hooks(NodeTransformer):
    """Every loop's iterable through `_bounded_iter`, every `~` through `_bounded_concat`."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP_FILTER, [], [], None, None, lineno=node.iter.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _CONCAT_FILTER, [], [], None, None,
                            lineno=node.lineno)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's compiler with the `_Hooks` applied to the tree first (the filters a template uses
    are collected from the tree before code is written) and every output buffer an `_OutputBuffer`."""

    def visit_Template(self, node: nodes.Template, frame=None) -> None:
        super().visit_Template(_Hooks().visit(node), frame)

    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")


def _bounded_filter(name: str, fn):
    """A filter with the deadline, its own size check where it can build more than it is given,
    and its result's size checked."""
    # Filters that receive a context or environment first (jinja's pass_* decorators) get it first.
    skip = 1 if hasattr(fn, "jinja_pass_arg") else 0

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
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
            b.check_size(_length(value) * (1 + (len(wrap) if isinstance(wrap, str) else 1)), "a wrapped text")
        elif name == "replace" and len(rest) >= 2:
            text = str(value)
            count = rest[2] if len(rest) > 2 else kwargs.get("count")
            _check_str_method(text.replace, (str(rest[0]), str(rest[1]), *(() if count is None else (count,))), {})
        elif name == "join":
            items = list(_bounded_iter(value))
            sep = rest[0] if rest else kwargs.get("d", "")
            b.check_size(_text_size(items, b.max_chars) + _length(sep) * max(len(items) - 1, 0), "a joined text")
            args = (*args[:skip], items, *rest)
        elif name == "format" and isinstance(value, str):
            _check_percent(value, (*rest, *kwargs.values()))
        elif name == "list":
            b.check_size(_length(value), "a list")
        elif name == "sum":
            # Summing lists or strings (a `start` of [] or "") copies the sum so far at every step,
            # all inside one C call: only numbers are summed in a chat template.
            start = rest[1] if len(rest) > 1 else kwargs.get("start", 0)
            if not isinstance(start, (int, float)):
                raise SecurityError("sum() adds numbers only in chat templates")
        return _check_value(fn(*args, **kwargs), f"the result of '{name}'")

    return bounded


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` (its own: no HTML escaping; indent, separators, sort_keys), bounded.
    Compact output is about the data's size (one C call); indented output grows with nesting,
    so it is built piece by piece and counted."""
    if indent is None and separators is None:
        return json.dumps(x, ensure_ascii=ensure_ascii, sort_keys=sort_keys)
    if (isinstance(indent, int) and not 0 <= indent <= MAX_JSON_INDENT) or \
            (isinstance(indent, str) and len(indent) > MAX_JSON_INDENT) or \
            any(len(str(s)) > MAX_JSON_INDENT for s in separators or ()):
        raise SecurityError(f"tojson's indent and separators are at most {MAX_JSON_INDENT} characters in chat templates")
    b, parts, size = bounds(), [], 0
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    for chunk in encoder.iterencode(x):
        size += len(chunk)
        b.check_size(size, "a JSON text")
        b.tick()
        parts.append(chunk)
    return "".join(parts)


def _raise_exception(message: str):
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > MAX_STRFTIME_FORMAT:
        raise SecurityError(f"strftime_now takes a format of at most {MAX_STRFTIME_FORMAT} characters")
    return datetime.now().strftime(fmt)


def _bounded_range(*args: int) -> range:
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        raise RenderBoundError("size", f"range() of {len(rng)} items; at most {MAX_RANGE} in a chat template")
    return rng


class _TemplateDict:
    """The `dict` global without the class itself (no type tricks through it), as transformers has it."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """`namespace()` that stores no underscore names (transformers' rule: none of Python's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace cannot store the underscore-prefixed attribute {name!r}")


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` (transformers marks the assistant's tokens with it;
    only its content matters for a prompt)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Compile with `from_string`; render only with `render` (see the module doc)."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, optimized=False,
                         extensions=[_GenerationTag, loopcontrols])
        self.filters["tojson"] = _tojson
        for name in ("pprint", "urlize"):
            del self.filters[name]
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.filters[_LOOP_FILTER] = _bounded_iter
        self.filters[_CONCAT_FILTER] = _bounded_concat
        del self.globals["lipsum"]
        self.globals.update(range=_bounded_range, raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace)

    @staticmethod
    def output_buffer() -> _OutputBuffer:
        return _OutputBuffer()

    def render(self, template: jinja2.Template, variables: dict[str, Any], max_chars: int, timeout_s: float) -> str:
        """The template's output, or RenderBoundError once it would take longer than `timeout_s`
        or build more than `max_chars` characters (anything else a template raises comes through)."""
        b = RenderBounds(max_chars, time.monotonic() + timeout_s)
        token = _BOUNDS.set(b)
        try:
            parts = []
            for chunk in template.generate(**variables):
                b.add_output(chunk)
                parts.append(chunk)
            return "".join(parts)
        finally:
            _BOUNDS.reset(token)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        b = bounds()
        if operator == "*":
            if _is_int(left) and _is_int(right):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise RenderBoundError("size", f"the chat template built an integer of more than {MAX_INT_BITS} bits")
            elif _is_int(right) or _is_int(left):
                seq, n = (left, right) if _is_int(right) else (right, left)
                b.check_size(_length(seq) * max(n, 0), "a repeated value")
        elif operator == "**" and _is_int(left) and _is_int(right) and right > 0:
            if max(left.bit_length(), 1) * right > MAX_INT_BITS and abs(left) > 1:
                raise RenderBoundError("size", f"the chat template built an integer of more than {MAX_INT_BITS} bits")
        elif operator == "+":
            b.check_size(_length(left) + _length(right), "a joined value")
        elif operator == "%" and isinstance(left, str):
            _check_percent(left, right)
        return _check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's signature)
        bounds().check_time()
        if isinstance(getattr(__obj, "__self__", None), str):
            args = _check_str_method(__obj, args, kwargs)
        return _check_value(super().call(__context, __obj, *args, **kwargs), "the result of a call")

    def wrap_str_format(self, value: Any):
        """`str.format` / `format_map`, as the sandbox has them, with `_BoundedFormatter`."""
        if not isinstance(getattr(value, "__self__", None), str) or \
                getattr(value, "__name__", None) not in ("format", "format_map"):
            return None
        text, is_map = value.__self__, value.__name__ == "format_map"

        def formatted(*args, **kwargs):
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return _BoundedFormatter(self).vformat(text, args, kwargs)

        return functools.update_wrapper(formatted, value)
