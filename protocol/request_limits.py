"""What one request may ask of a server, whatever its body's size allows (issue 44).

The router and the worker take the same flags and enforce them alike, each on what it reads:
the router so that nothing over a bound costs a worker (or the router) more than a 400; the
worker because it may be called directly. Every refusal is a 400 naming the field and the flag.

    --max-request-prompt-tokens  1,048,576  prompt token ids of one completions request, all its
                                            prompts together (the worker counts a text prompt's
                                            tokens too); /tokenize and /detokenize likewise
    --max-request-sequences      256        len(prompt) × n: the engine requests one call becomes
    --max-stop-strings           32         `stop` strings of one request
    --max-stop-chars             4096       their characters, all together
    --max-input-items            10,000     items of a Responses request's `input`
    --max-request-id-chars       128        X-Request-Id cut to this (never refused: it names every
                                            chunk and log line; vLLM takes it as sent)

Why these defaults. vLLM bounds `n` (VLLM_MAX_N_SEQUENCES, 16384) and, in recent releases, the
number of prompts (VLLM_MAX_COMPLETION_PROMPTS, 1024) and of stop strings (VLLM_MAX_STOP_STRINGS,
4, OpenAI's documented limit), separately; their product is no bound at all (a 3 KB body of 256
prompts × n=16 held a worker for minutes). We bound the product by 256, vLLM's default
`--max-num-seqs`: one request never asks for more sequences than an engine batch holds, and
OpenAI's n ≤ 128 still fits. Stop strings cost every generated token (each is matched against
the new text), so their total length is bounded as well as their count; 32 and 4 KiB are well
above what clients send (agents' observation markers, eval harnesses' `until` lists) and far
below the 26,000 × 300 characters that stalled a worker. A prompt of 1 Mi token ids covers the
longest context windows served today (and a batch of 1,024 prompts of 1,024 tokens); it is
~7 MB of JSON, about the router's whole body limit. 10,000 Responses items is more than any
conversation that fits a context window (each item is at least a few tokens) and keeps mapping
one onto chat at a fraction of a second, on a thread.

One bound is derived, not a flag: the JSON values a body may hold (`body_values`), counted in
its raw bytes before it is parsed (protocol/body.py): the prompt's token ids plus OTHER_VALUES
for everything else a request carries. Past it, a body is refused before `json.loads` makes an
object of each value: an unknown field of 2.6 M empty lists costs a byte count, not 24× its size.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pdserve.protocol.contract import MAX_REQUEST_ID_CHARS
from pdserve.protocol.errors import bad_request
from pdserve.protocol.flags import ConfigError, flag
from pdserve.protocol.requests import CommonRequest, CompletionRequest

# Values of a body besides its prompt's token ids: messages, tools and their schemas, stop
# strings, logit_bias... (a large chat is a few thousand).
OTHER_VALUES = 1 << 16


@dataclass(frozen=True)
class RequestLimitFlags:
    """The bounds as flags, declared once: the router's and the worker's configs (RouterConfig,
    ServerConfig) inherit them, so both take the same flags with the same defaults."""

    max_request_prompt_tokens: int = flag(1 << 20, "most prompt token ids in one request, all its prompts together "
                                                   "(400 past it)")
    max_request_sequences: int = flag(256, "most sequences one request may ask for: its number of prompts times n "
                                           "(400 past it)")
    max_stop_strings: int = flag(32, "most stop strings in one request (400 past it)")
    max_stop_chars: int = flag(4096, "most characters of one request's stop strings, all together (400 past it)")
    max_input_items: int = flag(10_000, "most items in the input of one Responses API request (400 past it)")
    # Not a refusal: a longer id is cut (request_id_from).
    max_request_id_chars: int = flag(MAX_REQUEST_ID_CHARS, "a client's X-Request-Id is cut to this many characters "
                                                           "(it names every chunk)")


@dataclass(frozen=True)
class RequestLimits(RequestLimitFlags):
    """The bounds a server enforces, read from its config's flags (`of`)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError("--" + f.name.replace("_", "-"), f"must be an integer >= 1, not {value!r}")

    @classmethod
    def of(cls, config: Any) -> "RequestLimits":
        """From a config with these flags (RouterConfig, ServerConfig); raises ConfigError."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    @property
    def body_values(self) -> int:
        """The most JSON values a body may hold (protocol/body.py counts them before parsing)."""
        return self.max_request_prompt_tokens + OTHER_VALUES

    # ---- checks: each a 400 naming the field and the flag -----------------------------------

    def check(self, req: CommonRequest) -> None:
        """A validated chat or completions request, before anything else reads it. A completions
        request's prompts are counted by their lengths (no walk over the ids)."""
        n = req.n
        if isinstance(req, CompletionRequest):
            prompts = req.prompts()
            self.check_prompt_tokens(sum(len(p) for p in prompts if isinstance(p, list)), "prompt")
            if len(prompts) * n > self.max_request_sequences:
                raise bad_request(
                    f"this request asks for {len(prompts) * n} sequences ({len(prompts)} prompts × n={n}); "
                    f"at most {self.max_request_sequences} are served per request "
                    "(--max-request-sequences)",
                    "n" if n > 1 else "prompt",
                )
        elif n > self.max_request_sequences:
            raise bad_request(f"n={n} asks for more sequences than the {self.max_request_sequences} served per "
                              "request (--max-request-sequences)", "n")
        self.check_stop(req.stop)

    def check_prompt_tokens(self, count: int, param: str) -> None:
        if count > self.max_request_prompt_tokens:
            raise bad_request(f"{param} holds {count} tokens; at most {self.max_request_prompt_tokens} are read per "
                              "request (--max-request-prompt-tokens)", param)

    def check_stop(self, stop: str | list[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > self.max_stop_strings:
            raise bad_request(f"stop holds {len(stops)} strings; at most {self.max_stop_strings} are accepted "
                              "(--max-stop-strings)", "stop")
        if (chars := sum(len(s) for s in stops)) > self.max_stop_chars:
            raise bad_request(f"stop strings hold {chars} characters together; at most {self.max_stop_chars} are "
                              "accepted (--max-stop-chars)", "stop")

    def check_input_items(self, body: dict) -> None:
        """A Responses request's `input`, before it is validated or mapped onto chat."""
        items = body.get("input")
        if isinstance(items, list) and len(items) > self.max_input_items:
            raise bad_request(f"input holds {len(items)} items; at most {self.max_input_items} are accepted "
                              "(--max-input-items)", "input")
