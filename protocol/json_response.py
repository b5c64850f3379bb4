"""A JSON answer from bytes already serialised (a worker's answer passed through, a model's dump).

`Response(body, media_type="application/json")` renders its content and builds its headers
through Starlette's general path (a mapping, case folding, a charset check) for every answer;
`JSONBytes(body)` is that same response (status, headers in that order, body) made directly.
"""

from __future__ import annotations

from starlette.responses import Response


class JSONBytes(Response):
    media_type = "application/json"

    def __init__(self, body: bytes, status_code: int = 200):
        self.status_code = status_code
        self.background = None
        self.body = body
        self.raw_headers = [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")]
