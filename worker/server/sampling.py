"""An OpenAI request's sampling fields as the engine's SamplingParams."""

from __future__ import annotations

from pdserve.protocol.errors import bad_request
from pdserve.protocol.requests import CommonRequest
from pdserve.worker.request.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputSpec


def logit_bias(body: CommonRequest) -> tuple[tuple[int, float], ...]:
    """OpenAI sends token ids as JSON object keys (strings)."""
    out = []
    for key, bias in (body.logit_bias or {}).items():
        try:
            out.append((int(key), float(bias)))
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return tuple(out)


def structured_output(body: CommonRequest) -> StructuredOutputSpec | None:
    """response_format / guided_* / structured_outputs as the engine's grammar spec."""
    spec = body.structured_output()
    return None if spec is None else StructuredOutputSpec(*spec)


def sampling_params(body: CommonRequest, max_tokens: int, logprobs: int | None, logprobs_param: str,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """`logprobs_param` names the request field the engine's `logprobs` came from
    (`logprobs` on completions, `top_logprobs` on chat), so a 400 points at what the client sent."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=-1 if body.top_k in (None, 0) else body.top_k,
            seed=body.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=logit_bias(body),
            prompt_logprobs=prompt_logprobs,
            structured=structured_output(body),
            allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
            priority=body.priority,
        )
    except SamplingParamsError as e:
        if e.param != "logprobs":
            raise bad_request(str(e), e.param) from None
        # The message names the field the client sent (chat's top_logprobs), as the param does.
        raise bad_request(str(e).replace("logprobs", logprobs_param, 1), logprobs_param) from None
