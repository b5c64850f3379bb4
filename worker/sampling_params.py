"""Per-request sampling parameters: one frozen, validated value object."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.worker.structured_output import StructuredOutputSpec


class SamplingParamsError(ValueError):
    """A sampling value is out of range. `param` names the offending field (for OpenAI errors)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0 = only the chosen)
    min_tokens: int = 0
    # Penalties as vLLM defines them (OpenAI's names): presence and frequency count generated
    # tokens only; repetition (Hugging Face's, multiplicative) counts prompt and generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # Top-N logprobs per prompt token (0 = only the prompt token's own), from the prefill's
    # logits; None = not computed. Such a request skips the prefix cache (cached tokens have no logits).
    prompt_logprobs: int | None = None
    # response_format / guided_*: the output is masked to this grammar (structured_output.py).
    structured: StructuredOutputSpec | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingParamsError("temperature", f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SamplingParamsError("top_k", f"top_k must be -1 (disabled) or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise SamplingParamsError("repetition_penalty",
                                      f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} "
                                                        f"for token {token}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise SamplingParamsError("logprobs", f"logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty")

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def modifies_logits(self) -> bool:
        """Penalties, bias or a grammar change this request's logits before sampling (even greedy)."""
        return self.has_penalties or bool(self.logit_bias) or self.structured is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
