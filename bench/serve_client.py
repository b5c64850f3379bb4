"""One streamed OpenAI request, timed the way vLLM's benchmark times it.

The clock starts when the request is written and every content chunk is stamped on arrival,
before its JSON is parsed. aiohttp rather than httpx or the `openai` client: per chunk it costs
a few microseconds, so the load generator stays far from being the bottleneck (see
bench/serve_ceiling.py for the measured ceiling).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from pdserve.bench.dataset import RequestSpec
from pdserve.bench.serve_metrics import RequestResult

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def payload(endpoint: str, model: str, spec: RequestSpec, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": spec.output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    return body


def _error_type(status: int, text: str) -> str:
    """'http_429:rate_limit_exceeded' from an OpenAI error body, else 'http_STATUS'."""
    try:
        err = json.loads(text)["error"]
        kind = err.get("type") or err.get("code")
        return f"http_{status}:{kind}" if kind else f"http_{status}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"http_{status}"


async def stream_request(session: aiohttp.ClientSession, url: str, endpoint: str, model: str,
                         spec: RequestSpec, ignore_eos: bool = True) -> RequestResult:
    r = RequestResult(prompt_len=spec.prompt_len, output_len=spec.output_len)
    chat = endpoint == "chat"
    chunks = 0
    done = False
    last = 0.0
    r.start = time.perf_counter()
    try:
        async with session.post(url, json=payload(endpoint, model, spec, ignore_eos)) as resp:
            if resp.status != 200:
                r.error = _error_type(resp.status, await resp.text())
                return r
            async for line in resp.content:
                now = time.perf_counter()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    err = obj["error"]
                    r.error = f"stream_error:{err.get('type') or err.get('code') or 'unknown'}"
                    return r
                if obj.get("usage"):
                    r.output_tokens = obj["usage"].get("completion_tokens", 0)
                    r.server_prompt_tokens = obj["usage"].get("prompt_tokens")
                choices = obj.get("choices")
                if not choices:
                    continue
                c = choices[0]
                text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                if not text:
                    continue
                if chunks == 0:
                    r.ttft = now - r.start
                else:
                    r.itls.append(now - last)
                last = now
                chunks += 1
            r.e2e = time.perf_counter() - r.start
    except asyncio.TimeoutError:
        r.error = "timeout"
        return r
    except aiohttp.ClientResponseError as e:
        r.error = f"http_{e.status}"
        return r
    except aiohttp.ClientPayloadError:  # the body ended before its chunked terminator
        r.error = "stream_truncated"
        return r
    except (aiohttp.ClientConnectionError, ConnectionError) as e:
        r.error = f"connection:{type(e).__name__}"
        return r
    except ValueError:
        r.error = "bad_sse_json"
        return r
    if not done:
        r.error = "stream_truncated"
    elif chunks == 0:
        r.error = "no_output"
    else:
        r.output_tokens = r.output_tokens or chunks
        if ignore_eos and r.output_tokens < spec.output_len:
            r.error = "short_output"
    return r
