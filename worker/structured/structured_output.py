"""Structured outputs: grammars compiled once per spec, one matcher per request, a token mask.

A request's `response_format` / `guided_*` becomes a `StructuredOutputSpec` (a hashable value in
its SamplingParams, defined with them in sampling_params.py). The engine compiles it when the request arrives
(an invalid schema or regex
is the caller's 400 there, before anything runs) through `StructuredOutputs`, which caches the
compiled grammar per spec and builds the grammar engine's tokenizer view once. Each request owns
a `GrammarMatcher`:

    sampler     mask = apply_grammar_masks(logits, reqs)   rows outside the grammar -> -inf
    check_stop  matcher.advance(output tokens)             catches up with every appended token

The matcher catches up with the request's output tokens instead of being fed by whoever appends
them. That one rule covers the P/D hand-off (a decode worker appends the prefill's first token,
and its matcher consumes it before the second token is masked), preemption by recompute (the
outputs stay; the matcher never rewinds) and the sampler itself.

The grammar engine is chosen per worker (`--structured-outputs-backend`): llguidance (default; a
small Rust wheel without dependencies, grammars compiled lazily as tokens arrive) or xgrammar
(precompiles a token-mask cache per grammar). Both fill the same bitmask: int32 words, bit k of
word w = token 32*w + k allowed, so the device side below is shared. The engines are told the
model's vocabulary size (the logits' width), so ids past the tokenizer's vocabulary (padding of
the embedding) are never allowed.

Compiling is the costly part (a large schema takes the engines seconds, in Rust, outside the
GIL): the server does it off the event loop, in grammar_pool.py; here a spec larger than
`--max-structured-spec-bytes` is refused before either engine sees it, and an engine's error
reaches the client as one line (llguidance reports an internal panic with its backtrace). For
llguidance the cache holds a pristine matcher (building one is most of the cost) and each
request gets a copy of it. Schemas are closed unless they say otherwise (closed_schema.py).
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict

import torch

from pdserve.worker.request.isolation import is_device_fault, isolated
from pdserve.worker.request.sampling_params import StructuredOutputSpec

log = logging.getLogger(__name__)

BACKENDS = ("llguidance", "xgrammar")
DEFAULT_BACKEND = "llguidance"  # measured: bench/structured.py, docs/structured-outputs.md
CACHE_SIZE = 256  # compiled grammars kept per worker (a compiled JSON schema is kilobytes)
# ... and at most this much spec text behind them: a compiled grammar weighs ~80x its spec (a
# 250 KB schema of patterns: 20 MiB for llguidance), so 256 large ones would be gigabytes.
CACHE_SPEC_BYTES = 4 * 1024 * 1024
MAX_ERROR_CHARS = 300  # an engine's error message, on one line, cut before any backtrace and to this length


class GrammarError(ValueError):
    """The spec does not compile (bad schema, regex or grammar); `param` names the request field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


# Where an engine's message turns into its internals: llguidance's panic backtrace
# ("<backtrace>", then "   0: <unknown>" frames), Rust's "stack backtrace:", a Python traceback.
_BACKTRACE = re.compile(r"<backtrace>|stack backtrace:|Traceback \(most recent call last\)|^\s*\d+: ", re.M)
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[01:51:33] /project/cpp/x.cc:83: "


def engine_error(e: object) -> str:
    """An engine's complaint as the client may see it: up to any backtrace, on one line, at most
    MAX_ERROR_CHARS (a regex error's caret lines are kept, flattened; a schema is not echoed whole)."""
    text = str(e)
    if (m := _BACKTRACE.search(text)) is not None:
        text = text[:m.start()]
    text = " ".join(_LOG_PREFIX.sub("", text.strip()).split()) or type(e).__name__
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


class GrammarMatcher:
    """One request's position in its grammar (engine-neutral face of the two backends)."""

    def __init__(self, impl, backend: str, eos_token_ids: tuple[int, ...], vocab_size: int, executor=None):
        self._m = impl
        self.executor = executor  # llguidance's thread pool: a batch's rows are filled in parallel
        self.vocab_size = vocab_size  # the logits' width the engine's bitmask covers
        self._backend = backend
        self._eos = set(eos_token_ids)
        self.num_consumed = 0  # output tokens advanced over
        self.terminated = False  # the grammar is complete and its end (an EOS token) was consumed
        self.failed = False  # a token outside the grammar arrived (a handed-over token, say)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Bitmask row `row` := the tokens allowed next. A finished matcher leaves the row as it
        is: its request stops at this step's check_stop whatever it samples."""
        if self.terminated or self.failed:
            return
        if self._backend == "xgrammar":
            self._m.fill_next_token_bitmask(bitmask, row)
        else:
            import llguidance.torch

            llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    def advance(self, output_token_ids: list[int]) -> None:
        """Consume the output tokens not consumed yet."""
        while self.num_consumed < len(output_token_ids) and not (self.terminated or self.failed):
            token = output_token_ids[self.num_consumed]
            self.num_consumed += 1
            if self._backend == "xgrammar":
                ok = self._m.accept_token(token)
                self.terminated = ok and self._m.is_terminated()
            else:
                ok = self._m.consume_token(token)
                self.terminated = ok and token in self._eos and self._m.is_stopped()
            if not ok:
                self.failed = True
                log.warning("structured output: token %d is outside the grammar; the request stops", token)


class StructuredOutputs:
    """The worker's grammar compiler: one tokenizer view, a cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], backend: str = DEFAULT_BACKEND,
                 allow_additional_properties: bool = False, max_spec_bytes: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.allow_additional_properties = allow_additional_properties  # JSON Schema's open default
        self.max_spec_bytes = max_spec_bytes  # None: no limit
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._hf_tokenizer = tokenizer
        self._tokenizer = None  # the engine's view of the vocabulary, built on first use (~0.5 s)
        self._compiler = None
        self._executor = None
        self._cache: OrderedDict[tuple, tuple[object, int]] = OrderedDict()  # key -> (compiled, spec bytes)
        self._cache_bytes = 0
        self._lock = threading.Lock()  # add_request may run on several threads
        try:  # not installed: the worker fails at start, naming the flag, not at the first request
            __import__(backend)
        except ImportError as e:
            from pdserve.protocol.flags import ConfigError

            raise ConfigError(
                "--structured-outputs-backend",
                f"{backend} is not installed ({e}); "
                f"pip install {'llguidance' if backend == 'llguidance' else 'pdserve[xgrammar]'}",
            ) from None

    def matcher(self, spec: StructuredOutputSpec, compiled=None) -> GrammarMatcher:
        """A fresh matcher for `spec` (raises GrammarError if the spec does not compile);
        `compiled`: what compile(spec) returned, when the caller compiled it elsewhere."""
        if compiled is None:
            compiled = self.compile(spec)
        if self.backend == "xgrammar":
            import xgrammar

            impl = xgrammar.GrammarMatcher(compiled)
        else:
            impl = compiled.deep_copy()  # the cached matcher stays at the grammar's start
        return GrammarMatcher(impl, self.backend, self.eos_token_ids, self.vocab_size, self._executor)

    def cached(self, spec: StructuredOutputSpec):
        """The spec's compiled grammar if it is in the cache (now its most recent entry), else None."""
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is None:
                return None
            self._cache.move_to_end(spec.key)
            return hit[0]

    def check_size(self, spec: StructuredOutputSpec) -> None:
        """Refuse a spec over --max-structured-spec-bytes (GrammarError, the caller's 400)."""
        if self.max_spec_bytes is not None and spec.num_bytes > self.max_spec_bytes:
            raise GrammarError(spec.param, f"{spec.param} is {spec.num_bytes} bytes; this worker compiles "
                                           f"at most {self.max_spec_bytes} (--max-structured-spec-bytes)")

    def compile(self, spec: StructuredOutputSpec):
        """The spec's compiled grammar, from the cache or compiled now (any thread; seconds for a
        large schema: the server calls it through grammar_pool.GrammarPool)."""
        self.check_size(spec)
        hit = self.cached(spec)
        if hit is not None:
            return hit
        with self._lock:
            self._ensure_tokenizer()
        # Compiling runs outside the lock: a large schema never stalls other callers' hits.
        try:
            compiled = self._compile_xgrammar(spec) if self.backend == "xgrammar" else self._compile_llguidance(spec)
        except GrammarError:
            raise
        except BaseException as e:  # noqa: BLE001 - assorted types for bad user input (a Rust panic is a BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise GrammarError(spec.param, f"invalid {spec.param}: {engine_error(e)}") from None
        with self._lock:
            if spec.key not in self._cache:
                self._cache[spec.key] = compiled, spec.num_bytes
                self._cache_bytes += spec.num_bytes
            while len(self._cache) > CACHE_SIZE or (self._cache_bytes > CACHE_SPEC_BYTES and len(self._cache) > 1):
                self._cache_bytes -= self._cache.popitem(last=False)[1][1]
        return compiled

    def _ensure_tokenizer(self) -> None:
        if self._tokenizer is not None:
            return
        if self.backend == "xgrammar":
            import xgrammar

            self._tokenizer = xgrammar.TokenizerInfo.from_huggingface(
                self._hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.eos_token_ids))
            self._compiler = xgrammar.GrammarCompiler(self._tokenizer)
        else:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=list(self.eos_token_ids))
            # Masks cost ~0.1 ms per row on the host: a batch's rows run on a pool (80% of the
            # cores, at most 32), in Rust, outside the GIL.
            self._executor = llguidance.LLExecutor()

    def _compile_xgrammar(self, spec: StructuredOutputSpec):
        c = self._compiler
        if spec.kind == "json":
            # Compact JSON (no free whitespace): a model cannot wander off into blank lines.
            # strict_mode: undeclared keys and items are refused unless the schema allows them.
            return c.compile_json_schema(spec.value, any_whitespace=False,
                                         strict_mode=not self.allow_additional_properties)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            return c.compile_regex(StructuredOutputSpec.choice_regex(spec.value))
        return c.compile_grammar(spec.value)

    def _compile_llguidance(self, spec: StructuredOutputSpec):
        import json

        import llguidance
        from llguidance.gbnf_to_lark import gbnf_to_lark

        from pdserve.worker.structured.closed_schema import close_schema

        M = llguidance.LLMatcher
        if spec.kind == "json":
            schema = spec.value
            if not self.allow_additional_properties:  # as xgrammar's strict mode reads it
                schema = json.dumps(close_schema(json.loads(schema)), separators=(",", ":"))
            grammar = M.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        elif spec.kind == "regex":
            grammar = M.grammar_from_regex(spec.value)
        elif spec.kind == "choice":
            grammar = M.grammar_from_regex(StructuredOutputSpec.choice_regex(spec.value))
        else:
            grammar = M.grammar_from_lark(gbnf_to_lark(spec.value))
        # Building the matcher checks the grammar (and is most of the cost): it is what the
        # cache keeps, and each request's matcher is a copy of it.
        matcher = M(self._tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(spec.param, f"invalid {spec.param}: {engine_error(matcher.get_error())}")
        return matcher


_BIT = torch.arange(8, dtype=torch.uint8)
STAGE = "structured output"  # where a request failed, as its error says


def fill_bitmask(reqs) -> torch.Tensor | None:
    """[S, ceil(V/32)] int32 on the host: the grammar rows' allowed tokens, every token elsewhere;
    None when no request in the batch has a grammar. V: the width the engines were built with."""
    rows = [(i, r.grammar) for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    if not rows:
        return None
    bitmask = torch.full((len(reqs), (rows[0][1].vocab_size + 31) // 32), -1, dtype=torch.int32)
    pooled = []
    # A matcher that raises fails its request alone (request/isolation.py); its row is then
    # whatever the fill left, sampled and dropped with the request.
    for i, m in rows:
        with isolated(reqs[i], STAGE):
            m.advance(reqs[i].output_token_ids)  # a token appended since the last step (the P/D hand-off's)
            if m.executor is not None and not (m.terminated or m.failed):
                pooled.append((m, i))
            else:
                m.fill(bitmask, i)
    if len(pooled) > 1:
        import llguidance.torch

        try:
            llguidance.torch.fill_next_token_bitmask_par(pooled[0][0].executor, [(m._m, i) for m, i in pooled],
                                                         bitmask)
            return bitmask
        except Exception as e:
            if is_device_fault(e):
                raise
            # One matcher failed the batch's call: row by row, so the failure is its request's alone.
    for m, i in pooled:
        with isolated(reqs[i], STAGE):
            m.fill(bitmask, i)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on [S, V] logits: one copy of the bitmask to the logits' device, unpacked there
    (bytes -> bits -> [S, V] bool) into one masked_fill for the whole batch."""
    S, V = logits.shape
    words = bitmask.shape[1]
    bits = (bitmask.to(logits.device, non_blocking=True).view(torch.uint8).unsqueeze(-1)
            >> _BIT.to(logits.device)) & 1
    # Little-endian int32 words as bytes: byte 4w+j bit b is token 32w + 8j + b.
    allowed = bits.view(S, words * 32)[:, :V].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def apply_grammar_masks(logits: torch.Tensor, reqs) -> None:
    """In place on [S, V] logits: tokens a request's grammar does not allow next -> -inf."""
    bitmask = fill_bitmask(reqs)
    if bitmask is not None:
        apply_bitmask(logits, bitmask)
