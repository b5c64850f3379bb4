"""The KV transports by name: the one place that knows them (--kv-transfer, the CLI's
--kv-transfer, kv_transfer_params.transport all pass the name through to here).

A transport is one module with a KVTransport implementation (transport.py) and one `register`
call: below for the built-in ones, or by whoever adds one (a test registers its own). Built-in
ones are named by "module:Class" and imported on first use, so the CLI can list and check names
without importing torch or the transport's library.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.protocol.flags import ConfigError
from pdserve.protocol.kv_transfer import BASE_TRANSPORT

if TYPE_CHECKING:
    from pdserve.worker.kv.transport import KVTransport

# Every prefill worker serves it besides its own transport: a decode worker that lacks the
# params' transport reads with it (and params that name none mean it).
BASE = BASE_TRANSPORT


@dataclass(frozen=True)
class Registration:
    name: str
    target: "str | type[KVTransport]"  # "module:Class", imported on first use, or the class
    installed: Callable[[], bool] = lambda: True  # cheap: no import of the transport's library
    missing: str = ""  # what to install when it is not
    preference: int = 0  # the default transport is the installed one of highest preference


_TRANSPORTS: dict[str, Registration] = {}


def register(name: str, target: "str | type[KVTransport]", installed: Callable[[], bool] = lambda: True,
             missing: str = "", preference: int = 0) -> None:
    _TRANSPORTS[name] = Registration(name, target, installed, missing, preference)


def unregister(name: str) -> None:
    if name == BASE:
        raise ValueError(f"the base transport {BASE!r} stays registered")
    _TRANSPORTS.pop(name, None)


def names() -> tuple[str, ...]:
    return tuple(_TRANSPORTS)


def installed(name: str) -> bool:
    return name in _TRANSPORTS and _TRANSPORTS[name].installed()


def default() -> str:
    """The transport a worker (and the CLI's stack) uses when --kv-transfer is not given."""
    return max((r for r in _TRANSPORTS.values() if r.installed()), key=lambda r: r.preference).name


def check(name: str | None, flag: str = "--kv-transfer") -> None:
    """ConfigError unless `name` (None: the default) is a registered, installed transport."""
    if name is None:
        return
    if name not in _TRANSPORTS:
        raise ConfigError(flag, f"must be {' or '.join(names())}, got {name!r}")
    if not _TRANSPORTS[name].installed():
        raise ConfigError(flag, f"{name} is not installed ({_TRANSPORTS[name].missing}), use {BASE}")


def transport_class(name: str) -> "type[KVTransport]":
    target = _TRANSPORTS[name].target
    if isinstance(target, str):
        module, _, cls = target.partition(":")
        target = getattr(importlib.import_module(module), cls)
    return target


def _nixl_installed() -> bool:
    # find_spec, not import: importing nixl pulls in torch and UCX, seconds the launcher never needs.
    return any(importlib.util.find_spec(m) is not None for m in ("nixl_cu13", "nixl"))


register("nixl", "pdserve.worker.kv.nixl_transport:NixlTransport", _nixl_installed,
         "pip install 'pdserve[nixl]'", preference=1)
register(BASE, "pdserve.worker.kv.tcp_transport:TcpTransport")
