"""What happened to one request under faults: completed, a typed error, or broken.

"Typed error" is what the stack promises when it cannot answer: an HTTP error with OpenAI's
error JSON before the stream starts, or one SSE error event and [DONE] after it (the `openai`
client raises `APIError` with that event's `error` object as `body`). "Broken" is everything
else — a reset connection, a stream that ends without a finish reason, a request still open
when the client's timeout fires — and no fault test tolerates one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import openai


@dataclass(frozen=True)
class Outcome:
    kind: str  # "completed" | "error" | "broken"
    detail: str = ""
    chunks: int = 0

    def __str__(self) -> str:
        return f"{self.kind}({self.detail}, {self.chunks} chunks)"


def typed(body) -> str | None:
    """The error's code/type if `body` is OpenAI's error object (or a wrapper of one)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        body = body["error"]
    if isinstance(body, dict) and isinstance(body.get("message"), str) and "type" in body:
        return str(body.get("code") or body["type"])
    return None


def stream_request(client: openai.OpenAI, model: str, i: int, max_tokens: int = 24,
                   progress: threading.Event | None = None, prompt_words: int = 20, after_chunks: int = 4) -> Outcome:
    """One streamed request (even i: chat, odd i: completions) that cannot stop at EOS, so it
    is still running when a fault hits; distinct prompts so no two share a prefix-cache hit.
    `progress` is set after `after_chunks` chunks: past the first token (which, in P/D, the
    router sends from the prefill answer), the decode worker is streaming."""
    text = f"Request {i}: " + " ".join(f"word{i}-{k}" for k in range(prompt_words))
    chunks, finish = 0, None
    try:
        if i % 2 == 0:
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                    max_tokens=max_tokens, stream=True, temperature=0,
                                                    extra_body={"ignore_eos": True})
        else:
            stream = client.completions.create(model=model, prompt=text, max_tokens=max_tokens, stream=True,
                                               temperature=0, extra_body={"ignore_eos": True})
        for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if progress is not None and chunks >= after_chunks:
                progress.set()
    except (openai.APIConnectionError, openai.APITimeoutError) as e:  # subclasses of APIError: first
        return Outcome("broken", f"{type(e).__name__}: {e}", chunks)
    except openai.APIError as e:
        code = typed(e.body)
        return Outcome("error", code, chunks) if code else Outcome("broken", f"untyped {e!r}", chunks)
    finally:
        if progress is not None:
            progress.set()  # a request that ended early must not block the test
    if finish in ("stop", "length"):
        return Outcome("completed", finish, chunks)
    return Outcome("broken", f"stream ended without a finish reason (finish={finish})", chunks)


def unary_request(client: openai.OpenAI, model: str, question: str, max_tokens: int = 24) -> Outcome:
    try:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=max_tokens, temperature=0)
    except (openai.APIConnectionError, openai.APITimeoutError) as e:
        return Outcome("broken", f"{type(e).__name__}: {e}")
    except openai.APIStatusError as e:
        code = typed(e.body)
        return Outcome("error", code) if code else Outcome("broken", f"untyped {e!r}")
    return Outcome("completed", r.choices[0].message.content or "")
