"""The P/D decider: is a request worth a prefill worker, or should its decode worker prefill?"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.protocol.requests import ChatCompletionRequest, GenerationRequest
from pdserve.router.policies.interfaces import PolicyContext, RoutingRequest
from pdserve.router.prompt import decodes_one_token, estimate_tokens

if TYPE_CHECKING:
    from pdserve.router.workers import Worker


class PromptLength:
    """Disaggregate prompts of at least `--pd-min-prompt-tokens` (estimated) that will decode
    more than one token into one choice: after a single token there is nothing to hand off,
    and n > 1 is served by one worker."""

    def __init__(self, ctx: PolicyContext):
        self.min_tokens = ctx.pd_min_prompt_tokens

    def disaggregate(self, request: GenerationRequest) -> bool:
        if request.n != 1 or decodes_one_token(request):
            return False
        if isinstance(request, ChatCompletionRequest):
            if request.tools and request.tool_choice != "none":
                return False  # tool calls are parsed from the whole reply, so one worker makes it all
        elif request.echo:
            return False  # the prompt's logprobs come from its prefill: one worker runs it and decodes
        return estimate_tokens(request) >= self.min_tokens


class DecodePrefix:
    """The second question of llm-d's prefix-based decider: would the decode worker this request
    goes to compute almost nothing itself? A follow-up turn over a context that worker already
    caches (the KV it pulled or computed for an earlier turn) has only its new tokens uncached; a
    remote prefill would recompute the whole prompt and move all of its KV to add those. Such a request is
    served whole there when fewer than `--pd-min-uncached-tokens` of
    its prompt tokens are uncached. Needs token ids (the router's tokenizer) and the KV event
    index (prefix-aware decode routing); without them, or at 0, it never skips."""

    def __init__(self, ctx: PolicyContext):
        self.min_uncached = ctx.pd_min_uncached_tokens
        self._index = ctx.kv_index

    def covers(self, request: RoutingRequest, worker: Worker) -> bool:
        if not self.min_uncached or self._index is None:
            return False
        tokens = request.token_ids()
        if not tokens:
            return False
        cached = self._index.cached_tokens(tokens, [worker.url]).get(worker.url, 0)
        return cached > 0 and len(tokens) - cached < self.min_uncached
