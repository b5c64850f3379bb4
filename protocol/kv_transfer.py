"""`kv_transfer_params`: the P/D handshake between router, prefill worker and decode worker.

    router  ──{"do_remote_decode": true, "decode_budget"}, max_tokens=1, not streamed──▶ prefill worker
    router  ◀── the first token + KVTransferParams (where its KV blocks are pinned) ──┘
    router  ──the client's request + those KVTransferParams──▶ decode worker

Streamed hand-off (`"stream_kv": true` in the prefill request): the prefill worker answers in
two NDJSON lines, the first as soon as it has admitted the request and pinned its (not yet
computed) blocks: those params carry `stream_kv` and no first token. The router hands them to
the decode worker at once; it pulls each chunk as the prefill computes it and learns the first
token from the prefill's side channel when the prefill ends (docs/architecture.md).

The router treats the prefill's answer as opaque and forwards it; the prefill side builds a
`KVTransferParams`, the decode side parses it once (`from_dict`) before anything is allocated.
A client never sets these: the router strips any it sends.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated

from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

from pdserve.protocol.contract import COMPLETIONS_DEFAULT_MAX_TOKENS
from pdserve.protocol.kv_layout import KVLayout

PARAM = "kv_transfer_params"  # the request/response field, and the `param` of its errors
# The transport every prefill worker serves (worker/kv/registry.py names the others); params
# from a prefill worker that predates the `transport` field mean it.
BASE_TRANSPORT = "tcp"
PREFILL_MAX_TOKENS = 1  # a prefill runs the prompt and samples exactly the first token


class KVTransferParamsError(ValueError):
    """Malformed or incompatible params; `param` names the request field for the 400."""

    param = PARAM


BUDGET = "decode_budget"  # in a prefill request's params: the client's own token budget


STREAM_KV = "stream_kv"  # in a prefill request: announce the params early (two NDJSON lines)
NDJSON = "application/x-ndjson"  # the streamed hand-off's answer from a prefill worker
# The error code of a decode worker that cannot take streamed params (it pulls from no one): the
# router then waits for the prefill's answer and hands over its final params instead.
STREAM_UNSUPPORTED = "kv_stream_unsupported"


def remote_decode_request(budget: dict | None = None, stream_kv: bool = False) -> dict:
    """What the router puts in a prefill request: keep the KV, answer with where it is. With
    `budget` (the client's max_tokens or max_completion_tokens, and min_tokens) the prefill
    worker refuses at once what the decode worker would refuse for it (prompt + max_tokens over
    the context, min_tokens over max_tokens): otherwise the decode leg fails after the prefill,
    and the pinned KV waits for nobody until its TTL."""
    return {
        "do_remote_decode": True,
        **({BUDGET: budget} if budget else {}),
        **({STREAM_KV: True} if stream_kv else {}),
    }


def decode_budget(body: dict) -> dict:
    """The client's budget fields as the decode worker will read them (a completions request
    without max_tokens gets that field's default, 16; chat's default fits the context)."""
    out = {k: body[k] for k in ("max_completion_tokens", "max_tokens", "min_tokens") if body.get(k) is not None}
    if "prompt" in body and "max_tokens" not in body:
        out["max_tokens"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    return out


def wants_remote_decode(params) -> bool:
    """Prefill side: the caller asks this worker to prefill only and hand its KV over."""
    if isinstance(params, (RemoteDecodeRequest, KVTransferParams, PrefixPull)):
        return isinstance(params, RemoteDecodeRequest)
    return bool(params) and bool(params.get("do_remote_decode"))


def wants_stream_kv(params) -> bool:
    """Prefill side: announce the pin at admission and let the decode side read chunks as they land."""
    if isinstance(params, (RemoteDecodeRequest, PrefixPull)):
        return isinstance(params, RemoteDecodeRequest) and params.stream_kv
    return wants_remote_decode(params) and params.get(STREAM_KV) is True


def is_streamed(params) -> bool:
    """Decode side: params announced before the prefill ended (no first token yet)."""
    if isinstance(params, (KVTransferParams, PrefixPull)):
        return isinstance(params, KVTransferParams) and params.stream_kv
    return is_remote_decode(params) and params.get(STREAM_KV) is True


def is_remote_decode(params) -> bool:
    """Decode side: these params came from a prefill worker (its KV is to be pulled)."""
    if isinstance(params, (RemoteDecodeRequest, KVTransferParams, PrefixPull)):
        return isinstance(params, KVTransferParams)
    return bool(params) and not params.get("do_remote_decode") and PREFIX_FROM not in params


def prefill_request(body: dict, stream_kv: bool = False) -> dict:
    """The prefill worker's request built from the client's: one token, not streamed, KV kept.
    The one place the prefill's token budget is set (`max_completion_tokens` too when given).
    `min_tokens` is cut to what applies to the first token (EOS and stop tokens are barred from
    it when min_tokens >= 1); the decode worker gets the client's value and applies the rest."""
    out = dict(
        body,
        stream=False,
        max_tokens=PREFILL_MAX_TOKENS,
        **{PARAM: remote_decode_request(decode_budget(body), stream_kv)},
    )
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = PREFILL_MAX_TOKENS
    if out.get("min_tokens"):
        out["min_tokens"] = min(out["min_tokens"], PREFILL_MAX_TOKENS)
    out.pop("stream_options", None)
    return out


@dataclass(frozen=True)
class KVTransferParams:
    """Where a finished prefill's KV blocks wait, and what the decode worker needs to pull them."""

    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    # Every prompt block; a hybrid cache's sliding tail after them (KVLayout.handoff_blocks).
    remote_block_ids: tuple[int, ...]
    num_prompt_tokens: int
    # Sampled by the prefill; the decode worker appends it, never recomputes it. None in streamed
    # params (the prefill has not run yet): the decode side learns it from the side channel.
    first_token_id: int | None
    transfer_token: str  # proves the puller was handed these params; the pin table checks it
    kv_layout: KVLayout  # of the prefill worker's cache; the decode worker's must equal it
    transport: str = BASE_TRANSPORT  # a registered transport's name (worker/kv/registry.py)
    expires_at: float | None = None  # wall clock; after it the prefill frees the blocks itself
    # The prefill worker's tensor-parallel size: rank r serves its KV heads on remote_port + r
    # (worker/kv/tp_transfer.py maps them onto the decode worker's ranks).
    kv_tp_size: int = 1
    stream_kv: bool = False  # announced at admission: blocks become readable chunk by chunk
    # The LoRA adapter the prefill ran (None: the base model): the KV is that adapter's, and the
    # decode worker must run the same one (it refuses these params otherwise).
    lora_name: str | None = None
    # Where the prefill worker read that adapter from (a directory, made absolute, or a hub id): a
    # decode worker without it loads it from there when runtime loading is allowed.
    lora_path: str | None = None
    # The prefill worker's span as W3C headers (traceparent[, tracestate]): the decode worker's
    # hand-off spans link to it, and it parents them when the decode call came without one.
    trace_context: dict[str, str] | None = None

    @property
    def block_size(self) -> int:
        return self.kv_layout.block_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d["remote_block_ids"] = list(self.remote_block_ids)
        d["kv_layout"] = str(self.kv_layout)  # its wire form, as it always was
        if not self.stream_kv:
            del d[STREAM_KV]  # a plain hand-off's params stay as they always were
        if self.lora_name is None:
            del d["lora_name"]
        if self.lora_path is None:
            del d["lora_path"]
        if self.trace_context is None:
            del d["trace_context"]
        return d

    @classmethod
    def from_dict(cls, params: dict) -> "KVTransferParams":
        """Parse a decode request's params; refuses anything missing, mistyped or inconsistent."""
        if not isinstance(params, dict):
            raise KVTransferParamsError(f"{PARAM} must be an object")
        stream_kv = params.get(STREAM_KV, False)
        if not isinstance(stream_kv, bool):
            raise KVTransferParamsError(f"{PARAM}.{STREAM_KV} must be a boolean")
        values = {name: params.get(name) for name in _REQUIRED}
        for name, typ in _REQUIRED.items():
            v = values[name]
            if name == "first_token_id" and stream_kv and v is None:
                continue
            if not isinstance(v, typ) or isinstance(v, bool):
                raise KVTransferParamsError(f"{PARAM}.{name} is missing or not a {typ.__name__}")
        ids = values["remote_block_ids"]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise KVTransferParamsError(f"{PARAM}.remote_block_ids must be a list of integers")
        try:
            layout = KVLayout.parse(values["kv_layout"])
        except ValueError as e:
            raise KVTransferParamsError(f"{PARAM}.kv_layout {values['kv_layout']!r} {e}") from None
        block_size = layout.block_size
        if (
            block_size < 1
            or values["num_prompt_tokens"] < 1
            or len(ids) != layout.handoff_blocks(values["num_prompt_tokens"])
        ):
            raise KVTransferParamsError(f"{PARAM}: remote_block_ids do not cover num_prompt_tokens")
        transport = params.get("transport", BASE_TRANSPORT)
        expires_at = params.get("expires_at")
        tp_size = params.get("kv_tp_size", 1)
        lora_name = params.get("lora_name")
        if lora_name is not None and (not isinstance(lora_name, str) or not lora_name):
            raise KVTransferParamsError(f"{PARAM}.lora_name must be a non-empty string")
        lora_path = params.get("lora_path")
        if lora_path is not None and (not isinstance(lora_path, str) or not lora_path or lora_name is None):
            raise KVTransferParamsError(f"{PARAM}.lora_path must be a non-empty string, with lora_name")
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or not 1 <= tp_size <= 64:
            raise KVTransferParamsError(f"{PARAM}.kv_tp_size must be an integer in [1, 64]")
        if not isinstance(transport, str) or (expires_at is not None and not isinstance(expires_at, (int, float))):
            raise KVTransferParamsError(f"{PARAM}.transport must be a string and expires_at a number")
        return cls(**{**values, "kv_layout": layout, "remote_block_ids": tuple(ids), "transport": transport,
                      "expires_at": expires_at, "kv_tp_size": tp_size, "stream_kv": stream_kv,
                      "lora_name": lora_name, "lora_path": lora_path,
                      "trace_context": _trace_context(params.get("trace_context"))})

    def check_compatible(self, num_prompt_tokens: int, block_size: int, vocab_size: int) -> None:
        """Decode side, against this worker and this request: the checks that need both."""
        if self.first_token_id is not None and not 0 <= self.first_token_id < vocab_size:
            raise KVTransferParamsError(f"{PARAM}.first_token_id is out of the vocabulary")
        if self.num_prompt_tokens != num_prompt_tokens:
            raise KVTransferParamsError(f"{PARAM} describe {self.num_prompt_tokens} prompt tokens but the "
                                        f"prompt has {num_prompt_tokens}")
        if self.block_size != block_size:
            raise KVTransferParamsError(f"the prefill worker's KV block size is {self.block_size} but this "
                                        f"worker's is {block_size}; P and D must match")


@dataclass(frozen=True)
class RemoteDecodeRequest:
    """Prefill side: what the router asks of a prefill worker (`remote_decode_request`): prefill
    only, keep the KV for a decode worker. `decode_budget` is the client's budget as sent (checked
    by the server, serving.check_decode_budget); `stream_kv` asks for the streamed hand-off."""

    decode_budget: dict | None = None
    stream_kv: bool = False
    # A peer's pin of a prefix of the prompt that this worker lacks (as PrefixPull's `source`).
    prefix_from: "KVTransferParams | None" = None

    def to_dict(self) -> dict:
        d = remote_decode_request(self.decode_budget, self.stream_kv)
        if self.prefix_from is not None:
            d[PREFIX_FROM] = self.prefix_from.to_dict()
        return d


PREFIX_FROM = "prefix_from"  # a whole request's params: a peer holds a prefix of its prompt (PrefixPull)


@dataclass(frozen=True)
class PrefixPull:
    """What the router hands a worker that serves a request itself (no P/D hand-off) when another
    worker of the pool holds a prefix of its prompt that this one lacks: `source`, the params of a
    pin of that prefix on the peer (the peer's answer to a one-token prefill of the prefix, so its
    transfer token is bound to the prefix's digest). The worker pulls those blocks through its KV
    transport if its estimate of the pull beats its estimate of recomputing them, else releases
    the pin; either way it computes the rest of the prompt itself (docs/kv-cache.md)."""

    source: KVTransferParams

    def to_dict(self) -> dict:
        return {PREFIX_FROM: self.source.to_dict()}


def prefix_pull_params(source: dict) -> dict:
    """The `kv_transfer_params` of a whole request whose prompt's prefix the pin `source` (a peer's
    params, as its answer has them) holds."""
    return {PREFIX_FROM: source}


def prefix_source(params) -> "KVTransferParams | None":
    """The peer's pin of a prefix these params hand over: a whole request's (PrefixPull) or a
    prefill's (RemoteDecodeRequest.prefix_from); None for any other params."""
    if isinstance(params, PrefixPull):
        return params.source
    return params.prefix_from if isinstance(params, RemoteDecodeRequest) else None


def parse_kv_transfer_params(params) -> "KVTransferParams | RemoteDecodeRequest | PrefixPull | None":
    """The one parse of a request body's `kv_transfer_params` on a worker: a prefill request's
    (`do_remote_decode`) becomes a RemoteDecodeRequest (lenient, as it always was: a budget that
    is not an object is no budget, `stream_kv` counts only when exactly true); a decode request's
    a validated KVTransferParams (KVTransferParamsError otherwise); none (or empty) is None.
    Objects already parsed pass through."""
    if isinstance(params, (KVTransferParams, RemoteDecodeRequest, PrefixPull)) or not params:
        return params or None
    if not isinstance(params, dict):
        raise KVTransferParamsError(f"{PARAM} must be an object")
    prefix = None
    if PREFIX_FROM in params:
        try:
            prefix = KVTransferParams.from_dict(params[PREFIX_FROM])
        except KVTransferParamsError as e:
            raise KVTransferParamsError(f"{PARAM}.{PREFIX_FROM}: {e}") from None
    if wants_remote_decode(params):
        budget = params.get(BUDGET)
        return RemoteDecodeRequest(budget if isinstance(budget, dict) else None, params.get(STREAM_KV) is True, prefix)
    if prefix is not None:
        if set(params) != {PREFIX_FROM}:
            raise KVTransferParamsError(f"{PARAM}.{PREFIX_FROM} goes with a whole request or a prefill's "
                                        "do_remote_decode, not with a hand-off")
        return PrefixPull(prefix)
    return KVTransferParams.from_dict(params)


def _trace_context(value) -> dict[str, str] | None:
    """Lenient, as a client's traceparent is: anything malformed is no context (a new trace),
    never a refused hand-off."""
    if not isinstance(value, dict):
        return None
    ctx = {k: v for k, v in value.items() if k in ("traceparent", "tracestate") and isinstance(v, str) and len(v) < 512}
    return ctx if "traceparent" in ctx else None


# The fields a decode worker cannot do without, and their wire types.
_REQUIRED = {"remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_request_id": str,
             "remote_block_ids": list, "num_prompt_tokens": int, "first_token_id": int,
             "transfer_token": str, "kv_layout": str}


def _validated(value) -> "KVTransferParams | RemoteDecodeRequest | PrefixPull | None":
    try:
        return parse_kv_transfer_params(value)
    except KVTransferParamsError as e:
        # A custom error keeps the parse's own message (the 400's text), without pydantic's prefix.
        raise PydanticCustomError(PARAM, "{message}", {"message": str(e)}) from None


# The request models' field (protocol/requests.py): validated with the body, by the one parse,
# into the object the worker carries to its engine.
KVTransferField = Annotated[KVTransferParams | RemoteDecodeRequest | PrefixPull | None,
                            PlainValidator(_validated, json_schema_input_type=dict | None)]
