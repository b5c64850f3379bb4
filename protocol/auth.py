"""API-key check (`Authorization: Bearer <key>`), the same on the router and the worker."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from pdserve.protocol.errors import APIError


def authorize(request: Request, keys: tuple[bytes, ...]) -> None:
    """Raise 401 unless the request carries one of `keys` (no keys: everything is allowed).
    Compared in constant time, so the answer's timing tells nothing about a key's prefix."""
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.strip().encode(), k) for k in keys):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
