"""Reading a request body: size limit first, then JSON, then (optionally) the pydantic model.

The limit is enforced on the declared Content-Length and again while reading, so a chunked
upload cannot get past it; nothing is parsed before the whole body is known to fit.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from pdserve.protocol.errors import APIError, bad_request, from_validation_error

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes; the limit is {limit}", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    return bytes(body)


def parse_object(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 saying why not."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    return obj


def validate(model: type[M], obj: dict) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def read_model(request: Request, model: type[M], limit: int) -> M:
    return validate(model, parse_object(await read_body(request, limit)))
