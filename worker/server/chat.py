"""POST /v1/chat/completions: messages through the model's chat template, n samples."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi.responses import Response
from starlette.requests import Request

from pdserve.protocol.chat_render import ChatTemplates, render_chat
from pdserve.protocol.errors import APIError
from pdserve.protocol.requests import ChatCompletionRequest
from pdserve.protocol.responses import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                        ChatCompletionResponse, Delta)
from pdserve.protocol.sse import DONE, SSEResponse, event
from pdserve.worker.request.outputs import TokenLogprob
from pdserve.worker.server import serving
from pdserve.worker.server.prompt_logprobs import engine_top_n, first_entries, prompt_logprobs_field
from pdserve.worker.server.sampling import sampling_params
from pdserve.worker.server.tool_parsers import get_parser
from pdserve.worker.server.tool_parsers.harmony import HarmonyParser
from pdserve.worker.server.tool_parsers.plan import (StreamedCalls, ToolPlan, complete_reply, finish_reason,
                                                     plan_tools, reasoning_tokens, template_input)


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    s = tokenizer.decode([token_id])
    return s, list(s.encode("utf-8"))


def format_logprobs(tokenizer, lps: list[TokenLogprob]) -> dict:
    content = []
    for lp in lps:
        s, b = _token(tokenizer, lp.token_id)
        top = []
        for t, v in lp.top:
            ts, tb = _token(tokenizer, t)
            top.append({"token": ts, "logprob": v, "bytes": tb})
        content.append({"token": s, "logprob": lp.logprob, "bytes": b, "top_logprobs": top})
    return {"content": content}


def render_prompt(templates: ChatTemplates, body: ChatCompletionRequest, tools: ToolPlan = ToolPlan(),
                  parser_name: str | None = None) -> list[int]:
    """The prompt's token ids (any thread: the server runs it off its event loop). A rendered
    text too long for --max-model-len whatever its tokens is refused before it is tokenized."""
    fallback = get_parser(parser_name) if parser_name else None
    text = render_chat(templates, body, tools.tools, lambda msgs, source: template_input(msgs, tools, source, fallback))
    # A forced tool call starts the reply; its grammar does the rest (tool_parsers/plan.py).
    text += tools.forced_prefix
    serving.check_text_length(text, templates.max_chars, templates.max_model_len, "messages")
    # The template writes the special tokens itself (BOS, role markers): add none on top.
    return templates.tokenizer(text, add_special_tokens=False)["input_ids"]


async def create_chat_completion(state, request: Request, body: ChatCompletionRequest):
    body.check_unsupported()
    lora = await serving.resolve_model_of(state, body.model, body.kv_transfer_params)
    cfg = state.config
    tools = plan_tools(body, cfg.tool_call_parser, cfg.enable_auto_tool_choice)
    harmony = cfg.harmony_flag is not None
    if harmony and tools.parser is None:  # no tools: the reply is still read by channel (reasoning, final)
        tools = dataclasses.replace(tools, parser=HarmonyParser(), calls=False)
    prompt = await serving.off_loop(render_prompt, state.chat_templates, body, tools, cfg.tool_call_parser)
    max_tokens = serving.resolve_max_tokens(body.requested_max_tokens, [prompt], state.max_model_len,
                                            "messages", body.max_tokens_param)
    serving.check_decode_budget(body.kv_transfer_params, [prompt], state.max_model_len, "messages")
    params = sampling_params(body, max_tokens, body.num_logprobs, "top_logprobs", engine_top_n(body))
    if tools.grammar is not None:  # a forced tool call (response_format with it is refused already)
        params = dataclasses.replace(params, structured=tools.grammar)
    if harmony:  # the channel markers are special tokens: kept in the text for the parser
        params = dataclasses.replace(params, skip_special_tokens=False)
    kv_params = serving.kv_transfer_params(body.kv_transfer_params, body.n)
    continued = serving.continued(state, body, body.n)
    rid = serving.new_id("chatcmpl")
    gen = state.new_generation(rid, [prompt], params, body.n, kv_params, continued, lora,
                               trace_headers=request.headers)
    first, events = await serving.start(request, gen)
    # A router sends one X-Request-Id to prefill and decode: the client sees one id. Engine
    # request ids stay unique per worker whatever the header says.
    base = {
        "id": serving.response_id(request, "chatcmpl", rid),
        "created": serving.now(),
        "model": lora or state.served_model_name,
    }
    # A decode worker's reply continues after the prefill's first token: the parser reads that
    # token's text first (known now, or told by the engine for a streamed hand-off).
    handed = serving.handed_over_text(state.tokenizer, prompt, params, kv_params) if tools.parser else ""
    if body.stream:
        # A continuation's text so far went out from the lost worker: its tool-call parser state is
        # rebuilt from it, and no role chunk opens the rest.
        sent = [serving.handed_over_text(state.tokenizer, prompt, params, None, ids)
                for ids in (continued[0] if continued else ())]
        report = serving.reports_token_ids(request)
        return SSEResponse(_stream(state, body, prompt, base, first, events, tools, harmony, handed, sent, report,
                                   continued), headers=serving.token_ids_headers(report))

    def answer(choices: list[serving.ChoiceState]) -> ChatCompletionResponse:
        messages = [complete_reply(tools, "".join(c.text), handed or c.handed_over_text) for c in choices]
        thought = sum(reasoning_tokens(tools, c.text, c.piece_tokens, handed or c.handed_over_text)
                      for c in choices) if harmony else None
        return ChatCompletionResponse(**base, choices=[
            ChatChoice(index=i, message=AssistantMessage(content=content, reasoning_content=reasoning,
                                                         **({"tool_calls": calls} if calls else {})),
                       logprobs=format_logprobs(state.tokenizer, c.logprobs) if body.logprobs else None,
                       finish_reason=finish_reason(c.final.finish_reason, bool(calls)) if c.final else "abort",
                       stop_reason=c.final.stop_reason if c.final else None)
            for i, (c, (content, calls, reasoning)) in enumerate(zip(choices, messages))
        ], usage=serving.usage([prompt], body.n, choices, thought),
            kv_transfer_params=serving.handed_params(choices),
            prompt_logprobs=None if body.prompt_logprobs is None else prompt_logprobs_field(
                state.tokenizer, prompt, first_entries(choices), body.prompt_logprobs))

    if serving.announced(first):  # a streamed prefill: its params now, the answer when it ends
        return serving.handoff_response(request, first, events, body.n, answer)
    choices = await serving.collect(request, first, events, body.n)
    return Response(answer(choices).model_dump_json(), media_type="application/json")


async def _stream(state, body: ChatCompletionRequest, prompt, base: dict, first, events,
                  tools: ToolPlan = ToolPlan(), harmony: bool = False, handed: str = "", sent: list[str] = (),
                  report_ids: bool = False, continued=None) -> AsyncIterator[bytes]:
    choices = serving.continued_choices([serving.ChoiceState() for _ in range(body.n)], continued)
    calls = [StreamedCalls(tools, handed) for _ in range(body.n)]
    for parser, text in zip(calls, sent):
        parser.feed(text, False)

    def chunk(i: int, delta: Delta, logprobs=None, finish_reason=None, stop_reason=None) -> bytes:
        c = ChatChunkChoice(index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                            stop_reason=stop_reason)
        return ChatCompletionChunk(**base, choices=[c]).sse()

    def chunks(i: int, out):
        choices[i].add(out)
        if out.handed_over_text is not None:  # a streamed hand-off: the first token is known now
            calls[i].prime(out.handed_over_text)
        lps = format_logprobs(state.tokenizer, out.logprobs) if body.logprobs and out.logprobs else None
        try:
            text, tool_deltas = calls[i].feed(out.text, out.finished, len(out.new_token_ids))
        except APIError as e:  # a forced tool call that did not come: said once, in OpenAI's shape
            yield event(e.body())
            return
        if calls[i].reasoning:
            yield chunk(i, Delta(reasoning_content=calls[i].reasoning))
        if text or lps:
            yield chunk(i, Delta(content=text), lps)
        for d in tool_deltas:
            yield chunk(i, Delta(tool_calls=[d]))
        if out.finished:
            reason = finish_reason(out.finish_reason, calls[i].num_calls > 0)
            yield chunk(i, Delta(), None, reason, out.stop_reason)

    def output(i: int, out) -> bytes:
        """One output's events in one write: with its token ids, they reach the router together."""
        return serving.with_token_ids(report_ids, i, out, b"".join(chunks(i, out)))

    try:
        for i in range(0 if sent else body.n):  # every choice opens with its role, as OpenAI's stream does
            yield chunk(i, Delta(role="assistant", content=""))
        if b := output(*first):
            yield b
        async for i, out in events:
            if b := output(i, out):
                yield b
        if body.include_usage:
            thought = sum(c.reasoning_tokens for c in calls) if harmony else None
            yield ChatCompletionChunk(**base, choices=[], usage=serving.usage([prompt], body.n, choices, thought)).sse()
    except Exception as e:
        yield serving.stream_error(e)
    finally:
        await events.aclose()
    yield DONE
