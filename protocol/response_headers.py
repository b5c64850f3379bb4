"""Setting one header on a Starlette response's raw headers, the way its `MutableHeaders` does."""

from __future__ import annotations

from starlette.responses import Response


def set_header(response: Response, name: bytes, value: bytes) -> None:
    """`response.headers[name] = value` (`name` lowercase) on the response's raw headers: the
    first header of that name replaced, later ones dropped, else appended, as Starlette's
    MutableHeaders does, without making one (through a failed `hasattr`) per response."""
    raw = response.raw_headers
    for present, _ in raw:  # the common case, a name not there yet: a plain scan, then append
        if present == name:
            break
    else:
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
