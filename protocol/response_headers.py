"""Setting one header on a Starlette response's raw headers, the way its `MutableHeaders` does."""

from __future__ import annotations

from operator import itemgetter

from starlette.responses import Response

_NAME = itemgetter(0)


def set_header(response: Response, name: bytes, value: bytes) -> None:
    """`response.headers[name] = value` (`name` lowercase) on the response's raw headers: the
    first header of that name replaced, later ones dropped, else appended, as Starlette's
    MutableHeaders does, without making one (through a failed `hasattr`) per response."""
    raw = response.raw_headers
    if name not in map(_NAME, raw):  # the common case, a name not there yet (scanned in C)
        raw.append((name, value))
        return
    at = None
    for i in range(len(raw) - 1, -1, -1):
        if raw[i][0] == name:
            if at is not None:
                del raw[at]
            at = i
    if at is None:
        raw.append((name, value))
    else:
        raw[at] = (name, value)
