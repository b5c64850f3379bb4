"""Who a request belongs to, for fairness and per-tenant limits: llm-d's fairness header
`x-gateway-inference-fairness-id` when present, else the client's API key (hashed: a key must
never become a metric label or a log line), else one shared tenant."""

from __future__ import annotations

import hashlib
import re

from pdserve.protocol.errors import APIError

FAIRNESS_HEADER = "x-gateway-inference-fairness-id"
ANONYMOUS = "anonymous"
_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")


def tenant_of(fairness_id: str | None, authorization: str | None) -> str:
    """The tenant's name, or a 400 for a fairness header that is not a short plain identifier."""
    if fairness_id is not None:
        if not _ID.fullmatch(fairness_id):
            raise APIError(400, f"header {FAIRNESS_HEADER} must be 1-128 characters of letters, digits and ._:@/-",
                           param=FAIRNESS_HEADER, code="invalid_fairness_id")
        return fairness_id
    if authorization:
        key = authorization.removeprefix("Bearer ").strip()
        if key:
            return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return ANONYMOUS
