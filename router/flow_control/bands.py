"""A request's priority band: vLLM's `priority` field (an int, lower is served sooner, default 0)
or the `x-pdserve-priority` header, which wins (a gateway in front sets it for the client).

Only the configured bands are accepted (`--flow-control-bands`): each band is a queue and a
metric label, so a client must not be able to mint new ones; anything else is a 400 naming them.
"""

from __future__ import annotations

import re

from pdserve.protocol.errors import APIError

PRIORITY_HEADER = "x-pdserve-priority"
_INT = re.compile(r"-?[0-9]{1,9}")


def band_of(body_priority: int, header: str | None, bands: tuple[int, ...]) -> int:
    """The band this request queues in, or a 400 (a malformed header, an unknown priority)."""
    priority, source = body_priority, "priority"
    if header is not None:
        if not _INT.fullmatch(header.strip()):
            raise APIError(400, f"header {PRIORITY_HEADER} must be an integer, not {header[:40]!r}",
                           param=PRIORITY_HEADER, code="invalid_priority")
        priority, source = int(header), PRIORITY_HEADER
    if priority not in bands:
        raise APIError(400, f"{source} {priority} is not a priority this router serves "
                            f"(one of {', '.join(map(str, bands))}; lower is served sooner)",
                       param=source, code="invalid_priority")
    return priority
