"""POST /v1/completions: text (or token-id) prompts, one or several, n samples each."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import Response
from starlette.requests import Request

from pdserve.protocol.requests import CompletionRequest
from pdserve.protocol.responses import CompletionChoice, CompletionChunk, CompletionResponse
from pdserve.protocol.sse import DONE, SSEResponse
from pdserve.worker.request.outputs import TokenLogprob
from pdserve.worker.server import echo, serving
from pdserve.worker.server.prompt_logprobs import engine_top_n, prompt_logprobs_field
from pdserve.worker.server.sampling import sampling_params


def format_logprobs(tokenizer, lps: list[TokenLogprob], offset: int) -> dict:
    """Legacy completions shape; `offset` is the choice's text length before these tokens."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s = tokenizer.decode([lp.token_id])
        tokens.append(s)
        token_lps.append(lp.logprob)
        tops.append({tokenizer.decode([t]): v for t, v in lp.top} or None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _tokenize(state, prompts: list) -> list[list[int]]:
    """Each prompt's token ids (on a thread: an 8 MB prompt takes the tokenizer seconds); a text
    too long for any tokenization to fit is refused before any is tokenized, and text prompts'
    tokens count against --max-request-prompt-tokens as token ids do (protocol/request_limits.py)."""
    for p in prompts:
        if isinstance(p, str):
            serving.check_text_length(p, state.max_prompt_chars, state.max_model_len, "prompt")
    out = [state.tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str)
           else serving.check_token_ids(p, state.vocab_size, "prompt") for p in prompts]
    state.limits.check_prompt_tokens(sum(len(p) for p in out), "prompt")
    return out


async def create_completion(state, request: Request, body: CompletionRequest):
    body.check_unsupported()
    lora = await serving.resolve_model_of(state, body.model, body.kv_transfer_params)
    tok = state.tokenizer
    prompts = await serving.off_loop(_tokenize, state, body.prompts())
    only_prompt = echo.echo_only(body)
    max_tokens = serving.resolve_max_tokens(1 if only_prompt else body.max_tokens, prompts, state.max_model_len,
                                            "prompt", "max_tokens")
    serving.check_decode_budget(body.kv_transfer_params, prompts, state.max_model_len, "prompt")
    params = sampling_params(body, max_tokens, body.logprobs, "logprobs", engine_top_n(body))
    echoer = echo.Echo(tok, body, prompts, body.n, only_prompt) if body.echo else None
    kv_params = serving.kv_transfer_params(body.kv_transfer_params, len(prompts) * body.n)
    continued = serving.continued(state, body, len(prompts) * body.n)
    rid = serving.new_id("cmpl")
    gen = state.new_generation(rid, prompts, params, body.n, kv_params, continued, lora,
                               trace_headers=request.headers)
    first, events = await serving.start(request, gen)
    # A router sends one X-Request-Id to prefill and decode: the client sees one id. Engine
    # request ids stay unique per worker whatever the header says.
    base = {"id": serving.response_id(request, "cmpl", rid), "created": serving.now(),
            "model": lora or state.served_model_name}
    if body.stream:
        # Logprob text offsets continue after the first token's text a prefill worker returned.
        if continued:  # each choice's text on the lost worker: what the client has, as the router counted it
            given = body.continuation.text_offset or [None] * len(continued[0])
            offsets = [len(serving.handed_over_text(tok, prompts[i // body.n], params, None, ids)) if given[i] is None
                       else given[i] for i, ids in enumerate(continued[0])]
        else:
            offsets = [len(serving.handed_over_text(tok, prompts[0], params, kv_params))] * len(gen)
        report = serving.reports_token_ids(request)
        return SSEResponse(_stream(state, body, prompts, base, first, events, offsets, echoer, report, continued),
                           headers=serving.token_ids_headers(report))

    def answer(choices: list[serving.ChoiceState]) -> CompletionResponse:
        out = CompletionResponse(**base, choices=[
            CompletionChoice(index=i, text="".join(c.text),
                             logprobs=format_logprobs(tok, c.logprobs, 0) if body.logprobs is not None else None,
                             finish_reason=c.final.finish_reason if c.final else "abort",
                             stop_reason=c.final.stop_reason if c.final else None,
                             prompt_logprobs=None if body.prompt_logprobs is None else prompt_logprobs_field(
                                 tok, prompts[i // body.n], c.prompt_logprobs, body.prompt_logprobs))
            for i, c in enumerate(choices)
        ], usage=serving.usage(prompts, body.n, choices),
            kv_transfer_params=serving.handed_params(choices))
        if echoer is not None:
            for i, c in enumerate(choices):
                echoer.prompt_lps[i] = c.prompt_logprobs
                echoer.choice(i, out.choices[i])
            echoer.usage(out.usage)
        return out

    if serving.announced(first):  # a streamed prefill: its params now, the answer when it ends
        return serving.handoff_response(request, first, events, len(gen), answer)
    choices = await serving.collect(request, first, events, len(gen))
    return Response(answer(choices).model_dump_json(), media_type="application/json")


async def _stream(state, body: CompletionRequest, prompts, base: dict, first, events,
                  text_offsets: list[int], echoer: echo.Echo | None = None, report_ids: bool = False,
                  continued=None) -> AsyncIterator[bytes]:
    """`text_offsets`: per choice, the length of its text another worker sent (logprob offsets)."""
    choices = serving.continued_choices([serving.ChoiceState() for _ in text_offsets], continued)
    text_len = list(text_offsets)

    def chunk(i: int, out) -> bytes:
        return serving.with_token_ids(report_ids, i, out, text_chunk(i, out))

    def text_chunk(i: int, out) -> bytes:
        if out.handed_over_text is not None:  # a streamed hand-off: offsets continue after the first token
            text_len[i] = len(out.handed_over_text)
        choices[i].add(out)
        if echoer is not None:
            echoer.see(i, out)
        if not (out.text or out.finished or (out.logprobs and body.logprobs is not None)):
            return b""
        lps = None
        if body.logprobs is not None:
            lps = format_logprobs(state.tokenizer, out.logprobs or [], text_len[i])
        text_len[i] += len(out.text)
        c = CompletionChoice(index=i, text=out.text, logprobs=lps,
                             finish_reason=out.finish_reason if out.finished else None,
                             stop_reason=out.stop_reason if out.finished else None)
        if echoer is not None:
            echoer.choice(i, c)
        return CompletionChunk(**base, choices=[c]).sse()

    try:
        if b := chunk(*first):
            yield b
        async for i, out in events:
            if b := chunk(i, out):
                yield b
        if body.include_usage:
            usage = serving.usage(prompts, body.n, choices)
            yield CompletionChunk(**base, choices=[], usage=echoer.usage(usage) if echoer else usage).sse()
    except Exception as e:
        yield serving.stream_error(e)
    finally:
        await events.aclose()
    yield DONE
