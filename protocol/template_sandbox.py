"""A Jinja sandbox whose renders are bounded in time and in the size of what they build.

Jinja's sandbox (transformers renders chat templates in `ImmutableSandboxedEnvironment`) stops
a template from reaching Python's internals, but not from asking for work: `{{ 'x' * 10**9 }}`
allocates a gigabyte in one C call that holds the GIL (so the event loop stalls too), nested
loops over `range(99999)` run for hours, and a string doubled in a namespace grows past memory.
The template may be the model's (its data, the messages, come from the client) or, where the
operator allows it, the client's own.

`BoundedEnvironment` renders with `RenderBounds` (template_bounds.py: a deadline, and
`max_chars`, the most characters any value the template builds, and its whole output, may
have). It routes all the work that can grow or take long through that module's checks: the
operators that build values (intercepted binary operators; `~` and every `for` loop's iterable
through filters the compiler inserts into each template's tree), calls (`str` methods),
`str.format`, every filter, and every output buffer. Nothing is evaluated at compile time
(`optimized=False`: Jinja would otherwise fold constant expressions, unchecked, while compiling).
Filters no chat template needs and whose cost is hard to bound (`pprint`, `urlize`) and the
`lipsum` global are left out.

The globals and filters transformers adds for chat templates (`raise_exception`,
`strftime_now`, its `tojson`, a `dict` and `namespace` without type tricks, the `generation`
tag, loop controls) are provided, so Hub templates render as they do there.
"""

from __future__ import annotations

import functools
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

from pdserve.protocol.template_bounds import (BoundedFormatter, OutputBuffer, RenderBoundError, bounded,
                                                   bounded_concat, bounded_filter, bounded_iter, bounds,
                                                   check_binop, check_str_method, check_value, tojson)

MAX_STRFTIME_FORMAT = 256
# The filters the compiler inserts (never written in a template, though harmless if they are).
_LOOP_FILTER, _CONCAT_FILTER = "_bounded_loop", "_bounded_concat"


class _Hooks(NodeTransformer):
    """Every loop's iterable through `bounded_iter`, every `~` through `bounded_concat`."""

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
    are collected from the tree before code is written) and every output buffer an `OutputBuffer`."""

    def visit_Template(self, node: nodes.Template, frame=None) -> None:
        super().visit_Template(_Hooks().visit(node), frame)

    def buffer(self, frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.output_buffer()")


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
        self.filters["tojson"] = tojson
        for name in ("pprint", "urlize"):
            del self.filters[name]
        self.filters = {name: bounded_filter(name, fn) for name, fn in self.filters.items()}
        self.filters[_LOOP_FILTER] = bounded_iter
        self.filters[_CONCAT_FILTER] = bounded_concat
        del self.globals["lipsum"]
        self.globals.update(range=_bounded_range, raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace)

    @staticmethod
    def output_buffer() -> OutputBuffer:
        return OutputBuffer()

    def render(self, template: jinja2.Template, variables: dict[str, Any], max_chars: int, timeout_s: float) -> str:
        """The template's output, or RenderBoundError once it would take longer than `timeout_s`
        or build more than `max_chars` characters (anything else a template raises comes through)."""
        with bounded(max_chars, timeout_s) as b:
            parts = []
            for chunk in template.generate(**variables):
                b.add_output(chunk)
                parts.append(chunk)
            return "".join(parts)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's signature)
        bounds().check_time()
        if isinstance(getattr(__obj, "__self__", None), str):
            args = check_str_method(__obj, args, kwargs)
        return check_value(super().call(__context, __obj, *args, **kwargs), "the result of a call")

    def wrap_str_format(self, value: Any):
        """`str.format` / `format_map`, as the sandbox has them, with `BoundedFormatter`."""
        if not isinstance(getattr(value, "__self__", None), str) or \
                getattr(value, "__name__", None) not in ("format", "format_map"):
            return None
        text, is_map = value.__self__, value.__name__ == "format_map"

        def formatted(*args, **kwargs):
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return BoundedFormatter(self).vformat(text, args, kwargs)

        return functools.update_wrapper(formatted, value)
