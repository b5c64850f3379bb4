"""A whole answer (status, headers and body in hand) written in one go, past uvicorn's `send`.

An ASGI answer is two `send` calls (its start, then its body), and uvicorn's `send` checks each
header's name and value against two regular expressions, its own `server` and `date` too (12
searches for a JSON answer of the router's), and writes the head and the body apart (the held
head, protocol/held_head.py, then holds the first on a loop callback until the second). For an
answer whose body is in hand, `send_whole` does what those two calls do, in one write: the same
checks (one search over the names, one over the values: the patterns are character classes,
so a match in the joined bytes is a match in one of them; the names are joined with nothing, the
values with a tab, which a value may hold), the same bytes on the wire, the same state left on
uvicorn's request cycle (`response_started`, `response_complete`, the cycle's event set, the
connection closed unless kept alive, the protocol told the response is over).

The scope carries (a weak reference to) the cycle under `CYCLE` when the server's protocol is
pdserve's (protocol/http_limits.py); elsewhere (a test client, another server) there is none,
and the answer takes the ordinary `send`.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, RequestResponseCycle

from pdserve.protocol.held_head import HeldHead

CYCLE = "pdserve.cycle"  # a request's scope key: a weak reference to uvicorn's RequestResponseCycle for it


def writes_whole(cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether `send_whole` writes this answer as uvicorn's `send` would: a plain answer (a body
    allowed, delimited by its `content-length`, which the headers carry), not a HEAD request's,
    with no access log to write, the connection's handling left to the server (no `connection`
    or `transfer-encoding` header of the application's)."""
    if (cycle.response_started or cycle.access_log or status in (204, 304) or status < 200
            or cycle.scope["method"] == "HEAD"):
        return False
    length = False
    for name, _ in headers:
        name = name.lower()
        if name == b"content-length":
            length = True
        elif name == b"connection" or name == b"transfer-encoding":
            return False
    return length


async def send_whole(cycle: RequestResponseCycle, status: int, headers: list[tuple[bytes, bytes]],
                     body: bytes) -> None:
    """`send({"type": "http.response.start", ...})` then `send({"type": "http.response.body",
    "body": body})` on uvicorn's `cycle`, for an answer `writes_whole` accepted; raises what
    uvicorn's `send` raises for a bad header or a `content-length` that is not the body's (having
    written nothing, where uvicorn has written the head of a body of the wrong length; the
    server then closes the connection either way)."""
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    if cycle.disconnected:
        return
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    all_headers = cycle.default_headers + headers
    names, values, lines = [], [], [STATUS_LINE[status]]
    length = -1
    for name, value in all_headers:
        names.append(name)
        values.append(value)
        name = name.lower()
        if name == b"content-length" and length < 0:
            length = int(value.decode())
        lines += (name, b": ", value, b"\r\n")
    if HEADER_RE.search(b"".join(names)):
        raise RuntimeError("Invalid HTTP header name.")
    if HEADER_VALUE_RE.search(b"\t".join(values)):
        raise RuntimeError("Invalid HTTP header value.")
    if length != len(body):
        raise RuntimeError(f"Response content {'longer' if len(body) > length else 'shorter'} than Content-Length")
    if not cycle.keep_alive:
        lines.append(b"connection: close\r\n")
    lines += (b"\r\n", body)
    data = b"".join(lines)
    transport = cycle.transport
    if isinstance(transport, HeldHead):
        transport.write_last(data)
    else:
        transport.write(data)
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        transport.close()
    cycle.on_response()
