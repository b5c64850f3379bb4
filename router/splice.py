"""The P/D splice: what the client sees of a disaggregated request is what one worker would
have sent. The prefill answer's first token is turned into the stream's opening events (sent
at once), a request the first token already finished gets its closing events, and a
non-streaming answer is the first token's text followed by the decode worker's."""

from __future__ import annotations

from pdserve.protocol.responses import (ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, CompletionChoice,
                                        CompletionChunk, CompletionResponse, Delta)
from pdserve.protocol.sse import DONE
from pdserve.router.sse import CountedEvents

Answer = ChatCompletionResponse | CompletionResponse


def _ids(answer: Answer) -> dict:
    return {"id": answer.id, "created": answer.created, "model": answer.model}


def first_token_ended(answer: Answer) -> bool:
    """The prefill's first token ended the request (EOS or a stop; then no params are returned):
    nothing is left to decode."""
    return not answer.kv_transfer_params or answer.choices[0].finish_reason not in (None, "length")


def first_token_events(answer: Answer, finished: bool = False) -> bytes:
    """The events a single worker would have sent for the first token: its text as the prefill
    released it (possibly "" while a stop string or a character may still be completing), sent
    when there is text or logprobs to carry, as the worker's own stream does; with `finished`,
    the first token also ended the request and its finish is part of the events. Counted: one
    of them carries a token when the text or the logprobs say something (router/sse.py)."""
    choice = answer.choices[0]
    finish = dict(finish_reason=choice.finish_reason, stop_reason=choice.stop_reason) if finished else {}
    if isinstance(answer, ChatCompletionResponse):
        out = ChatCompletionChunk(**_ids(answer), choices=[
            ChatChunkChoice(delta=Delta(role="assistant", content=""))]).sse()
        text = choice.message.content or ""
        if text or choice.logprobs:
            out += ChatCompletionChunk(**_ids(answer), choices=[
                ChatChunkChoice(delta=Delta(content=text), logprobs=choice.logprobs)]).sse()
        if finished:
            out += ChatCompletionChunk(**_ids(answer), choices=[ChatChunkChoice(delta=Delta(), **finish)]).sse()
        return CountedEvents(out, 1 if text or choice.logprobs else 0)
    if not (choice.text or choice.logprobs is not None or finished):
        return b""
    return CountedEvents(CompletionChunk(**_ids(answer), choices=[
        CompletionChoice(text=choice.text, logprobs=choice.logprobs, **finish)]).sse(),
        1 if choice.text or choice.logprobs else 0)


def closing_events(answer: Answer, include_usage: bool) -> bytes:
    """The end of a stream whose first token also ended it (EOS or a stop on token one)."""
    out = b""
    if include_usage and answer.usage is not None:
        kind = ChatCompletionChunk if isinstance(answer, ChatCompletionResponse) else CompletionChunk
        out += kind(**_ids(answer), choices=[], usage=answer.usage).sse()
    return out + DONE


def merge_unary(prefill: Answer, decode: Answer) -> Answer:
    """The whole answer of a non-streaming P/D request: first token + decode text; the decode
    worker's usage already counts the whole request once."""
    first, rest = prefill.choices[0], decode.choices[0]
    lp_first, lp_rest = first.logprobs, rest.logprobs
    if isinstance(decode, ChatCompletionResponse):
        rest.message.content = (first.message.content or "") + (rest.message.content or "")
        if lp_first and lp_rest:
            lp_rest["content"] = (lp_first.get("content") or []) + (lp_rest.get("content") or [])
    else:
        head = first.text
        rest.text = head + rest.text
        if lp_first and lp_rest:
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                lp_rest[key] = (lp_first.get(key) or []) + (lp_rest.get(key) or [])
            # Offsets count each token's own text (as the worker does), not the released text.
            tokens, offsets = lp_first.get("tokens") or [], lp_first.get("text_offset") or []
            base = offsets[-1] + len(tokens[-1]) if tokens and offsets else 0
            lp_rest["text_offset"] = offsets + [o + base for o in lp_rest.get("text_offset") or []]
    decode.kv_transfer_params = None
    return decode
