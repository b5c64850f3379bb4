"""vLLM's `prompt_logprobs=N` answer: per prompt token, a map from token id to its logprob, rank
and text, holding the prompt's own token and the top-N there; the first token's entry is null
(nothing comes before it). A completions choice carries it, a chat response carries one for its
prompt. The engine scores the prompt once for both this and completions' echo, at the larger N.
"""

from __future__ import annotations

from pdserve.protocol.requests import CommonRequest, CompletionRequest
from pdserve.worker.request.outputs import TokenLogprob


def engine_top_n(body: CommonRequest) -> int | None:
    """The top-N the engine scores the prompt with: echo's `logprobs` (completions) and
    `prompt_logprobs`, whichever asks more; None when neither wants prompt logprobs."""
    echo = body.logprobs if isinstance(body, CompletionRequest) and body.echo else None
    wanted = [n for n in (echo, body.prompt_logprobs) if n is not None]
    return max(wanted) if wanted else None


def prompt_logprobs_field(tokenizer, prompt: list[int], entries: list[TokenLogprob | None] | None,
                           n: int) -> list[dict | None]:
    """`entries`: the engine's, one per prompt token; `n`: the top-N this field asked for."""
    return [None if e is None else _entry(tokenizer, e, n) for e in entries or [None] * len(prompt)]


def _entry(tokenizer, e: TokenLogprob, n: int) -> dict:
    # The prompt token first, with its own rank; then the top n in order, ranked 1..n (the
    # prompt token among them keeps its entry).
    entry = {str(e.token_id): {"logprob": e.logprob, "rank": e.rank, "decoded_token": tokenizer.decode([e.token_id])}}
    for i, (t, v) in enumerate(e.top[:n]):
        entry.setdefault(str(t), {"logprob": v, "rank": i + 1, "decoded_token": tokenizer.decode([t])})
    return entry


def first_entries(choices) -> list[TokenLogprob | None] | None:
    """The prompt's entries as the engine sent them with any choice (every choice has one prompt)."""
    return next((c.prompt_logprobs for c in choices if c.prompt_logprobs is not None), None)
