"""The P/D decider: is a request worth a prefill worker, or should its decode worker prefill?"""

from __future__ import annotations

from pdserve.router.policies import PolicyContext
from pdserve.router.prompt import estimate_tokens


class PromptLength:
    """Disaggregate prompts of at least `--pd-min-prompt-tokens` (estimated) that will decode
    more than one token into one choice: after a single token there is nothing to hand off,
    and n > 1 is served by one worker."""

    def __init__(self, ctx: PolicyContext):
        self.min_tokens = ctx.pd_min_prompt_tokens

    def disaggregate(self, body: dict) -> bool:
        if body.get("n", 1) != 1 or body.get("max_tokens") == 1 or body.get("max_completion_tokens") == 1:
            return False
        if body.get("tools") and body.get("tool_choice") != "none":
            return False  # tool calls are parsed from the whole reply, so one worker makes it all
        if body.get("echo"):
            return False  # the prompt's logprobs come from its prefill: one worker runs it and decodes
        return estimate_tokens(body) >= self.min_tokens
