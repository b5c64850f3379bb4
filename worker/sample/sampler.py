"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

A seeded request draws each token from its own random stream, derived from (seed, index of the
token in the output): the tokens do not depend on what the request is batched with, on a
preemption, or on which worker samples which position. The last is what makes P/D exact: the
prefill worker samples output 0 and the decode worker outputs 1.., from the same streams a
single worker would use.

A row's own work (its stop ids, its sampling, its logprobs; its grammar and bias in the modules
that apply them) runs isolated (request/isolation.py): if it raises, that request fails and the
batch's other rows are sampled as if it were not there.
"""

from __future__ import annotations

import torch

from pdserve.worker.request.isolation import columns, isolated
from pdserve.worker.request.outputs import TokenLogprob
from pdserve.worker.request.request import Request
from pdserve.worker.sample.logits_processors import apply_allowed_token_ids, apply_logits_processors
from pdserve.worker.structured.structured_output import apply_grammar_masks


_MASK64 = (1 << 64) - 1


def position_generator(seed: int, index: int) -> torch.Generator:
    """The random stream of output token `index` of a request seeded with `seed`: a splitmix64
    mix of the pair, so neighbouring seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.Generator().manual_seed((z ^ (z >> 31)) & ((1 << 63) - 1))


class Sampler:
    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [S, V] (any float dtype: upcast to fp32 first), one row per request that samples this step."""
        tokens, logprobs = self.sample(logits, reqs)
        return tokens.tolist(), logprobs if logprobs is not None else [None] * len(reqs)

    def sample(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> tuple[torch.Tensor, list[TokenLogprob | None] | None]:
        """The token ids as a device tensor [S], read by the host only where a row needs it (a
        seeded row samples on a CPU generator; logprobs are built on the host): async scheduling
        feeds the tensor to the next step. Logprobs: None when no request asked."""
        logits = logits.float()
        apply_grammar_masks(logits, reqs)  # response_format / guided_*: -inf outside the grammar
        apply_allowed_token_ids(logits, reqs)  # masks first: min_tokens looks at what they leave
        self._suppress_early_stop(logits, reqs)
        apply_logits_processors(logits, reqs)  # bias and penalties (logprobs below include them)
        tokens = logits.argmax(dim=-1)
        if not all(r.params.greedy for r in reqs):  # a Python check: no device sync on the hot path
            for i, r in enumerate(reqs):
                if not r.params.greedy:
                    with isolated(r, "sampling"):  # a failed row keeps its argmax: dropped with the request
                        tokens[i] = self._sample_row(logits[i], r)
        if all(r.params.logprobs is None for r in reqs):
            return tokens, None
        return tokens, self._logprobs(logits, tokens.tolist(), reqs)

    @staticmethod
    def _suppress_early_stop(logits: torch.Tensor, reqs: list[Request]) -> None:
        for i, r in enumerate(reqs):
            if r.next_output_index < r.params.min_tokens:
                with isolated(r, "min_tokens"):
                    Sampler._suppress_row(logits, i, r)

    @staticmethod
    def _suppress_row(logits: torch.Tensor, i: int, r: Request) -> None:
        stops = columns([*r.eos_token_ids, *r.params.stop_token_ids], logits.shape[-1], "stop")
        if stops and (r.grammar is not None or r.params.allowed_token_ids is not None):
            # A complete grammar allows only its end (allowed_token_ids only stop tokens): that wins
            # over min_tokens (a row of -inf has nothing to sample). Rare, so the sync is fine.
            rest = logits[i].clone()
            rest[stops] = float("-inf")
            if not bool(torch.isfinite(rest).any()):
                return
        if stops:
            logits[i, stops] = float("-inf")

    @staticmethod
    def _sample_row(row: torch.Tensor, r: Request) -> int | torch.Tensor:
        p = r.params
        # Finite values only: torch.multinomial raises on inf or NaN probabilities (on a GPU it is
        # a device-side assert, fatal to every request). A repetition penalty near 0 divides a
        # logit to inf, and inf * 0 is NaN. Clamped, +inf is a huge logit, NaN and -inf a tiny
        # one (probability 0, as -inf has), and a row with every token masked is uniform, not NaN.
        big = torch.finfo(row.dtype).max
        row = torch.nan_to_num(row / p.temperature, nan=-big, posinf=big, neginf=-big)
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = row.softmax(-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = sorted_p.cumsum(-1) - sorted_p > p.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        # Seeded: sampled on a CPU generator, so reproducible on any device.
        # The index counts tokens still in flight (async scheduling): the same stream either way.
        if p.seed is not None:
            return int(torch.multinomial(probs.cpu(), 1, generator=position_generator(p.seed, r.next_output_index)))
        return torch.multinomial(probs, 1)[0]  # stays on the device

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int], reqs: list[Request]) -> list[TokenLogprob | None]:
        if all(r.params.logprobs is None for r in reqs):
            return [None] * len(reqs)
        out: list[TokenLogprob | None] = []
        lp = logits.log_softmax(-1)
        for i, r in enumerate(reqs):
            k = r.params.logprobs
            out.append(None)
            if k is None:
                continue
            with isolated(r, "logprobs"):
                top = []
                if k > 0:
                    vals, ids = lp[i].topk(min(k, lp.shape[-1]))
                    top = list(zip(ids.tolist(), vals.tolist()))
                out[-1] = TokenLogprob(tokens[i], float(lp[i, tokens[i]]), top)
        return out
