"""Penalties and logit bias, applied to a batch's logits on the device before sampling.

Definitions (vLLM's, which follow OpenAI's and Hugging Face's):
  logit_bias          logits[t] += bias[t]                                  (applied first)
  repetition_penalty  over prompt + generated tokens t: logits[t] / r if logits[t] > 0, else * r
                      (Hugging Face's RepetitionPenaltyLogitsProcessor)
  frequency_penalty   logits[t] -= f * count of t among the generated tokens
  presence_penalty    logits[t] -= p * (t was generated at least once)

Everything is batched: token histories become one padded index tensor, counted with one
scatter_add into [rows, V]; no Python loop runs over the vocabulary. Only rows of requests
that ask for a penalty or a bias are touched, and a batch without any costs one Python check.

"Generated tokens" are `Request.output_token_ids`: on a decode worker of a P/D pair they
include the first token the prefill worker sampled (it is appended at admission), so the
penalty state is the same as if one worker had generated everything.
"""

from __future__ import annotations

import torch

from pdserve.worker.request import Request, RequestError


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
        for t, b in r.params.logit_bias:
            rows.append(i)
            cols.append(t)
            vals.append(b)
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


def apply_logits_processors(logits: torch.Tensor, reqs: list[Request]) -> None:
    """In place on [S, V] fp32 logits, one row per request: bias, then penalties (vLLM's order)."""
    if not any(r.params.modifies_logits for r in reqs):
        return
    apply_logit_bias(logits, reqs)
    apply_penalties(logits, reqs)


def check_logit_bias(params, vocab_size: int) -> None:
    """Token ids of logit_bias must exist in the vocabulary (raises RequestError)."""
    bad = next((t for t, _ in params.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError("logit_bias", f"logit_bias token id {bad} is out of range for this model's "
                                         f"vocabulary (0..{vocab_size - 1})")
