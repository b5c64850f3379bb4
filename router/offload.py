"""CPU in proportion to what a client sent: off the event loop when it is large, inline when small.

A thread hop (asyncio.to_thread) costs the loop a submit, a wake-up and a future callback, more
than parsing, validating or serialising a small body does; a large one on the loop would stall
every other request and /health. Below `INLINE_BYTES` the work runs inline (at most ~0.1 ms).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from typing import Callable, TypeVar

T = TypeVar("T")

INLINE_BYTES = 16 * 1024


async def off_loop(size: int, fn: Callable[..., T], *args) -> T:
    """`fn(*args)`, on a thread when `size` (the bytes it works through) is past INLINE_BYTES."""
    if size <= INLINE_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class RequestIds:
    """Request ids for requests that bring none: a random per-process prefix and a counter, 32 hex
    digits like a uuid4's, unique across processes and replicas without os.urandom per request."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count()

    def new(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"
