"""The P/D splice: what the client sees of a disaggregated request is what one worker would
have sent. The prefill answer's first token is turned into the stream's opening events (sent
at once), a request the first token already finished gets its closing events, and a
non-streaming answer is the first token's text followed by the decode worker's."""

from __future__ import annotations

from pdserve.protocol.responses import (ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, CompletionChoice,
                                        CompletionChunk, CompletionResponse, Delta)
from pdserve.protocol.sse import DONE

Answer = ChatCompletionResponse | CompletionResponse


def _ids(answer: Answer) -> dict:
    return {"id": answer.id, "created": answer.created, "model": answer.model}


def first_token_events(answer: Answer) -> bytes:
    """The events a single worker would have sent for the first token."""
    choice = answer.choices[0]
    if isinstance(answer, ChatCompletionResponse):
        role = ChatCompletionChunk(**_ids(answer), choices=[ChatChunkChoice(delta=Delta(role="assistant", content=""))])
        token = ChatCompletionChunk(**_ids(answer), choices=[
            ChatChunkChoice(delta=Delta(content=choice.message.content or ""), logprobs=choice.logprobs)])
        return role.sse() + token.sse()
    return CompletionChunk(**_ids(answer), choices=[CompletionChoice(text=choice.text, logprobs=choice.logprobs)]).sse()


def closing_events(answer: Answer, include_usage: bool) -> bytes:
    """The rest of a stream whose first token also ended it (EOS or a stop on token one)."""
    finish = answer.choices[0].finish_reason
    if isinstance(answer, ChatCompletionResponse):
        last = ChatCompletionChunk(**_ids(answer), choices=[ChatChunkChoice(delta=Delta(), finish_reason=finish)])
        usage = ChatCompletionChunk(**_ids(answer), choices=[], usage=answer.usage)
    else:
        last = CompletionChunk(**_ids(answer), choices=[CompletionChoice(finish_reason=finish)])
        usage = CompletionChunk(**_ids(answer), choices=[], usage=answer.usage)
    out = last.sse()
    if include_usage and answer.usage is not None:
        out += usage.sse()
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
            lp_rest["text_offset"] = (lp_first.get("text_offset") or []) + [
                o + len(head) for o in lp_rest.get("text_offset") or []]
    decode.kv_transfer_params = None
    return decode
