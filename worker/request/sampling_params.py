"""Per-request sampling parameters: one frozen, validated value object.

Every value a client can send is bounded here, with vLLM's bounds where it has them
(SamplingParams._verify_args), so that no request's numbers can break the sampler's arithmetic:
non-finite values are refused, a temperature below vLLM's epsilon samples greedily (dividing
logits by 1e-40 overflows to inf, and softmax then gives NaN), seeds are 64-bit signed integers
as in vLLM's OpenAI server. Token ids are checked against the vocabulary by `check_vocabulary`,
once the model is known.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from pdserve.worker.request.stop_strings import StopStrings

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")  # StructuredOutputSpec.kind

# vLLM's _SAMPLING_EPS: a temperature below it means greedy sampling.
SAMPLING_EPS = 1e-5
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # torch.long's range, vLLM's bound on `seed`


class SamplingParamsError(ValueError):
    """A sampling value is out of range. `param` names the offending field (for OpenAI errors)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must match. `value`: a JSON schema as canonical JSON text (json), a regex,
    the choices (choice), or a GBNF grammar with a `root` rule (grammar). `param` is the request
    field it came from, for errors; it is not part of the cache key."""

    kind: str
    value: str | tuple[str, ...]
    param: str = "response_format"

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}")

    @property
    def key(self) -> tuple:
        return self.kind, self.value

    @property
    def num_bytes(self) -> int:
        values = self.value if isinstance(self.value, tuple) else (self.value,)
        return sum(len(v.encode("utf-8", "surrogatepass")) for v in values)

    @staticmethod
    def choice_regex(choices: tuple[str, ...]) -> str:
        """vLLM's guided_choice: exactly one of the strings (regex metacharacters escaped)."""
        import re

        # Only the metacharacters: re.escape also escapes spaces, which xgrammar warns about.
        return "(" + "|".join(re.sub(r"([\\^$.|?*+()\[\]{}/-])", r"\\\1", c) for c in choices) + ")"


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
    # vLLM's allowed_token_ids: only these tokens may be sampled (None: any).
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's skip_special_tokens: False keeps special tokens in the text (harmony's channel
    # markers, which its output parsers read: worker/server/tool_parsers/harmony.py).
    skip_special_tokens: bool = True
    # vLLM's request priority (lower is served sooner): no sampling setting, but carried with
    # them as the request's other knobs are; the scheduler reads it under --scheduling-policy priority.
    priority: int = 0
    # `stop` compiled for the detokenizer (stop_strings.py), derived here. A copy made with
    # dataclasses.replace (the n choices of a seeded request) shares it: one compile per request.
    stop_strings: StopStrings | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:  # NaN fails every comparison: refused too
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
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise SamplingParamsError("repetition_penalty", f"repetition_penalty must be a finite number greater "
                                                            f"than 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamsError("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} "
                                                        f"for token {token}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise SamplingParamsError("logprobs", f"logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise SamplingParamsError("seed", f"seed must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must not be empty")
        # Repeats dropped (order kept): what the step scans per token is then bounded by the
        # vocabulary, not by how many times a client wrote an id.
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(dict.fromkeys(self.allowed_token_ids)))
        if self.stop_strings is None or self.stop_strings.stops is not self.stop:
            object.__setattr__(self, "stop_strings", StopStrings(self.stop))

    def check_vocabulary(self, vocab_size: int) -> None:
        """The token ids the sampler indexes the logits with must be columns of them: `vocab_size`
        is the logits' width (the model's vocab_size, which may exceed the tokenizer's length:
        padded rows are real, samplable columns). Raises SamplingParamsError naming the field."""
        fields = (("stop_token_ids", self.stop_token_ids), ("logit_bias", (t for t, _ in self.logit_bias)),
                  ("allowed_token_ids", self.allowed_token_ids or ()))
        for name, ids in fields:
            bad = next((t for t in ids if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise SamplingParamsError(name, f"{name} holds token id {bad}, out of range for this model's "
                                                f"vocabulary (0..{vocab_size - 1})")

    # Cached (the value is frozen; read for every request of every step): in the instance's
    # __dict__ after the first read, outside the fields, so equality and replace() ignore it.
    @functools.cached_property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @functools.cached_property
    def modifies_logits(self) -> bool:
        """Penalties, bias or a grammar change this request's logits before sampling (even greedy)."""
        return (self.has_penalties or bool(self.logit_bias) or self.structured is not None
                or self.allowed_token_ids is not None)

    @functools.cached_property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1
