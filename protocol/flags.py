"""Command-line flags generated from a component's one frozen config dataclass.

The worker (engine and server), the router and `pdserve up` each have one frozen config; its
fields are its flags, so a default is written once, in the dataclass. The parser holds no
defaults at all (`argparse.SUPPRESS`): a flag left off the command line leaves its field out of
the constructor call, the dataclass fills it in, and `--help` prints the dataclass's value.
Validation stays in each config's `__post_init__`, which raises `ConfigError` naming the flag.

It lives in the protocol package because the flags are the contract between components: the
operator and `pdserve up` build worker and router command lines, and both the worker and the
router (which may not import each other) generate their parsers here.

Naming: field `max_num_seqs` is `--max-num-seqs`; a `_s` suffix (seconds) is dropped, so
`shutdown_grace_s` is `--shutdown-grace SECONDS`; `flag(name=...)` overrides. A bool is a pair,
`--x/--no-x`. A tuple takes its values after one flag (`--kv-peer-allow A B`), or one per
repeated flag with `repeat=True` (`--api-key A --api-key B`). A plain field with no `flag(...)`
metadata is a flag too, with no help text.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

_KEY = "pdserve.flag"


class ConfigError(ValueError):
    """A configuration value is invalid; `flag` names the CLI flag responsible."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag, self.message = flag, message


@dataclass(frozen=True)
class Flag:
    help: str = ""
    name: str | None = None  # the option string, when the field name does not give it
    unset: str | None = None  # what an empty default (None, "", ()) means; required for None
    choices: tuple | None = None
    metavar: str | None = None
    # tuple fields: True = one value per repeated flag instead of several after one; "extend" =
    # both (`--x A B --x C`: vLLM's --lora-modules is written either way)
    repeat: bool | str = False
    parse: Callable[[str], Any] | None = None  # str -> field value; raise ArgumentTypeError on bad input
    show: Callable[[Any], str] | None = None  # the default as --help prints it, when str() would not do
    not_a_flag: str | None = None  # set by no_flag(): why the command line does not set this field


def flag(default: Any, help: str = "", *, repr: bool = True, **spec: Any) -> Any:
    """A config field that is a command-line flag: `x: int = flag(4, "what x does")`."""
    return dataclasses.field(default=default, repr=repr, metadata={_KEY: Flag(help, **spec)})


def no_flag(default: Any, why: str) -> Any:
    """A config field the command line does not set directly (`why` says what sets it)."""
    return dataclasses.field(default=default, metadata={_KEY: Flag(not_a_flag=why)})


def spec_of(f: dataclasses.Field) -> Flag:
    return f.metadata.get(_KEY, Flag())


def flag_name(f: dataclasses.Field) -> str | None:
    """The option string of a field, or None for a no_flag() field."""
    spec = spec_of(f)
    if spec.not_a_flag:
        return None
    return spec.name or "--" + f.name.removesuffix("_s").replace("_", "-")


def show_default(f: dataclasses.Field) -> str:
    """The default as `--help` prints it."""
    spec, value = spec_of(f), f.default
    if spec.show is not None:
        return spec.show(value)
    if value is None or value == "" or value == ():
        if spec.unset is None and value is None:
            raise TypeError(f"{f.name}: a None default needs flag(unset=...) saying what it means")
        return spec.unset or "none"
    if isinstance(value, bool):
        name = flag_name(f)
        return name if value else "--no-" + name.removeprefix("--")
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)


def _value_type(hint: Any) -> tuple[type, bool]:
    """(the type argparse converts each value to, whether the field is a tuple of them)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> None:
    """One argument per field of the dataclass `cls` (no_flag() fields excepted), in an
    argument group called `title` if given."""
    group = parser.add_argument_group(title) if title else parser
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = flag_name(f)
        if name is None:
            continue
        spec = spec_of(f)
        value_type, many = _value_type(hints[f.name])
        # `%` would be read as a format directive by argparse's help formatter.
        help_ = f"{spec.help} (default: {show_default(f)})".lstrip().replace("%", "%%")
        kw: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_}
        if spec.parse is not None:
            kw["type"] = spec.parse
        elif value_type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = value_type
            if many and spec.repeat == "extend":
                kw["action"], kw["nargs"] = "extend", "+"
            elif many and spec.repeat:
                kw["action"] = "append"
            elif many:
                kw["nargs"] = "*"
        if spec.choices is not None:
            kw["choices"] = spec.choices
        metavar = spec.metavar or ("SECONDS" if f.name.endswith("_s") and value_type is float else None)
        if metavar and value_type is not bool:
            kw["metavar"] = metavar
        group.add_argument(name, **kw)


def given(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` that the command line set, as the dataclass takes them."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in vars(args) and flag_name(f) is not None:
            value = vars(args)[f.name]
            out[f.name] = tuple(value) if isinstance(value, list) else value
    return out


def from_flags(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """The config the command line describes; `extra` sets what it does not (environment,
    fields derived from another component's config). Raises ConfigError naming the flag."""
    return cls(**{**given(cls, args), **extra})
