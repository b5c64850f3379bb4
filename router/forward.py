"""Requests the router hands whole to any one worker of their model: vLLM's `/tokenize` and
`/detokenize`. No P/D, no streaming: the first worker that answers (a decode worker, else a
prefill worker; every worker has the model's tokenizer) answers the client, its status and body
as they are. Holding, retrying (5xx, 429, transport errors) and releasing the worker is the
upstream call's, as on the request path; the worker key rides on the shared session.
"""

from __future__ import annotations

from starlette.responses import Response

from pdserve.protocol.contract import HEADER_REQUEST_ID, ROLE_DECODE, ROLE_PREFILL
from pdserve.protocol.errors import APIError
from pdserve.router.config import RouterConfig
from pdserve.router.selection import Selector
from pdserve.router.upstream import UPSTREAM_ERRORS, Upstream, timeout
from pdserve.router.upstream_call import UpstreamCall

PHASE = "utility"  # the phase label of its retries and upstream errors in the router's metrics


class Forwarder:
    def __init__(self, config: RouterConfig, upstream: Upstream, selector: Selector):
        self.up = upstream
        self.selector = selector
        self.max_retries = config.max_retries
        self.limits = timeout(config.request_timeout_s, config.connect_timeout_s)

    async def forward(self, path: str, payload: bytes, model: str, request_id: str) -> Response:
        """`payload`: the validated body, as JSON, naming `model`."""
        pool = self.selector.pool(ROLE_DECODE, model) or self.selector.pool(ROLE_PREFILL, model)
        if not pool:
            raise APIError(503, f"no healthy worker serves model {model!r}", code="no_workers")
        headers = {"content-type": "application/json", HEADER_REQUEST_ID: request_id}
        async with UpstreamCall(self.up, PHASE, pool, lambda ws: min(ws, key=lambda w: w.load),
                                self.max_retries) as call:
            while (response := await call.open(path, payload, headers, self.limits)) is not None:
                try:
                    content = await response.read()
                except UPSTREAM_ERRORS as e:
                    call.retry_elsewhere(repr(e))
                    continue
                call.succeeded()
                return Response(content, status_code=response.status, media_type="application/json")
            if call.last_status == 429:
                raise APIError(429, "every worker is overloaded", code="overloaded")
            raise APIError(502, f"{path} failed on every worker tried (last: {call.last_reason})",
                           code="upstream_failed")
