"""What a chat request may carry into a chat template: a template of its own, and variables.

A Jinja template supplied by the client (vLLM's top-level `chat_template`, or
`chat_template_kwargs.chat_template`, which transformers would take as the template itself) is
code the worker runs. A worker refuses it unless its operator allows it with
`--trust-request-chat-template` (vLLM's flag, its answer to CVE-2025-61620); the router cannot
know a worker's flags, so it passes such a request on and the worker's 400 comes back.

`chat_template_kwargs` are variables the model's template reads (`enable_thinking`, ...): client
data that reaches template code, bounded here in size, and kept off the names the server itself
gives the template. Both checks run in the request model (protocol/requests.py), so the router
refuses an oversized or malformed one before any worker is called.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

# Real chat templates are a few KiB (large ones, with tool-calling prose, ~15 KiB). Compiling one
# ends in Python's compile(), one call that holds the GIL: ~0.1 s at this size on one core.
MAX_TEMPLATE_CHARS = 32 * 1024
# Template variables are flags and short strings; this is generous for them and small next to a
# prompt. Counted as characters of keys and strings plus one per value (`variables_size`).
MAX_VARIABLES_SIZE = 64 * 1024
# What the server passes the template itself from the request's own fields (`tools` is validated
# there): a variable of the same name would shadow it.
RESERVED = ("messages", "tools", "add_generation_prompt")
KWARGS = "chat_template_kwargs"


def variables_size(value: Any, limit: int) -> int:
    """Characters of every key and string plus one per value, counted without recursion and
    only until past `limit` (the walk costs at most that much, whatever was sent)."""
    size, stack = 0, [value]
    while stack and size <= limit:
        v = stack.pop()
        size += 1
        if isinstance(v, str):
            size += len(v)
        elif isinstance(v, dict):
            size += sum(len(k) for k in v if isinstance(k, str))
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return size


def check_template(template: Any, param: str) -> None:
    if not isinstance(template, str):
        raise ValueError(f"{param} must be a string (a Jinja chat template)")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{param} is {len(template)} characters; at most {MAX_TEMPLATE_CHARS} are accepted")


def check_variables(kwargs: dict[str, Any]) -> None:
    """`chat_template_kwargs`: bounded in size; none of the server's own names (ValueError)."""
    if (size := variables_size(kwargs, MAX_VARIABLES_SIZE)) > MAX_VARIABLES_SIZE:
        raise ValueError(f"{KWARGS} is larger than {MAX_VARIABLES_SIZE} characters (at least {size})")
    if taken := [k for k in RESERVED if k in kwargs]:
        raise ValueError(f"{KWARGS} cannot set {', '.join(taken)}: the server sets it from the request")
    if "chat_template" in kwargs:
        check_template(kwargs["chat_template"], f"{KWARGS}.chat_template")


def validated(value: Any, field: str) -> Any:
    """A request model's `chat_template_kwargs` or `chat_template`, checked (a 400 naming it)."""
    if value is None:
        return None
    try:
        if field == KWARGS:
            check_variables(value)
        else:
            check_template(value, field)
    except ValueError as e:
        # A custom error keeps the message whole, without pydantic's "Value error, " prefix.
        raise PydanticCustomError("chat_template", "{message}", {"message": str(e)}) from None
    return value


def requested_template(chat_template: str | None, kwargs: dict[str, Any] | None) -> tuple[str, str] | None:
    """The client's own template and the param it came in, or None (the model's is used)."""
    if chat_template is not None:
        return chat_template, "chat_template"
    if kwargs and kwargs.get("chat_template") is not None:
        return kwargs["chat_template"], f"{KWARGS}.chat_template"
    return None


def untrusted_message(param: str) -> str:
    return (f"{param}: this server does not render chat templates sent with a request; its operator allows it "
            "with --trust-request-chat-template")
