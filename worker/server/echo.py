"""Completions' `echo`: the prompt is returned in front of the completion, and with `logprobs=N`
each prompt token's logprob and top-N (the first token's are null), as OpenAI's legacy API and
vLLM return them. lm-eval's loglikelihood tasks send `echo=True, logprobs=1, max_tokens=1` (or
0) and read the prompt part of `token_logprobs`.

`max_tokens=0` (only with echo) runs the prompt as a one-token request whose token is dropped:
the prefill is the work; the engine never has a request that samples nothing.
"""

from __future__ import annotations

from pdserve.protocol.errors import bad_request
from pdserve.protocol.requests import CompletionRequest
from pdserve.worker.request.outputs import TokenLogprob


def echo_only(body: CompletionRequest) -> bool:
    """True for `echo=True, max_tokens=0`: the answer is the prompt alone."""
    if body.max_tokens == 0 and not body.echo:
        raise bad_request("max_tokens must be at least 1 (0 is allowed only with echo)", "max_tokens")
    return body.echo and body.max_tokens == 0


def prompt_texts(tokenizer, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """What is echoed: a text prompt as sent, a token-id prompt decoded."""
    given = body.prompts()
    return [g if isinstance(g, str) else tokenizer.decode(ids) for g, ids in zip(given, prompts)]


def format_prompt_logprobs(tokenizer, prompt: list[int], entries: list[TokenLogprob | None] | None, n: int) -> dict:
    """The legacy-completions logprobs of the prompt; top_logprobs holds the top-N plus the prompt
    token itself (OpenAI: up to N+1 entries). The engine may have scored more (prompt_logprobs)."""
    entries = entries or [None] * len(prompt)
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for token_id, e in zip(prompt, entries):
        s = tokenizer.decode([token_id])
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(e.logprob)
        top = {tokenizer.decode([t]): v for t, v in e.top[:n]}
        top.setdefault(s, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(head: dict, tail: dict | None) -> dict:
    """The prompt's logprobs followed by the completion's (whose offsets already count the echo)."""
    if not tail:
        return head
    return {k: head[k] + (tail.get(k) or []) for k in head}


class Echo:
    """Puts the prompt in front of each choice of one completions request (unary or streamed)."""

    def __init__(self, tokenizer, body: CompletionRequest, prompts: list[list[int]], n: int, only_prompt: bool):
        self.tokenizer, self.prompts, self.n, self.only_prompt = tokenizer, prompts, n, only_prompt
        self.texts = prompt_texts(tokenizer, body, prompts)
        self.with_logprobs = body.logprobs is not None
        self.top_n = body.logprobs or 0
        self.prompt_lps: dict[int, list] = {}  # choice -> its prompt's entries, as the engine sent them
        self.echoed: set[int] = set()

    def see(self, i: int, out) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_lps[i] = out.prompt_logprobs

    def choice(self, i: int, choice) -> None:
        """Rewrite a choice (or a streamed choice's first chunk) in place: prompt first."""
        first = i not in self.echoed
        self.echoed.add(i)
        head = self.texts[i // self.n]
        gen_lps = None if self.only_prompt else choice.logprobs
        if gen_lps and "text_offset" in gen_lps:  # the completion's offsets start after the echo
            gen_lps["text_offset"] = [o + len(head) for o in gen_lps["text_offset"]]
        text = "" if self.only_prompt else choice.text
        if not first:
            choice.text, choice.logprobs = text, (gen_lps if self.with_logprobs else None)
            return
        choice.text = head + text
        if self.with_logprobs:
            prompt = self.prompts[i // self.n]
            head_lps = format_prompt_logprobs(self.tokenizer, prompt, self.prompt_lps.get(i), self.top_n)
            choice.logprobs = join_logprobs(head_lps, gen_lps)

    def usage(self, usage):
        if self.only_prompt and usage is not None:
            usage.completion_tokens = 0
            usage.total_tokens = usage.prompt_tokens
        return usage
