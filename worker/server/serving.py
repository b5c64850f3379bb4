"""What both OpenAI endpoints share: prompt limits, starting the engine before the response,
and the token-count bookkeeping behind `usage`.

Templating and tokenizing run off the event loop (`off_loop`): an 8 MB prompt takes the
tokenizer seconds, and the loop also answers /health. A text that cannot fit `--max-model-len`
whatever its tokens (longer than max_model_len tokens of the vocabulary's longest could cover)
is refused before it is tokenized at all.

The engine's first output is awaited *before* the response starts: anything the engine refuses
(a malformed `kv_transfer_params`, say) still becomes a proper HTTP error, and a router in front
can retry elsewhere because not a byte was sent. After that, a failure can only be reported
inside the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import StreamingResponse

from pdserve.protocol.contract import (CODE_REQUEST_FAILED, ENV_RUNTIME_LORA, HEADER_REQUEST_FAILED, HEADER_REQUEST_ID,
                                       request_id_from)
from pdserve.protocol.disconnect import ClientGone, unless_disconnected
from pdserve.protocol.continuation import HEADER_TOKEN_IDS, token_ids_event
from pdserve.protocol.continuation import PARAM as CONTINUATION
from pdserve.protocol.errors import APIError, bad_request, error_body
from pdserve.protocol.kv_transfer import (BUDGET, NDJSON, PARAM, KVTransferParams, RemoteDecodeRequest,
                                          is_remote_decode, wants_remote_decode)
from pdserve.protocol.responses import Usage
from pdserve.protocol.sse import event
from pdserve.worker.engine.detokenizer import IncrementalDetokenizer
from pdserve.worker.request.outputs import RequestOutput, TokenLogprob
from pdserve.worker.request.request import RequestFailed
from pdserve.worker.request.sampling_params import SamplingParams
from pdserve.worker.server.generation import Generation

log = logging.getLogger(__name__)

Events = AsyncIterator[tuple[int, RequestOutput]]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_id(request: Request, prefix: str, fallback: str) -> str:
    """OpenAI's id shape (`cmpl-…`, `chatcmpl-…`); with an X-Request-Id (a router sends one to
    prefill and decode) it is `{prefix}-{that id}`, as vLLM names it, so both legs agree (the
    id cut to --max-request-id-chars, as the router cuts it)."""
    limit = request.app.state.worker.limits.max_request_id_chars
    header = request_id_from(request.headers.get(HEADER_REQUEST_ID), limit)
    return f"{prefix}-{header}" if header else fallback


def now() -> int:
    return int(time.time())


def resolve_model(state, requested: str | None) -> str | None:
    """The LoRA adapter a request's `model` names, None for the base model; any other name is
    404 model_not_found, as vLLM answers it."""
    if requested is None or requested == state.served_model_name:
        return None
    lora = state.lora
    if lora is not None and lora.serves(requested):
        return requested
    check_model(requested, state.served_model_name)
    return None


async def resolve_model_of(state, requested: str | None, kv_params) -> str | None:
    """resolve_model, after loading the adapter a hand-off names where this worker lacks it
    (worker/lora/on_demand.py): refused 404 model_not_found without runtime loading, 400 naming
    the adapter and the reason when it cannot be loaded."""
    if (requested and requested != state.served_model_name and isinstance(kv_params, KVTransferParams)
            and kv_params.lora_name == requested and kv_params.lora_path and state.lora is not None
            and not state.lora.serves(requested)):
        if state.lora_loads is None:
            raise APIError(404, f"LoRA adapter {requested!r} of this hand-off is not loaded on this worker, and "
                                f"loading it needs {ENV_RUNTIME_LORA}=true", "model", "model_not_found")
        from pdserve.worker.lora.adapter import LoRAError

        try:
            await state.lora_loads.ensure(requested, kv_params.lora_path)
        except LoRAError as e:
            raise bad_request(f"cannot load the hand-off's LoRA adapter: {e}", "model") from None
    return resolve_model(state, requested)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist; this server serves `{served}`.",
                       "model", "model_not_found")


def kv_transfer_params(params: KVTransferParams | RemoteDecodeRequest | None,
                       num_sequences: int) -> KVTransferParams | RemoteDecodeRequest | None:
    """A request's params, parsed with its body (protocol/requests.py) into the object the engine
    carries. A hand-off is one sequence's (one prompt, one first token): several prompts or n > 1
    cannot share it."""
    if params and num_sequences != 1:
        raise bad_request(f"{PARAM} describe one sequence; this request has {num_sequences} "
                          "(a list of prompts or n > 1)", PARAM)
    return params


def handed_over_text(tokenizer, prompt: list[int], params: SamplingParams,
                     kv_params: KVTransferParams | RemoteDecodeRequest | None, continued: list[int] = ()) -> str:
    """On a decode worker: the text the prefill worker already returned for the handed-over first
    token (what its detokenizer released, detokenizer.py); for a continuation, the text its
    continued tokens released on the lost worker; "" for any other request."""
    if continued:
        ids = list(continued)
    elif not is_remote_decode(kv_params) or kv_params.first_token_id is None:
        return ""  # a streamed hand-off's first token is not known yet: the async layer tells it
    else:
        ids = [kv_params.first_token_id]
    return IncrementalDetokenizer(tokenizer, prompt, params.stop_strings,
                                  skip_special_tokens=params.skip_special_tokens).update(ids)[0]


def continued(state, body, num_sequences: int) -> tuple[list[list[int]], frozenset[int]] | None:
    """A continuation's token ids per choice and the choices that ended (protocol/continuation.py),
    checked against the request: one list per choice, ids of the vocabulary, streamed, and no
    other way of starting from given state (a P/D hand-off, echo)."""
    cont = body.continuation
    if cont is None:
        return None
    if len(cont.token_ids) != num_sequences or not all(0 <= i < num_sequences for i in cont.finished) \
            or len(set(cont.finished)) == num_sequences:
        raise bad_request(f"{CONTINUATION}.token_ids must hold one list per choice of this request "
                          f"({num_sequences}), and finished some of their indexes, not all", CONTINUATION)
    if cont.text_offset is not None and (len(cont.text_offset) != num_sequences
                                         or any(o is not None and o < 0 for o in cont.text_offset)):
        raise bad_request(f"{CONTINUATION}.text_offset must hold one length (>= 0, or null) per choice of this "
                          f"request ({num_sequences})", CONTINUATION)
    if body.kv_transfer_params or getattr(body, "echo", False) or not body.stream:
        raise bad_request(f"{CONTINUATION} continues a stream: it cannot be combined with "
                          f"{PARAM} or echo", CONTINUATION)
    # Prefilled like a prompt: bounded like one (--max-request-prompt-tokens).
    state.limits.check_prompt_tokens(sum(map(len, cont.token_ids)), CONTINUATION)
    for ids in cont.token_ids:
        check_token_ids(ids, state.vocab_size, CONTINUATION)
    return cont.token_ids, frozenset(cont.finished)


def continued_choices(choices: list[ChoiceState], continuation) -> list[ChoiceState]:
    """A continuation's choices that ended on the lost worker count their tokens in usage."""
    if continuation is not None:
        ids, finished = continuation
        for i in finished:
            choices[i].num_tokens = len(ids[i])
    return choices


def reports_token_ids(request: Request) -> bool:
    """The router asks for each choice's token ids in the stream (protocol/continuation.py)."""
    return request.headers.get(HEADER_TOKEN_IDS) == "1"


def token_ids_headers(report: bool) -> dict[str, str] | None:
    """A stream that reports its token ids says so: a router relays a worker's that does not
    (an older one) as it comes, without waiting for groups that never close."""
    return {HEADER_TOKEN_IDS: "1"} if report else None


def with_token_ids(report: bool, index: int, out: RequestOutput, events: bytes) -> bytes:
    """One output's SSE `events`, closed by its token-id event when `report` (protocol/continuation.py)."""
    return events + token_ids_event(index, out.new_token_ids) if report else events


async def off_loop(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a thread (the tokenizers run in Rust without the GIL, templates
    in Python that yields it): CPU-heavy work on a request's input never stalls the event loop."""
    return await asyncio.to_thread(fn, *args, **kwargs)


# Normalizers may drop characters (accents, controls) a token then does not cover: a wide margin.
TEXT_MARGIN = 4


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """Most characters a prompt that fits --max-model-len could have: that many tokens of the
    vocabulary's longest entry (a byte-level BPE entry spells one character per byte; a
    SentencePiece one, one per character), times TEXT_MARGIN. Computed once per loaded engine."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    return max_model_len * longest * TEXT_MARGIN


def check_text_length(text: str, max_chars: int, max_model_len: int, param: str) -> None:
    """Before tokenizing: refuse a text no tokenization could fit into --max-model-len
    (`max_chars`: max_prompt_chars of the worker's tokenizer)."""
    if len(text) > max_chars:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens (--max-model-len), but the "
            f"prompt is {len(text)} characters, more than that many tokens can hold; reduce the prompt.",
            param, "context_length_exceeded")


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    """Every id in the vocabulary: min and max at C speed; a walk, to name the first bad id,
    only for a prompt that has one."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise bad_request(f"token id {bad} is out of range for this model's vocabulary (0..{vocab_size - 1})", param)
    return ids


def resolve_max_tokens(requested: int | None, prompts: list[list[int]], max_model_len: int,
                       prompt_param: str, max_tokens_param: str) -> int:
    """Check every prompt fits `--max-model-len` with room for the completion; return max_tokens.
    The message opens as OpenAI's and vLLM's do: clients match that phrase (LiteLLM raises its
    ContextWindowExceededError, which drives its context-window fallbacks, on it)."""
    longest = max(len(p) for p in prompts)
    if any(len(p) == 0 for p in prompts):
        raise bad_request("the prompt must contain at least one token", prompt_param)
    if longest >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens (--max-model-len), "
            f"but the prompt has {longest} tokens, leaving no room for a completion.",
            prompt_param, "context_length_exceeded")
    if requested is None:
        return max_model_len - longest
    if requested < 1:
        raise bad_request(f"{max_tokens_param} must be at least 1, got {requested}", max_tokens_param)
    if longest + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens (--max-model-len), "
            f"but {longest + requested} were requested ({longest} in the prompt, {requested} "
            f"in the completion). Reduce the prompt or {max_tokens_param}.",
            max_tokens_param, "context_length_exceeded")
    return requested


def check_decode_budget(kv_params: dict | RemoteDecodeRequest | None, prompts: list[list[int]], max_model_len: int,
                        prompt_param: str) -> None:
    """On a prefill worker asked to hand its KV off: refuse now what the decode worker will
    refuse for the client's own budget (kv_transfer.decode_budget), so a request that cannot
    be served pins no KV for nothing. Callers that send no budget (vLLM's proxies) get no check."""
    if not wants_remote_decode(kv_params):
        return
    budget = kv_params.decode_budget if isinstance(kv_params, RemoteDecodeRequest) else kv_params.get(BUDGET)
    if not isinstance(budget, dict):
        return
    param = "max_completion_tokens" if "max_completion_tokens" in budget else "max_tokens"
    requested, min_tokens = budget.get(param), budget.get("min_tokens", 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (requested or 0, min_tokens)):
        raise bad_request(f"{PARAM}.{BUDGET} holds token counts, got {budget!r}", PARAM)
    max_tokens = resolve_max_tokens(requested, prompts, max_model_len, prompt_param, param)
    if not 0 <= min_tokens <= max_tokens:
        raise bad_request(f"min_tokens must be in [0, max_tokens], got {min_tokens}", "min_tokens")


async def start(request: Request, gen: Generation) -> tuple[tuple[int, RequestOutput], Events]:
    """Start all engine requests and wait for the first output (or a refusal)."""
    events = gen.stream()

    async def first():
        try:
            return await anext(events)
        except BaseException:
            await events.aclose()
            raise

    try:
        return await unless_disconnected(request, first()), events
    except RequestFailed as e:  # this request alone failed in an engine step; the engine serves on
        raise failed(e) from None
    except ValueError as e:  # the engine refused the request's content (RequestError, SamplingParamsError)
        raise bad_request(str(e), getattr(e, "param", None), getattr(e, "code", None)) from None
    except RuntimeError as e:  # EngineDeadError: the step loop is gone; the pod must restart
        log.error("engine unavailable for %s: %s", gen.request_id, e)
        raise APIError(503, str(e), code="engine_dead") from None
    except StopAsyncIteration:
        raise APIError(500, "the engine returned no output") from None
    except (APIError, ClientGone):
        raise
    except Exception as e:
        log.exception("engine failed on request %s", gen.request_id)
        raise APIError(500, f"engine error: {type(e).__name__}: {e}") from None


@dataclass
class ChoiceState:
    """One choice's accumulated output (non-streamed responses and usage)."""

    text: list[str] = field(default_factory=list)
    piece_tokens: list[int] = field(default_factory=list)  # each text piece's tokens (reasoning_tokens)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_tokens: int = 0
    final: RequestOutput | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # echo with logprobs
    handed_over_text: str = ""  # a streamed hand-off's first token's text, as the prefill released it

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.handed_over_text is not None:
            self.handed_over_text = out.handed_over_text
        self.text.append(out.text)
        self.piece_tokens.append(len(out.new_token_ids))
        self.num_tokens += len(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finished:
            self.final = out

    @property
    def num_output_tokens(self) -> int:
        # The engine's count includes a first token handed over by a prefill worker.
        return max(self.num_tokens, self.final.num_output_tokens if self.final else 0)


def usage(prompts: list[list[int]], n: int, choices: list[ChoiceState], reasoning_tokens: int | None = None) -> Usage:
    """`reasoning_tokens`: a reasoning model's (--reasoning-parser), as OpenAI's
    completion_tokens_details has it; None leaves the details out."""
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices)
    cached = sum(c.final.num_cached_tokens for c in choices[::n] if c.final)
    details = None if reasoning_tokens is None else {"reasoning_tokens": reasoning_tokens}
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, completion_tokens_details=details,
                 prompt_tokens_details={"cached_tokens": cached})


async def collect(request: Request, first: tuple[int, RequestOutput], events: Events,
                  num_choices: int) -> list[ChoiceState]:
    choices = [ChoiceState() for _ in range(num_choices)]
    choices[first[0]].add(first[1])

    async def rest():
        async with aclosing(events):
            async for i, out in events:
                choices[i].add(out)

    try:
        await unless_disconnected(request, rest())
    except RequestFailed as e:  # after its first output: still a JSON error, the answer had not begun
        raise failed(e) from None
    return choices


def handed_params(choices) -> dict | None:
    """The response's `kv_transfer_params`: a finished prefill's params, as the wire has them."""
    final = choices[0].final
    return final.kv_transfer_params.to_dict() if final is not None and final.kv_transfer_params else None


def announced(first: tuple[int, RequestOutput]) -> bool:
    """Whether the engine's first output is a streamed prefill's announcement (its pin's params,
    before any token): the answer is then the two-line hand-off (`handoff_response`)."""
    out = first[1]
    return bool(out.kv_transfer_params) and not out.finished and not out.new_token_ids


def handoff_response(request: Request, first: tuple[int, RequestOutput], events: Events, num_choices: int,
                     answer) -> StreamingResponse:
    """A streamed prefill's answer (protocol/kv_transfer.py): line 1 the params, sent now so the
    router hands them to a decode worker while the prefill runs; line 2, when it ends, the
    ordinary answer (`answer(choices)`, a response model) or an OpenAI error object."""

    async def lines() -> AsyncIterator[bytes]:
        yield json.dumps({PARAM: first[1].kv_transfer_params.to_dict()}).encode() + b"\n"
        try:
            choices = await collect(request, first, events, num_choices)
            yield answer(choices).model_dump_json().encode() + b"\n"
        except ClientGone:
            return  # the generation was aborted on the way out: the pin is cancelled with it
        except APIError as e:
            yield json.dumps(e.body()).encode() + b"\n"
        except Exception as e:
            log.exception("prefill failed after its hand-off was announced")
            yield json.dumps(error_body(500, f"engine error: {type(e).__name__}: {e}")).encode() + b"\n"

    return StreamingResponse(lines(), media_type=NDJSON)


def failed(e: RequestFailed) -> APIError:
    """A request the engine failed alone (its own step work raised; logged there): a 500, since
    input that gets this far is a gap in validation, with a code that says the worker is fine."""
    return APIError(500, f"the engine could not process this request: {e}", code=CODE_REQUEST_FAILED,
                    headers={HEADER_REQUEST_FAILED: "1"})


def stream_error(e: BaseException) -> bytes:
    """The error event of a stream that failed after its 200 (the caller sends [DONE] after it)."""
    if isinstance(e, RequestFailed):
        return event(failed(e).body())
    log.exception("request failed mid-stream", exc_info=e)
    return event(error_body(500, f"engine error: {type(e).__name__}: {e}"))
