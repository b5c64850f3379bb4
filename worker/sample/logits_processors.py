"""Allowed tokens, penalties and logit bias, applied to a batch's logits on the device before sampling.

Definitions (vLLM's, which follow OpenAI's and Hugging Face's):
  allowed_token_ids   logits[t] = -inf for every t not in the list          (applied first)
  logit_bias          logits[t] += bias[t]
  repetition_penalty  over prompt + generated tokens t: logits[t] / r if logits[t] > 0, else * r
                      (Hugging Face's RepetitionPenaltyLogitsProcessor)
  frequency_penalty   logits[t] -= f * count of t among the generated tokens
  presence_penalty    logits[t] -= p * (t was generated at least once)

Everything is batched: token histories become one padded index tensor, counted with one
scatter_add into [rows, V]; no Python loop runs over the vocabulary. Only rows of requests
that ask for a penalty or a bias are touched, and a batch without any costs one Python check.
A request's token ids are checked on the host before they index (request/isolation.py): one
outside the logits fails that request alone.

"Generated tokens" are `Request.output_token_ids`: on a decode worker of a P/D pair they
include the first token the prefill worker sampled (it is appended at admission), so the
penalty state is the same as if one worker had generated everything.
"""

from __future__ import annotations

import torch

from pdserve.worker.request.isolation import columns, isolated
from pdserve.worker.request.request import Request


def token_counts(histories: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(histories), V] float32: how often each token id occurs in each history."""
    width = max((len(h) for h in histories), default=0)
    # Pad with an extra id V, counted in a column that is dropped.
    padded = torch.tensor([h + [vocab_size] * (width - len(h)) for h in histories], dtype=torch.int64)
    padded = padded.reshape(len(histories), width).to(device, non_blocking=True)
    counts = torch.zeros(len(histories), vocab_size + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place: logits[i, t] += bias for every (t, bias) of request i."""
    rows, cols, vals = [], [], []
    for i, r in enumerate(reqs):
        if r.params.logit_bias:
            with isolated(r, "logit_bias"):
                ids = columns((t for t, _ in r.params.logit_bias), logits.shape[-1], "logit_bias")
                rows += [i] * len(ids)
                cols += ids
                vals += [b for _, b in r.params.logit_bias]
    if not rows:
        return
    dev = logits.device
    idx = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
    logits.index_put_(idx, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


def apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place, on the rows whose request has a penalty."""
    rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[-1]
    sub = [reqs[i] for i in rows]
    x = logits[rows]  # [s, V] copy of the penalized rows
    out_counts = token_counts([r.output_token_ids for r in sub], vocab, dev)
    out_seen = out_counts > 0

    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=x.dtype).to(dev, non_blocking=True).unsqueeze(1)

    rep = [r.params.repetition_penalty for r in sub]
    if any(p != 1.0 for p in rep):
        # Prompt histories only for rows that use them: the prompt can be long.
        prompt_seen = token_counts([r.token_ids[:r.num_prompt_tokens] if p != 1.0 else []
                                    for r, p in zip(sub, rep)], vocab, dev) > 0
        penalty = torch.where(prompt_seen | out_seen, per_row(rep), 1.0)
        x = torch.where(x > 0, x / penalty, x * penalty)
    freq = [r.params.frequency_penalty for r in sub]
    if any(freq):
        x = x - per_row(freq) * out_counts
    pres = [r.params.presence_penalty for r in sub]
    if any(pres):
        x = x - per_row(pres) * out_seen
    logits[rows] = x


def apply_allowed_token_ids(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place: -inf in row i outside request i's allowed_token_ids (rows without a list untouched)."""
    if all(r.params.allowed_token_ids is None for r in reqs):
        return
    for i, r in enumerate(reqs):
        if r.params.allowed_token_ids is not None:
            with isolated(r, "allowed_token_ids"):
                idx = r.allowed_token_index
                if idx is None:  # once per request: the list can be as long as the vocabulary
                    ids = columns(r.params.allowed_token_ids, logits.shape[-1], "allowed_token_ids")
                    idx = r.allowed_token_index = torch.tensor(ids, dtype=torch.int64).to(logits.device)
                kept = logits[i].index_select(0, idx)
                logits[i] = float("-inf")
                logits[i].index_copy_(0, idx, kept)


def apply_logits_processors(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place on [S, V] fp32 logits, one row per request: bias, then penalties (vLLM's order;
    the sampler applies allowed_token_ids before them, with the grammar's mask)."""
    if not any(r.params.modifies_logits for r in reqs):
        return
    apply_logit_bias(logits, reqs)
    apply_penalties(logits, reqs)
