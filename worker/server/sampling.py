"""An OpenAI request's sampling fields as the engine's SamplingParams."""

from __future__ import annotations

from pdserve.protocol.errors import bad_request
from pdserve.protocol.requests import CommonRequest
from pdserve.worker.sampling_params import SamplingParams, SamplingParamsError


def sampling_params(body: CommonRequest, max_tokens: int, logprobs: int | None, logprobs_param: str) -> SamplingParams:
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
        )
    except SamplingParamsError as e:
        param = logprobs_param if e.param == "logprobs" else e.param
        raise bad_request(str(e), param) from None
