"""CORS, so a browser app can call the router (or a worker) directly: vLLM's four flags, with
vLLM's defaults and value syntax (a JSON list), on both components.

    --allowed-origins '["https://app.example"]'  --allowed-methods '["*"]'
    --allowed-headers '["*"]'  --allow-credentials

Starlette's CORSMiddleware answers a preflight (`OPTIONS` with `Origin` and
`Access-Control-Request-Method`) itself, before any route runs: browsers send no
`Authorization` on a preflight, so the API-key check must not see it, and it does not. Every
other answer, errors included, gets the `Access-Control-Allow-*` headers on its way out.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from pdserve.protocol.flags import ConfigError, flag

ALL = ("*",)


def json_list(text: str) -> tuple[str, ...]:
    """A flag's value as vLLM takes it: a JSON list of strings, e.g. '["https://a.example"]'."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', not {text!r}")
    return tuple(value)


def _show(value: tuple[str, ...]) -> str:
    return json.dumps(list(value))


def allowed(what: str, example: str) -> Any:
    """A config field for one `--allowed-*` list (default ["*"], as vLLM's)."""
    return flag(ALL, f'CORS: allowed {what}, a JSON list, e.g. \'["{example}"]\'', parse=json_list, show=_show,
                metavar="JSON")


def allow_credentials() -> Any:
    return flag(False, "CORS: let browsers send credentials (cookies, Authorization) cross-origin")


def check(config: Any) -> None:
    """For a config's __post_init__: the lists as the dataclass holds them (a tuple of strings)."""
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        value = getattr(config, name)
        if isinstance(value, list):
            object.__setattr__(config, name, value := tuple(value))
        if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError("--" + name.replace("_", "-"), f"must be a list of non-empty strings, not {value!r}")


def install(app: Starlette, config: Any) -> None:
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                       allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers),
                       allow_credentials=config.allow_credentials)
