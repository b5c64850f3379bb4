"""From logits to tokens: the sampler, the logits processors (penalties, bias, bad words) and
prompt logprobs."""
