"""Prompt logprobs (completions' `echo=True` with `logprobs=N`, and vLLM's `prompt_logprobs=N` on
either endpoint): the log-probability the model gives each prompt token after the tokens before
it, its rank there, plus the top-N alternatives.

They come from the prefill's own hidden states: position p's logits score prompt token p+1.
Only requests that ask for them project their prompt rows to logits, and those rows go
through the LM head in slices of `slice_rows` (the runner passes --max-num-seqs: the number of
logit rows its memory profile measured), so a long prompt never holds [P, V] fp32 logits at once. A prefill
split into chunks scores each chunk's rows when the chunk runs; the first
prompt token has nothing before it and gets None (as OpenAI and vLLM return).

Such a request skips the prefix cache lookup (a cached block's positions have no hidden states
this step) and is scored only before its first output token: a request preempted later and
recomputed is not scored again. Under tensor parallelism every rank runs the same slices (the
logits gather is a collective); rank 0 alone turns them into numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.worker.request.outputs import TokenLogprob
from pdserve.worker.request.request import Request


def scores_prompt(req: Request) -> bool:
    return req.params.prompt_logprobs is not None and req.num_output_tokens == 0


@dataclass
class PromptRows:
    """Rank 0's bookkeeping of one step's scored rows: row j of the step's scores is prompt token
    positions[j] of requests[j] (the row itself is the hidden state of position - 1)."""

    requests: list[Request]
    positions: list[int]


def plan_rows(req: Request, start: int, end: int, first_row: int, rows: list[int], targets: list[int],
              book: PromptRows) -> None:
    """Add the rows of a chunk [start, end) that score a prompt token (positions start+1 ..)."""
    last = min(end, req.num_prompt_tokens - 1)  # the last prompt position predicts the output
    for p in range(start, last):
        rows.append(first_row + p - start)
        targets.append(req.token_ids[p + 1])
        book.requests.append(req)
        book.positions.append(p + 1)


@torch.inference_mode()
def score_rows(hidden: torch.Tensor, rows: list[int], targets: list[int], top_k: int, project,
               slice_rows: int) -> tuple | None:
    """log_softmax of `project(hidden[rows])` in slices -> (target logprob [R], top values [R, k],
    top ids [R, k], target rank [R]) on rank 0; None where `project` returns None (the other TP ranks)."""
    out = []
    for s in range(0, len(rows), slice_rows):
        idx = torch.tensor(rows[s:s + slice_rows], device=hidden.device)
        logits = project(hidden[idx])
        if logits is None:
            continue
        lp = logits.float().log_softmax(-1)
        tgt = torch.tensor(targets[s:s + slice_rows], device=lp.device).unsqueeze(1)
        vals, ids = lp.topk(top_k, dim=-1) if top_k > 0 else (lp[:, :0], tgt[:, :0])
        target = lp.gather(1, tgt)
        # vLLM's rank: 1 + the tokens the model scored strictly higher than the prompt's.
        out.append((target.squeeze(1), vals, ids, (lp > target).sum(-1) + 1))
    if not out:
        return None
    return tuple(torch.cat(parts) for parts in zip(*out))


class PromptLogprobsCollector:
    """Rank 0: per request, the prompt's logprobs as its chunks are scored; taken once, with the
    request's first output."""

    def __init__(self):
        self._by_request: dict[str, list[TokenLogprob | None]] = {}

    def record(self, book: PromptRows, scores: tuple) -> None:
        target_lp, vals, ids, ranks = (t.tolist() for t in scores)  # one device read-back per step
        for j, (req, pos) in enumerate(zip(book.requests, book.positions)):
            acc = self._by_request.get(req.request_id)
            if acc is None:
                acc = self._by_request[req.request_id] = [None] * req.num_prompt_tokens
            k = req.params.prompt_logprobs
            acc[pos] = TokenLogprob(req.token_ids[pos], target_lp[j], list(zip(ids[j][:k], vals[j][:k])), ranks[j])

    def pop(self, request_id: str, num_prompt_tokens: int) -> list[TokenLogprob | None] | None:
        """The whole prompt's entries (None for the first token); a one-token prompt has only that."""
        acc = self._by_request.pop(request_id, None)
        return acc if acc is not None else [None] * num_prompt_tokens

    def discard(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)
